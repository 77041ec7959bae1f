"""``rldsl translate CONFIG --verify``: the peer's own loss code and the translated spec on the same
random batches, and the largest difference of the losses and of their gradients.

TRL: ``GRPOTrainer._compute_loss`` runs as TRL ships it, on a trainer shell holding the attributes
its ``__init__`` sets from the config (``_trl_trainer``), with the policy's forward replaced by the
batch's log-probabilities and entropies, in eval mode (no gradient-accumulation scaling). With
adaptive entropy, one train-mode call on a low-entropy batch first moves TRL's controller by its
own code, and the spec's by ``update_entropy_coef``, so that the compared bonus is not zero.
TRL computes advantages and the vLLM importance weights inline in
``_generate_and_score_completions`` (no function to call without a model), so the loss is compared
on the same advantages, and a config with the vLLM correction is not verifiable here.

verl: its ``core_algos`` must be importable (``pip install verl``); without it ``--verify`` says so.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from .compiled import compile as compile_algo
from .errors import UsageError
from .spec import loads
from .translate import TRL_DEFAULTS

__all__ = ["VerifyReport", "verify_translation", "TOLERANCE"]

#: the largest difference (loss and gradient, float32 as in training) that counts as the same numbers
TOLERANCE = 1e-5
BATCHES = 5
GROUPS, TOKENS = 2, 12  # P prompt groups of G = num_generations rows, T tokens each


@dataclass
class VerifyReport:
    lines: list[str] = field(default_factory=list)
    ok: bool = True


def verify_translation(cfg: dict[str, Any], translation: Any, spec_text: str) -> VerifyReport:
    """Run the peer's loss and the translated spec on BATCHES random batches; UsageError when the
    peer library is missing or the config holds something the peer computes outside its loss."""
    if translation.peer == "verl":
        if importlib.util.find_spec("verl") is None:
            raise UsageError("--verify: verl is not installed here, so its core_algos cannot run; install "
                             "verl (pip install verl) where you verify, or drop --verify (the translation "
                             "above stands: each row of its tables is tested against verl's formulas)")
        raise UsageError("--verify: comparing against verl's core_algos is not implemented yet; the translation "
                         "above stands (each row of its tables is tested against verl's formulas)")
    if importlib.util.find_spec("trl") is None:
        raise UsageError("--verify: TRL is not installed here: pip install 'trl==1.16.*' (the bench extra), "
                         "or drop --verify")
    return _verify_trl(cfg, spec_text)


# --------------------------------------------------------------------------------------- TRL

def _trl_args(cfg: dict[str, Any]) -> Any:
    """TRL's own GRPOConfig from the config's algorithm fields (the rest cannot change the loss)."""

    from trl import GRPOConfig

    algorithm = {k: v for k, v in cfg.items() if k in TRL_DEFAULTS}
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TrainingArguments' deprecation notices
        return GRPOConfig(**{k: v for k, v in algorithm.items() if k in names},
                          use_cpu=True, bf16=False, report_to="none")


class _OneProcess:
    """The accelerator of one process: gather, pad and reduce return their input."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x: Tensor) -> Tensor:
        return x

    def pad_across_processes(self, x: Tensor, dim: int = 0, pad_index: float = 0) -> Tensor:
        return x

    gather_for_metrics = gather

    def reduce(self, x: Tensor, reduction: str = "sum") -> Tensor:
        return x


def _trl_trainer(args: Any) -> Any:
    """A GRPOTrainer without a model: the attributes ``_compute_loss`` reads, set from ``args`` as
    TRL's ``__init__`` sets them."""
    from trl.trainer.grpo_trainer import GRPOTrainer
    t = object.__new__(GRPOTrainer)
    t.args = args
    t.loss_type = args.loss_type
    t.beta = args.beta
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.importance_sampling_level = args.importance_sampling_level
    t.top_entropy_quantile = args.top_entropy_quantile
    t.off_policy_mask_threshold = args.off_policy_mask_threshold
    t.use_vllm = args.use_vllm
    t.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    t.max_completion_length = args.max_completion_length
    t.mask_truncated_completions = args.mask_truncated_completions
    t.entropy_coef = args.entropy_coef
    t.use_adaptive_entropy = args.use_adaptive_entropy
    t._entropy_bonus_enabled = t.entropy_coef != 0.0 or t.use_adaptive_entropy
    t._last_world_entropy = float("inf")  # TRL's first window applies no adaptive bonus
    t._entropy_window_stats = None
    t.aux_loss_enabled = False
    t.router_aux_loss_coef = 0.0
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.model = SimpleNamespace(training=False)  # eval mode: no accumulation scaling
    t.accelerator = _OneProcess()
    t.current_gradient_accumulation_steps = 1
    return t


