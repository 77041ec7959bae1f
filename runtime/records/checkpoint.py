"""Checkpoints for exact resume, written so that a crash never leaves a loadable half.

Layout of one checkpoint::

    <run>/checkpoints/
        step-300/
            policy/            save_pretrained: config.json, model.safetensors, tokenizer files
            critic/            (specs with a critic) save_pretrained, or model.safetensors
            optimizer.pt       {"policy": ..., "critic": ..., "scheduler": ...} state dicts
            state.pt           {"step", "rng": {python, numpy, torch, cuda}, "extra": caller's state}
            COMPLETE           marker, written last: {"format", "step", "files", "sha256": {file: hex}}
        latest                 text "step-300": the newest complete checkpoint, for people and tools

Writing: everything goes to ``checkpoints/.tmp-step-N``, every file and folder is
fsynced, the folder is renamed to ``step-N`` with ``os.replace`` (atomic), then
``latest`` is replaced atomically and checkpoints beyond ``keep_last`` are removed.

Reading trusts only folders named ``step-N`` holding a valid ``COMPLETE`` marker whose
files all exist with the sizes it records. ``.tmp-*`` / ``.old-*`` leftovers of a crash are
removed by the next save or by :func:`clean_incomplete`; a ``step-N`` folder that fails its
marker is damaged (the writes above never leave one) and is *set aside* as
``damaged-step-N``, never deleted. A resume reads every file once more against the SHA-256
the marker recorded at write (:func:`inspect_checkpoints`, :func:`newest_loadable`): a
checkpoint whose damage lies only in files a resume does not read (the tokenizer files and
``config.json`` beside the weights) is still resumed from, exactly, saying so; a damaged
newest checkpoint (a flipped byte, a cut or missing file in the weights, ``optimizer.pt``
or ``state.pt``) is passed over for the one before it, with a note, and set aside; when
every checkpoint is damaged the run folder is left as it is and the resume refused
(run/folder.py).

The ``.pt`` files are loaded with ``torch.load(weights_only=True)``: they hold only
tensors and plain Python values, so loading never runs pickled code. ``extra_state`` is
checked for that at save time.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

from .. import faults
from ..errors import CheckpointWriteError
from ..models.loading import own_names, quiet_transformers, with_tied
from ..models.vision import save_image_processor
from .rng import capture_rng, restore_rng
from .run_dir import (CHECKPOINTS_DIR, COMPLETE_MARKER, CRITIC_DIR, LATEST_FILE, OPTIMIZER_FILE,
                      POLICY_DIR, STATE_FILE, fsync_dir, fsync_tree, write_text_atomic)

__all__ = [
    "Checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "clean_incomplete",
    "set_aside_after",
    "folder_state",
    "load_weights",
    "newest_loadable",
    "resume_notes",
    "inspect_checkpoints",
    "Inspection",
    "set_aside",
    "read_on_resume",
    "verify_checkpoint",
    "read_weights",
    "saveable",
]

FORMAT_VERSION = 1

_STEP_DIR = re.compile(r"^step-(\d+)$")


# ----------------------------------------------------------------------------- helpers

def _checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def _check_plain(obj: Any, where: str = "extra_state") -> None:
    """Raise TypeError unless ``obj`` is made of values ``torch.load(weights_only=True)`` reads."""
    if isinstance(obj, (type(None), bool, int, float, str, bytes, torch.Tensor, torch.Size, torch.dtype,
                        torch.device)):
        return
    if isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            _check_plain(item, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for key, item in obj.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise TypeError(f"{where}: key {key!r} of type {type(key).__name__} cannot be "
                                f"checkpointed (use str or int keys)")
            _check_plain(item, f"{where}[{key!r}]")
        return
    hint = " (convert with .item() or .tolist())" if isinstance(obj, (np.generic, np.ndarray)) else ""
    raise TypeError(f"{where} holds a {type(obj).__module__}.{type(obj).__qualname__}, which a "
                    f"checkpoint cannot store safely; use tensors, numbers, strings, lists "
                    f"and dicts{hint}")


def _read_marker(path: Path) -> dict[str, Any] | None:
    """The marker of a complete checkpoint folder, or None if it is incomplete or damaged."""
    marker = path / COMPLETE_MARKER
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not isinstance(info.get("step"), int):
        return None
    if not all((path / rel).is_file() for rel in info.get("files", [])):
        return None
    sizes = info.get("bytes", {})
    if not all((path / rel).stat().st_size == n for rel, n in sizes.items()):
        return None  # a file cut short (or grown) after the write
    return info


def _os_error(exc: BaseException) -> OSError | None:
    """The operating system's error behind a failed write, if that is what it was: an OSError
    itself, one it was raised from or during (torch), or safetensors' "(os error N)"."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        code = re.search(r"\(os error (\d+)\)", str(seen))
        if code:
            n = int(code.group(1))
            return OSError(n, os.strerror(n))
        seen = seen.__cause__ or seen.__context__
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)  # releases the GIL: files hash in parallel threads
    return h.hexdigest()


