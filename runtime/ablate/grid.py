"""The grid of an ablation study: a base spec, axes of alternatives, seeds; the cell specs.

An **axis** names a slot and its alternatives, ``"normalizer: group_std(eps=1e-6) | none"``,
or the pseudo-slot ``algorithm`` whose alternatives are whole specs (``"algorithm: grpo |
dapo"``: the variant takes every slot in which that spec differs from the base). An
alternative may carry a label, ``"clip_higher = clip(low=0.2, high=0.28)"``; otherwise one
is derived from its text.

A **variant** is one combination (``--one-at-a-time``: the base plus each alternative
alone, as the Tricks-or-Traps paper does; otherwise the full product of the axes),
written to ``<study>/cells/<variant>.rl`` as a plain spec that ``extends`` the base, so
``rldsl run <study>/cells/<variant>.rl`` reruns it from any folder. A **cell** is a variant
run with one seed.

A study folder holds one grid: its definition (base spec text, axes, mode, ``--set``
keys) is saved in ``study.json`` and must match when the study is run again; seeds,
steps, the threshold and the number of jobs may change.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rldsl import registry
from rldsl.config_files import read_config_file
from rldsl.errors import SpecError
from rldsl.suggest import did_you_mean
from rldsl.explain import diff as explain_diff
from rldsl.spec import Algorithm, library, load, loads
from ..errors import GridError

__all__ = ["ALGORITHM_AXIS", "BASE_VARIANT", "Alternative", "Axis", "GridError", "Study",
           "Variant", "parse_vary", "read_grid_file", "build_study", "write_cells"]

ALGORITHM_AXIS = "algorithm"
BASE_VARIANT = "base"
CELLS_DIR = "cells"

_LABEL = re.compile(r"[a-z][a-z0-9_]*")
_LABELLED = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\S.*)$")
_COMPONENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Alternative:
    """One choice on an axis: its label and the slot lines it writes (slot -> value text)."""

    label: str
    text: str
    lines: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Axis:
    """A slot (or ``algorithm``) and its alternatives, in the order given."""

    key: str
    alternatives: tuple[Alternative, ...]


@dataclass
class Variant:
    """A spec derived from the base: its name (= file stem = algorithm name), the
    (axis, label) choices that made it and the slot lines it overrides."""

    name: str
    choices: tuple[tuple[str, str], ...]
    lines: dict[str, str]
    is_base: bool = False
    error: str | None = None          # the spec checker's message when the variant is invalid
    changes: list[str] = field(default_factory=list)   # the structural diff against the base
    diff_rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        """How the report names the variant."""
        if self.is_base:
            return BASE_VARIANT
        return ", ".join(label for _, label in self.choices)


@dataclass
class Study:
    """Everything that defines a study, resolved and checked."""

    base: str                 # as given: a library name or a spec path
    base_algo: Algorithm
    axes: list[Axis]
    one_at_a_time: bool
    seeds: list[int]
    steps: int
    sets: list[str]
    threshold: float
    name: str

    def definition(self) -> dict[str, Any]:
        """What must be the same when a study folder is run again."""
        return {"base": self.base_algo.name, "base_source": self.base_algo.source,
                "base_parents": dict(sorted(self.base_algo.parent_sources.items())),
                "axes": [[a.key, [[alt.label, alt.text] for alt in a.alternatives]]
                         for a in self.axes],
                "one_at_a_time": self.one_at_a_time, "set": list(self.sets)}

    def digest(self) -> str:
        """8 hex digits of the definition: the default study folder's suffix."""
        text = json.dumps(self.definition(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    def variants(self) -> list[Variant]:
        """The variants to run, base first in one-at-a-time mode (names unique)."""
        reserved = {self.base_algo.name, *self.base_algo.extends}
        out: list[Variant] = []
        if self.one_at_a_time:
            out.append(Variant(name=_free(BASE_VARIANT, reserved), choices=(), lines={},
                               is_base=True))
            combos = [((axis.key, alt),) for axis in self.axes for alt in axis.alternatives]
        else:
            combos = list(itertools.product(*[[(axis.key, alt) for alt in axis.alternatives]
                                              for axis in self.axes]))
        for combo in combos:
            lines: dict[str, str] = {}
            for _, alt in combo:
                lines.update(dict(alt.lines))  # a later axis wins on a shared slot
            name = "__".join(alt.label for _, alt in combo)
            name = _free(name, reserved | {v.name for v in out})
            out.append(Variant(name=name, choices=tuple((k, alt.label) for k, alt in combo),
                               lines=lines))
        return out


def _free(name: str, taken: set[str]) -> str:
    """``name``, or ``name_cell`` (``_cell2`` ...) when the base or a variant has it."""
    if name not in taken:
        return name
    for i in itertools.count(1):
        candidate = f"{name}_cell" if i == 1 else f"{name}_cell{i}"
        if candidate not in taken:
            return candidate
    raise AssertionError  # pragma: no cover - count() never ends


# ----------------------------------------------------------------------------- parsing

def _slug(text: str) -> str:
    """A label from an alternative's text: ``clip(low=0.2, high=0.28)`` -> ``clip_low_0p2_high_0p28``."""
    s = text.strip().lower().replace(".", "p").replace("-", "m").replace("+", "")
    s = re.sub(r"[^a-z0-9]+", "_", s).strip("_")
    if not s or not s[0].isalpha():
        s = "v_" + s
    return s


def _components(text: str) -> str:
    """Only the component names of a slot value: ``overlong, zero_variance`` -> ``overlong_zero_variance``."""
    top = re.sub(r"\([^()]*\)", "", text)  # drop the argument lists, then split the components
    names = [m.group(0).lower() for part in top.split(",")
             if (m := _COMPONENT.match(part.strip())) is not None]
    return "_".join(names) or _slug(text)


def parse_vary(text: str) -> tuple[str, list[tuple[str | None, str]]]:
    """``"SLOT: ALT | ALT"`` -> (slot, [(label or None, alternative text)]); raises GridError."""
    if "\n" in text or "\r" in text:
        raise GridError(f"--vary {text!r}: one line only (an alternative is one slot value)")
    key, sep, rest = text.partition(":")
    key = key.strip()
    if not sep or not key:
        raise GridError(f"--vary {text!r}: expected 'SLOT: COMPONENT(args) | COMPONENT(args)', "
                        f"e.g. --vary \"normalizer: group_std | batch_std\"")
    if key != ALGORITHM_AXIS and key not in registry.SLOTS:
        hint = did_you_mean(key, [*registry.SLOTS, ALGORITHM_AXIS])
        raise GridError(f"--vary {text!r}: unknown slot {key!r}"
                        + (f"; {hint}" if hint else f"; slots: {', '.join(registry.SLOTS)}, "
                                                      f"or '{ALGORITHM_AXIS}' for whole specs"))
    alts: list[tuple[str | None, str]] = []
    for part in rest.split("|"):
        part = part.strip()
        if not part:
            raise GridError(f"--vary {text!r}: an empty alternative (check the '|' separators)")
        m = _LABELLED.match(part)
        if m is not None:
            label, value = m.group(1), m.group(2).strip()
            if not _LABEL.fullmatch(label):
                raise GridError(f"--vary {text!r}: label {label!r} must start with a lower case "
                                f"letter, then lower case letters, digits or '_'")
            alts.append((label, value))
        else:
            alts.append((None, part))
    return key, alts


_ARG = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([^,()]+)")


def _params_differ(text: str, base_values: Sequence[Any]) -> bool:
    """True when ``text`` names the base's component with a parameter set differently
    (``clip(high=0.28)`` against a base ``clip(low=0.2, high=0.2)``): its label then
    needs the parameters."""
    m = _COMPONENT.match(text.strip())
    if m is None or len(base_values) != 1 or m.group(0) != base_values[0].component:
        return False
    for k, v in _ARG.findall(text):
        if k not in base_values[0].params:
            return True
        b = base_values[0].params[k]
        try:
            same = float(v) == float(b)
        except (TypeError, ValueError):
            same = v.strip().lower() == str(b).lower()
        if not same:
            return True
    return False


def _slot_text(values: Sequence[Any]) -> str:
    """A resolved slot as spec text (``SlotValue`` prints every parameter)."""
    return ", ".join(str(v) for v in values)


def _axis(key: str, alts: list[tuple[str | None, str]], base: Algorithm) -> Axis:
    """Resolve the alternatives of one axis into labelled slot lines."""
    made: list[tuple[str | None, str, tuple[tuple[str, str], ...], str]] = []
    for label, text in alts:
        if key == ALGORITHM_AXIS:
            try:
                other = load(text)
            except SpecError as exc:
                raise GridError(f"--vary {key}: alternative {text!r} is not a valid spec:\n"
                                f"{exc.render()}") from None
            lines = tuple((row["slot"], _slot_text(other.slots[row["slot"]]))
                          for row in explain_diff(base, other)["slots"] if row["status"] != "same")
            made.append((label, text, lines, other.name))
        else:
            made.append((label, text, ((key, text),), ""))
    # automatic labels: component names, with parameters where that is ambiguous
    short = [auto or _components(text) for _, text, _, auto in made]
    out: list[Alternative] = []
    for (label, text, lines, auto), s in zip(made, short):
        if label is None:
            ambiguous = short.count(s) > 1 or (
                key != ALGORITHM_AXIS and _params_differ(text, base.slots[key]))
            label = _slug(text) if ambiguous and not auto else s
            if not _LABEL.fullmatch(label):
                label = _slug(label)
        out.append(Alternative(label=label, text=text, lines=lines))
    labels = [a.label for a in out]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise GridError(f"--vary {key}: two alternatives have the label {dup[0]!r}: give "
                        f"distinct labels ('name = component(...)')")
    return Axis(key=key, alternatives=tuple(out))


def _unique_across_axes(axes: list[Axis]) -> list[Axis]:
    """Prefix an automatic label with its slot when two axes would share it (one-at-a-time names)."""
    counts: dict[str, int] = {}
    for axis in axes:
        for alt in axis.alternatives:
            counts[alt.label] = counts.get(alt.label, 0) + 1
    fixed = []
    for axis in axes:
        alts = tuple(Alternative(label=f"{axis.key}_{a.label}" if counts[a.label] > 1 else a.label,
                                 text=a.text, lines=a.lines) for a in axis.alternatives)
        fixed.append(Axis(axis.key, alts))
    return fixed


# ----------------------------------------------------------------------------- grid files

_GRID_KEYS = {"base", "vary", "one_at_a_time", "seeds", "steps", "set", "threshold", "jobs",
              "name", "ray_address"}


def read_grid_file(path: str | Path) -> dict[str, Any]:
    """A grid TOML file as a dict of the command's options (relative paths: to the file).

    Keys: ``base``, ``vary`` (list of ``"SLOT: ALT | ALT"``), ``one_at_a_time``, ``seeds``,
    ``steps``, ``set`` (list of ``"key=value"``), ``threshold``, ``jobs``, ``name``,
    ``ray_address``.
    """
    path = Path(path)
    data = read_config_file(path, error=GridError, default="toml", what="grid file")
    unknown = sorted(set(data) - _GRID_KEYS)
    if unknown:
        hint = did_you_mean(unknown[0], _GRID_KEYS)
        raise GridError(f"{path}: unknown key {unknown[0]!r}"
                        + (f"; {hint}" if hint else f"; keys: {', '.join(sorted(_GRID_KEYS))}"))
    types = {"base": str, "one_at_a_time": bool, "seeds": int, "steps": int,
             "threshold": (int, float), "jobs": int, "name": str, "ray_address": str}
    for key, kind in types.items():
        if key not in data:
            continue
        value = data[key]
        ok = isinstance(value, bool) if kind is bool else (
            isinstance(value, kind) and not isinstance(value, bool))
        if not ok:
            raise GridError(f"{path}: {key} = {value!r} has the wrong type")
    for key in ("vary", "set"):
        if key in data and not (isinstance(data[key], list) and all(isinstance(x, str) for x in data[key])):
            raise GridError(f"{path}: {key} must be a list of strings")
    base = data.get("base")
    if isinstance(base, str) and (base.endswith(".rl") or "/" in base):
        resolved = (path.parent / base)
        if resolved.is_file():  # a spec path is relative to the grid file
            data["base"] = str(resolved)
    return data


# ----------------------------------------------------------------------------- building

def _pop_reserved_sets(sets: Sequence[str]) -> tuple[list[str], int | None]:
    """Refuse --set keys the study owns (seed, out); turn train.steps into the step count."""
    kept: list[str] = []
    steps: int | None = None
    for item in sets:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise GridError(f"--set {item!r}: expected key=value")
        if key in ("seed", "out"):
            raise GridError(f"--set {key}=...: the study chooses each cell's {key} "
                            f"(use --seeds N and --out DIR)")
        if key == "train.steps":
            try:
                steps = int(value)
            except ValueError:
                raise GridError(f"--set {item!r}: train.steps must be an integer") from None
            continue
        kept.append(f"{key}={value.strip()}")
    return kept, steps


def build_study(base: str, vary: Sequence[str], *, one_at_a_time: bool = False, seeds: int = 3,
                steps: int | None = None, sets: Sequence[str] = (), threshold: float = 0.5,
                name: str | None = None) -> Study:
    """Check and resolve a grid; raises GridError (bad grid) or SpecError (bad BASE)."""
    from ..config import load_config
    from ..errors import ConfigError

    if seeds < 1:
        raise GridError(f"--seeds must be at least 1, got {seeds}")
    if not vary:
        raise GridError("nothing to vary: give at least one --vary \"SLOT: ALT | ALT\"")
    base_algo = load(base)
    sets_kept, set_steps = _pop_reserved_sets(sets)
    try:
        cfg = load_config(None, sets_kept)
    except ConfigError as exc:
        raise GridError(str(exc)) from None
    steps = steps if steps is not None else (set_steps if set_steps is not None else cfg.train.steps)
    if steps < 1:
        raise GridError(f"--steps must be at least 1, got {steps}")
    axes: list[Axis] = []
    seen: set[str] = set()
    for text in vary:
        key, alts = parse_vary(text)
        if key in seen:
            raise GridError(f"--vary {key}: the slot is varied twice; put all its alternatives "
                            f"in one --vary, separated by '|'")
        seen.add(key)
        axes.append(_axis(key, alts, base_algo))
    if one_at_a_time:
        axes = _unique_across_axes(axes)
    if name is not None and not _LABEL.fullmatch(name):
        raise GridError(f"study name {name!r} must start with a lower case letter, then lower "
                        f"case letters, digits or '_'")
    return Study(base=base, base_algo=base_algo, axes=axes, one_at_a_time=one_at_a_time,
                 seeds=list(range(seeds)), steps=steps, sets=sets_kept, threshold=float(threshold),
                 name=name or base_algo.name)


def _is_library_spec(algo: Algorithm) -> bool:
    lib = library().get(algo.name)
    return lib is not None and Path(algo.file).resolve() == lib.resolve()


def _cell_text(study: Study, variant: Variant) -> str:
    base = study.base_algo
    what = ", ".join(f"{k} = {label}" for k, label in variant.choices) or "the base unchanged"
    lines = [f"# Written by `rldsl ablate` (study {study.name}): {base.name} with {what}.",
             "# A plain spec: `rldsl run` it from any folder; its parent is looked up next to",
             "# this file first, then in the library.",
             f"algorithm {variant.name} extends {base.name}"]
    desc = f"{base.name} ablation: {what}".replace('"', "'")
    lines.append(f'  "{desc}"')
    width = max((len(s) for s in variant.lines), default=0)
    for slot in registry.SLOTS:  # slot order, whatever the axis order
        if slot in variant.lines:
            lines.append(f"  {slot.ljust(width)}  {variant.lines[slot]}")
    return "\n".join(lines) + "\n"


def write_cells(study: Study, folder: Path) -> tuple[list[Variant], list[Variant]]:
    """Write ``cells/*.rl`` (and a copy of the base when it is not a library spec), check
    every variant, fill in its structural diff against the base and drop, in
    one-at-a-time mode, alternatives that equal the base. Invalid variants keep their
    error (the spec checker's message) and are reported, not raised.

    Returns (variants to run, variants dropped as equal to the base)."""
    cells = folder / CELLS_DIR
    cells.mkdir(parents=True, exist_ok=True)
    base = study.base_algo
    if not _is_library_spec(base):  # `extends` finds the parent next to the cell file
        (cells / f"{base.name}.rl").write_text(base.source, encoding="utf-8")
        for pname, ptext in base.parent_sources.items():
            (cells / f"{pname}.rl").write_text(ptext, encoding="utf-8")
    kept: list[Variant] = []
    dropped: list[Variant] = []
    for variant in study.variants():
        path = cells / f"{variant.name}.rl"
        text = _cell_text(study, variant)
        try:
            algo = loads(text, str(path))
        except SpecError as exc:
            variant.error = exc.render()
        else:
            d = explain_diff(base, algo)
            variant.diff_rows = [row for row in d["slots"] if row["status"] != "same"]
            variant.changes = [f"{row['slot']}: {row['a']} -> {row['b']}" for row in variant.diff_rows]
            if study.one_at_a_time and not variant.is_base and not variant.changes:
                path.unlink(missing_ok=True)
                dropped.append(variant)  # the same algorithm as the base cell
                continue
        path.write_text(text, encoding="utf-8")
        kept.append(variant)
    return kept, dropped