def _batch(seed: int, B: int, T: int) -> dict[str, Tensor]:
    """Random float32 log-probabilities [B, T] (the policy's, the old policy's within ~0.3 of it so
    that clipping and truncation act, the reference's), entropies, advantages [B], a mask with rows
    of different lengths (one empty) and right padding. float32 as in training: TRL computes some
    statistics (the entropy quantile) in float32 whatever the input."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = 0
    return {
        "logp": logp,
        "old": logp + 0.3 * torch.randn(B, T, generator=g),
        "ref": logp + 0.3 * torch.randn(B, T, generator=g),
        "entropy": torch.rand(B, T, generator=g) * 2,
        "adv": torch.randn(B, generator=g),
        "mask": (torch.arange(T)[None, :] < lengths[:, None]).float(),
    }


def _trl_loss(trainer: Any, b: dict[str, Tensor]) -> tuple[float, Tensor]:
    logp = b["logp"].clone().requires_grad_(True)
    B, T = logp.shape
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, b["entropy"], None)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": b["mask"],
              "advantages": b["adv"], "old_per_token_logps": b["old"], "ref_per_token_logps": b["ref"],
              "num_items_in_batch": b["mask"].sum()}
    loss = trainer._compute_loss(None, inputs)
    (grad,) = torch.autograd.grad(loss, logp, allow_unused=True)
    return loss.item(), torch.zeros_like(logp) if grad is None else grad


def _spec_loss(fn: Any, b: dict[str, Tensor], group_size: int, entropy_coef: float | None) -> tuple[float, Tensor]:
    logp = b["logp"].clone().requires_grad_(True)
    T = logp.shape[1]
    out = fn.loss(logp, b["old"], b["adv"][:, None].expand(-1, T), b["mask"], ref_logprobs=b["ref"],
                  entropy=b["entropy"], group_size=group_size, rollout_logprobs=b["old"],
                  entropy_coef=entropy_coef, metrics=False)
    (grad,) = torch.autograd.grad(out.loss, logp, allow_unused=True)
    return out.loss.item(), torch.zeros_like(logp) if grad is None else grad


def _verify_trl(cfg: dict[str, Any], spec_text: str) -> VerifyReport:

    args = _trl_args(cfg)
    if args.use_vllm and args.vllm_importance_sampling_correction:
        raise UsageError("--verify: TRL computes the vLLM importance weights inside its generation step "
                         "(_generate_and_score_completions), which cannot run without a model and vLLM; "
                         "verify the config with use_vllm: false (the loss without the correction)")
    fn = compile_algo(loads(spec_text, "<translated>"), compile=False)
    G, T = args.num_generations, min(TOKENS, args.max_completion_length)
    trainer = _trl_trainer(args)
    if fn.entropy_coef() is not None:  # adaptive entropy: one optimizer step below the target first,
        warm = _batch(BATCHES, GROUPS * G, T)  # moved by each side's own rule, so the bonus then applies
        warm["entropy"] = warm["entropy"] * 0.05
        trainer.model.training = True  # TRL updates its controller in train mode only
        _trl_loss(trainer, warm)
        trainer.model.training = False
        fn.update_entropy_coef(((warm["entropy"] * warm["mask"]).sum() / warm["mask"].sum()).item())
    report = VerifyReport()
    worst_loss = worst_grad = 0.0
    for seed in range(BATCHES):
        b = _batch(seed, GROUPS * G, T)
        theirs, their_grad = _trl_loss(trainer, b)
        mine, my_grad = _spec_loss(fn, b, G, fn.entropy_coef())
        if not (math.isfinite(theirs) and math.isfinite(mine)):
            report.ok = False
            report.lines.append(f"verify: batch {seed}: TRL loss {theirs}, spec loss {mine}")
            continue
        worst_loss = max(worst_loss, abs(theirs - mine))
        worst_grad = max(worst_grad, (their_grad - my_grad).abs().max().item())
    same = worst_loss <= TOLERANCE and worst_grad <= TOLERANCE
    report.ok = report.ok and same
    import trl
    report.lines.append(
        f"verify: TRL {trl.__version__} GRPOTrainer._compute_loss vs the translated spec on {BATCHES} random "
        f"batches ({GROUPS * G} rows x {T} tokens, float32, the same "
        f"advantages): largest difference {worst_loss:.3g} in the loss, {worst_grad:.3g} in its gradient "
        f"-> {'the same' if same else 'DIFFERENT'} (tolerance {TOLERANCE:g})")
    return report