def _sha256_all(paths: list[Path]) -> list[str]:
    """The SHA-256 of each file, several files at once (a sharded model, the optimizer state)."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(paths)))) as pool:
        return list(pool.map(_sha256, paths))


def _step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def _save_module(module: Any, directory: Path) -> None:
    """``save_pretrained`` (HF layout, safetensors) when the module has it, else safetensors."""
    if hasattr(module, "save_pretrained"):
        with quiet_transformers():
            module.save_pretrained(directory)
    else:
        from safetensors.torch import save_model

        directory.mkdir(parents=True, exist_ok=True)
        save_model(module, str(directory / "model.safetensors"))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _write(tmp: Path, step: int, rng: dict[str, Any], extra: dict[str, Any], *, policy: Any, tokenizer: Any,
           optimizer: Any, scheduler: Any, critic: Any, critic_optimizer: Any) -> None:
    """Every file of checkpoint ``step`` into ``tmp``, the marker last (sizes and SHA-256 of the
    others), all fsynced."""
    tmp.mkdir()
    _save_module(policy, tmp / POLICY_DIR)
    if tokenizer is not None:
        with quiet_transformers():
            tokenizer.save_pretrained(tmp / POLICY_DIR)
    save_image_processor(policy, tmp / POLICY_DIR)  # a vision-language policy's (models/vision.py)
    if critic is not None:
        _save_module(critic, tmp / CRITIC_DIR)
    # through Python file objects: a failed write is then an OSError (torch's own writer
    # reports a full disk as "unexpected pos")
    with (tmp / OPTIMIZER_FILE).open("wb") as f:
        torch.save({
            "policy": optimizer.state_dict(),
            "critic": critic_optimizer.state_dict() if critic_optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
        }, f)
    with (tmp / STATE_FILE).open("wb") as f:
        torch.save({"format": FORMAT_VERSION, "step": step, "rng": rng, "extra": extra}, f)
    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    (tmp / COMPLETE_MARKER).write_text(
        json.dumps({"format": FORMAT_VERSION, "step": step, "files": files,
                    "bytes": {f: (tmp / f).stat().st_size for f in files},
                    "sha256": dict(zip(files, _sha256_all([tmp / f for f in files])))}, indent=1) + "\n",
        encoding="utf-8")
    fsync_tree(tmp)


# ----------------------------------------------------------------------------- public API

@dataclass
class Checkpoint:
    """A loaded checkpoint. Weights stay on disk: load them from ``policy_path``.

    ``AutoModelForCausalLM.from_pretrained(ckpt.policy_path)`` (and ``AutoTokenizer``)
    give the policy; :func:`load_weights` puts the weights into an existing model.
    """

    path: Path
    step: int
    policy_path: Path
    critic_path: Path | None
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    critic_optimizer: dict[str, Any] | None
    rng: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    def restore(self, *, optimizer: Any = None, scheduler: Any = None,
                critic_optimizer: Any = None, rng: bool = True) -> None:
        """Load the saved states into the given optimizer/scheduler objects and the RNGs.

        Build the optimizer over the restored model's parameters first (same order as
        when saved). Call this last, right before training continues, so that no draw
        happens between the RNG restore and the next step.
        """
        if optimizer is not None:
            optimizer.load_state_dict(self.optimizer)
        if scheduler is not None:
            if self.scheduler is None:
                raise ValueError(f"{self.path} holds no scheduler state")
            scheduler.load_state_dict(self.scheduler)
        if critic_optimizer is not None:
            if self.critic_optimizer is None:
                raise ValueError(f"{self.path} holds no critic optimizer state")
            critic_optimizer.load_state_dict(self.critic_optimizer)
        if rng:
            restore_rng(self.rng)


def save_checkpoint(run_dir: str | os.PathLike[str], step: int, *, policy: Any, tokenizer: Any,
                    optimizer: Any, scheduler: Any, critic: Any = None,
                    critic_optimizer: Any = None, extra_state: Mapping[str, Any] | None = None,
                    keep_last: int | None = None) -> Path:
    """Write checkpoint ``step`` of the run atomically; return its folder ``.../step-N``.

    ``policy`` (and ``critic``) are saved with ``save_pretrained`` (safetensors, HF
    layout), the tokenizer next to the policy; the optimizer(s) and scheduler as state
    dicts; the RNG states (captured on entry) and ``extra_state`` (data position,
    algorithm state, metric counters...: tensors and plain values only) in
    ``state.pt``. ``keep_last``: keep only the newest K complete checkpoints
    (None or 0 = keep all). Leftovers of interrupted saves are removed first.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    rng = capture_rng()  # before anything else can draw
    extra = dict(extra_state or {})
    _check_plain(extra)

    root = _checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    clean_incomplete(run_dir)

    name = f"step-{step}"
    tmp = root / f".tmp-{name}"
    _remove(tmp)
    try:
        _write(tmp, step, rng, extra, policy=policy, tokenizer=tokenizer, optimizer=optimizer,
               scheduler=scheduler, critic=critic, critic_optimizer=critic_optimizer)
    except Exception as exc:
        _remove(tmp)
        cause = _os_error(exc)
        if cause is None:
            raise
        # a full disk, a quota, a read-only folder: the older checkpoints are whole
        newest = latest_checkpoint(run_dir)
        raise CheckpointWriteError(
            f"checkpoint {name} could not be written to {root}: {cause.strerror or cause}; " + (
                f"{newest.name} is whole: make room, then `rldsl run --resume {run_dir}` continues from it"
                if newest is not None else "no earlier checkpoint exists")) from exc
    faults.at("checkpoint", step)

    final = root / name
    if final.exists():  # re-saving a step (e.g. after resuming from an earlier one)
        old = root / f".old-{name}"
        _remove(old)
        os.replace(final, old)
        os.replace(tmp, final)
        _remove(old)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    write_text_atomic(root / LATEST_FILE, name + "\n")

    if keep_last:
        for path in list_checkpoints(run_dir)[:-keep_last]:
            if path != final:
                _remove(path)
        fsync_dir(root)
    return final


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoint folders of the run, oldest step first."""
    root = _checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        step = _step_of(path)
        if step is None or not path.is_dir():
            continue
        info = _read_marker(path)
        if info is not None and info["step"] == step:
            found.append((step, path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of the run, or None.

    Decided by the completion markers, not by the ``latest`` file: a crash between the
    rename of a checkpoint and the update of ``latest`` still resumes from the newest.
    """
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def read_on_resume(rel: str) -> bool:
    """Whether a resume reads file ``rel`` of a checkpoint (relative to its folder): the
    weights (``*.safetensors`` of the policy and the critic), ``optimizer.pt`` and ``state.pt``.
    The tokenizer files and ``config.json`` / ``generation_config.json`` beside the weights are
    written for people and for ``from_pretrained``; a resume takes them from the model source."""
    return rel in (OPTIMIZER_FILE, STATE_FILE) or rel.endswith(".safetensors")


