"""``rldsl export RUN_DIR --out DIR [--step N]``: a checkpoint's policy as a plain Hugging
Face folder (``from_pretrained`` loads it): LoRA adapters merged into their base weights, no
LoRA tensor left, the tokenizer with its chat template, the generation config."""
from __future__ import annotations

import shutil
from pathlib import Path

from rldsl.out_folder import check_out_folder

from .checkpoint import folder_state, list_checkpoints, load_weights, read_weights
from ..errors import RunError
from ..models.lora import apply_lora, merged_weights
from ..models.loading import auto_class, policy_on_meta, quiet_transformers
from .run_dir import POLICY_DIR, load_run_config


def checkpoint_of(run_dir: Path, step: int | None) -> Path:
    """The complete checkpoint folder of ``step`` (default: the newest)."""
    found = list_checkpoints(run_dir)
    if not found:
        raise RunError(f"{run_dir}: no complete checkpoint to export")
    if step is None:
        return found[-1]
    for path in found:
        if path.name == f"step-{step}":
            return path
    raise RunError(f"{run_dir}: no checkpoint of step {step} "
                   f"(checkpoints: {', '.join(p.name for p in found)})")


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the policy of a run's checkpoint to ``out`` as a plain HF folder; returns ``out``."""
    run_dir, out = Path(run_dir), check_out_folder(out, RunError)  # before transformers imports
    from transformers import AutoConfig, AutoTokenizer
    src = checkpoint_of(run_dir, step) / POLICY_DIR
    state = read_weights(src)
    if any(".lora_" in k for k in state):
        lo = load_run_config(run_dir).model.lora
        model = auto_class(src).from_config(AutoConfig.from_pretrained(str(src)))
        model, _ = apply_lora(model, rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout,
                              target_modules=lo.target_modules)
        load_weights(model, src)
        state = merged_weights(model)
    else:  # under the model's own names: a MoE's experts saved one tensor per expert are fused back
        state = folder_state(policy_on_meta(src), src, state)
    plain = policy_on_meta(src, state)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_transformers():  # no "Writing model shards" bar
        plain.save_pretrained(out)
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(out)
    for name in ("generation_config.json", "preprocessor_config.json"):  # (the latter: a VLM's image processor)
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out