@dataclass
class Inspection:
    """What :func:`inspect_checkpoints` found in one ``step-N`` folder. ``marker``: why its
    ``COMPLETE`` marker cannot be trusted (None when it can: then ``damaged`` lists each file
    that is missing, of another size or of another SHA-256 than at write, as (file, what), and
    ``intact`` the files that match)."""

    path: Path
    marker: str | None = None
    damaged: list[tuple[str, str]] = field(default_factory=list)
    intact: list[str] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return self.marker is None and not self.damaged

    @property
    def resumable(self) -> bool:
        """Exactly resumable: whole, or damaged only in files a resume does not read."""
        return self.marker is None and not any(read_on_resume(rel) for rel, _ in self.damaged)

    def problem(self) -> str | None:
        """One line: what is damaged (every damaged file), or None when whole."""
        if self.marker is not None:
            return self.marker
        return "; ".join(f"{rel} {what}" for rel, what in self.damaged) or None


def _inspect(path: Path) -> Inspection:
    try:
        info = json.loads((path / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return Inspection(path, f"no {COMPLETE_MARKER} marker")
    except (OSError, ValueError) as exc:
        return Inspection(path, f"an unreadable {COMPLETE_MARKER} marker ({exc})")
    if not isinstance(info, dict) or info.get("step") != _step_of(path):
        return Inspection(path, f"a {COMPLETE_MARKER} marker of another step")
    found = Inspection(path)
    recorded, sizes = info.get("sha256", {}), info.get("bytes", {})
    present = []
    for rel in info.get("files", []):
        f = path / rel
        if not f.is_file():
            found.damaged.append((rel, "is missing"))
        elif sizes.get(rel) is not None and f.stat().st_size != sizes[rel]:
            found.damaged.append((rel, f"has {f.stat().st_size} bytes, {sizes[rel]} when written"))
        else:
            present.append(rel)
    checked = [rel for rel in present if rel in recorded]
    digests = dict(zip(checked, _sha256_all([path / rel for rel in checked])))
    for rel in present:
        if rel in digests and digests[rel] != recorded[rel]:
            found.damaged.append((rel, "differs from what was written (SHA-256 mismatch)"))
        else:
            found.intact.append(rel)
    return found


def verify_checkpoint(path: str | os.PathLike[str]) -> str | None:
    """Why checkpoint folder ``path`` cannot be trusted (a missing marker or file, a file whose
    size or SHA-256 differs from what the write recorded: every such file, ``;``-separated), or
    None when it is whole. Reads every file once. Checkpoints written before checksums were
    recorded are checked by their marker only."""
    return _inspect(Path(path)).problem()


def _step_folders(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Every ``step-N`` folder of the run, whatever its state, newest first."""
    root = _checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return [p for _, p in sorted(((_step_of(p), p) for p in root.iterdir()
                                  if _step_of(p) is not None and p.is_dir()), reverse=True)]


def inspect_checkpoints(run_dir: str | os.PathLike[str]) -> list[Inspection]:
    """Every ``step-N`` folder of the run inspected, newest first, down to the newest one that
    is exactly resumable (included; every file read once)."""
    found = []
    for path in _step_folders(run_dir):
        found.append(_inspect(path))
        if found[-1].resumable:
            break
    return found


def resume_notes(found: list[Inspection]) -> tuple[Path | None, list[str]]:
    """From :func:`inspect_checkpoints`' findings: the checkpoint a resume continues from exactly
    (None if there is none) and a note for each newer ``step-N`` folder passed over as damaged
    (and for damage the resume does not read)."""
    notes: list[str] = []
    for f in found:
        if f.resumable:
            if f.damaged:
                notes.append(f"checkpoint {f.path.name}: {f.problem()}; a resume does not read "
                             f"{'it' if len(f.damaged) == 1 else 'them'} (the tokenizer and the model's "
                             f"config come from the model source): resuming from it, exactly")
            elif notes:
                notes.append(f"resuming from {f.path.name} instead")
            return f.path, notes
        notes.append(f"checkpoint {f.path.name} is damaged ({f.problem()}): not resumed from; "
                     f"kept as damaged-{f.path.name}")
    return None, notes


def newest_loadable(run_dir: str | os.PathLike[str]) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of the run a resume can continue from exactly: whole, or damaged
    only in files a resume does not read (None if there is none); and the notes of
    :func:`resume_notes`."""
    return resume_notes(inspect_checkpoints(run_dir))


def set_aside(path: str | os.PathLike[str]) -> Path:
    """Move a damaged ``step-N`` folder to ``damaged-step-N`` beside it (``-2``, ``-3``, ... when
    taken), out of every listing and never deleted; returns the new path."""
    path = Path(path)
    target = path.with_name(f"damaged-{path.name}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"damaged-{path.name}-{n}")
    os.replace(path, target)
    fsync_dir(path.parent)
    return target


def clean_incomplete(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove what interrupted saves left behind (``.tmp-*`` and ``.old-*`` folders); return
    the removed paths. A ``step-N`` folder without a valid marker is damaged, not a leftover
    (saves rename whole folders): it is set aside as ``damaged-step-N``, not removed. Complete
    checkpoints are never touched."""
    root = _checkpoints_dir(run_dir)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for path in sorted(root.iterdir()):
        if path.name.startswith((".tmp-", ".old-")):
            _remove(path)
            removed.append(path)
        elif _step_of(path) is not None and path.is_dir() and _read_marker(path) is None:
            set_aside(path)
    return removed


def set_aside_after(run_dir: str | os.PathLike[str], step: int) -> list[Path]:
    """Set aside (``damaged-step-N``) every checkpoint newer than ``step``: a resume from an
    earlier one passes over only damaged ones. Returns their old paths. ``latest`` is rewritten
    to match."""
    moved = []
    for path in _step_folders(run_dir):
        if (_step_of(path) or 0) > step:
            set_aside(path)
            moved.append(path)
    remaining = list_checkpoints(run_dir)
    latest = _checkpoints_dir(run_dir) / LATEST_FILE
    if remaining:
        write_text_atomic(latest, remaining[-1].name + "\n")
    elif latest.exists():
        latest.unlink()
    return moved


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a checkpoint folder (``.../checkpoints/step-N``) or the newest one of a run folder.

    Raises FileNotFoundError if there is none, and ValueError for an incomplete folder.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if _step_of(path) is None:  # a run folder
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"no complete checkpoint in {path / CHECKPOINTS_DIR}")
        path = latest
    info = _read_marker(path)
    if info is None:
        raise ValueError(f"{path} is not a complete checkpoint (no valid {COMPLETE_MARKER} "
                         f"marker: the save was interrupted)")
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    optim = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {state.get('format')!r} is not supported "
                         f"(expected {FORMAT_VERSION})")
    critic = path / CRITIC_DIR
    return Checkpoint(path=path, step=int(state["step"]), policy_path=path / POLICY_DIR,
                      critic_path=critic if critic.is_dir() else None,
                      optimizer=optim["policy"], scheduler=optim["scheduler"],
                      critic_optimizer=optim["critic"], rng=state["rng"],
                      extra=dict(state["extra"]))


def read_weights(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of a folder (single-file or sharded), on CPU."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device="cpu"))
    return state


def folder_state(model: torch.nn.Module, directory: str | os.PathLike[str],
                 saved: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The weights of a saved folder under ``model``'s own names (``model`` may be on the meta
    device: only its names are read). transformers 5 saves some modules in their released layout,
    not their in-memory one (a MoE's fused experts as one tensor per expert): such a folder is read
    through its conversions (``from_pretrained``). What resuming, ``rldsl export`` and ``rldsl
    eval`` read a checkpoint's policy with. ``saved``: the folder's tensors, when already read."""
    state = own_names(read_weights(directory) if saved is None else saved, model)
    own = model.state_dict()
    if set(state) - set(own) and hasattr(model, "from_pretrained") and (Path(directory) / "config.json").is_file():
        with quiet_transformers():
            state = type(model).from_pretrained(str(directory)).state_dict()
    return state


def load_weights(model: torch.nn.Module, directory: str | os.PathLike[str]) -> None:
    """Load the safetensors weights in ``directory`` into ``model`` in place.

    Accepts single-file and sharded folders. Keys missing from the files are allowed
    only for tied parameters (e.g. ``lm_head.weight`` sharing the embedding); any other
    missing or unexpected key raises KeyError.
    """
    state = folder_state(model, directory)
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise KeyError(f"{directory} holds weights the model does not have: {unexpected[:5]}"
                       + (" ..." if len(unexpected) > 5 else ""))
    state = with_tied(state, model)
    missing = sorted(set(own) - set(state))
    if missing:
        raise KeyError(f"{directory} lacks weights of the model: {missing[:5]}"
                       + (" ..." if len(missing) > 5 else ""))
    model.load_state_dict(state, strict=False)


def saveable(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every tensor that is a view into a larger buffer (gathered shards)
    copied out: safetensors refuses to save a tensor that does not cover its storage."""
    out = {}
    for k, v in state.items():
        whole = v.is_contiguous() and v.storage_offset() == 0 and \
            v.untyped_storage().nbytes() == v.numel() * v.element_size()
        out[k] = v if whole else v.clone(memory_format=torch.contiguous_format)
    return out
