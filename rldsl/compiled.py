"""CompiledAlgorithm: the generated ``advantages()`` (eager) and ``loss()`` (torch.compile'd).

``rldsl.compile(algo)`` is the only way the runtime gets a formula. Compiled loss functions
are cached per generated source within a process, so many CompiledAlgorithm objects of the
same spec share one compilation.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from . import codegen, ops
from .formula import hooks as formula_hooks
from .spec import Algorithm

_COMPILED: dict[str, Callable[..., Any]] = {}


def compile_enabled(default: bool = True) -> bool:
    """``RLDSL_COMPILE=0`` turns torch.compile off everywhere (eager functions)."""
    v = os.environ.get("RLDSL_COMPILE")
    if v is None:
        return default
    return v.strip().lower() not in ("0", "false", "no", "off", "")


@dataclass
class Estimate:
    """What ``CompiledAlgorithm.estimate`` returns (see docs/api.md)."""

    advantages: Tensor  # [B, T]
    returns: Tensor     # [B, T]
    mask: Tensor        # [B, T] loss mask (filters applied)
    rewards: Tensor     # [B] after shaping and KL-in-reward
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class LossOutput:
    loss: Tensor
    value_loss: Tensor | None
    metrics: dict[str, float]
    metric_tensors: dict[str, Tensor] = field(default_factory=dict, repr=False)


@dataclass
class DataPlan:
    """The data-level slots, carried out by the runtime."""

    dynamic_rounds: int
    pass_rate_cap: float | None

    @staticmethod
    def informative(rewards: Tensor) -> Tensor:
        """[P, G] -> [P] bool: the group has mixed outcomes (max != min)."""
        return rewards.amax(dim=-1) != rewards.amin(dim=-1)


class CompiledAlgorithm:
    """Callable pieces of one algorithm. Build it with :func:`rldsl.compile`."""

    def __init__(self, algo: Algorithm, compile: bool = True, **compile_kwargs: Any):
        self.algorithm = algo
        gen = codegen.generate(algo)
        self.advantages_source = gen.advantages_source
        self.loss_source = gen.loss_source
        self._advantages = codegen.load_function(gen.advantages_source, "advantages")
        self.eager_loss = codegen.load_function(gen.loss_source, "loss")
        self.compiled = compile and compile_enabled()
        self._compile_kwargs = compile_kwargs
        self._loss = self._build(gen.loss_source, self.eager_loss)
        self._loss_no_metrics_source = gen.loss_source_no_metrics
        self._loss_no_metrics: Callable[..., Any] | None = None  # built at first use
        self.state: dict[str, Tensor] = {}
        sampling = algo["sampling"]
        caps = [v.params["max"] for v in algo["filter"] if v.component == "pass_rate_cap"]
        self.data = DataPlan(
            dynamic_rounds=int(sampling.params["max_rounds"]) if sampling.component == "dynamic" else 1,
            pass_rate_cap=float(caps[0]) if caps else None)

    def _build(self, source: str, eager: Callable[..., Any]) -> Callable[..., Any]:
        """torch.compile ``eager`` once per process per source (or keep it eager)."""
        if not self.compiled:
            return eager
        key = source + repr(sorted(self._compile_kwargs.items()))
        if key not in _COMPILED:
            _COMPILED[key] = torch.compile(eager, **{"dynamic": True, **self._compile_kwargs})
        return _COMPILED[key]

    @property
    def source(self) -> str:
        """The generated Python source (what ``rldsl explain --code`` prints)."""
        return self.advantages_source + "\n\n" + self.loss_source

    # ---------------------------------------------------------------- advantages

    def estimate(self, rewards: Tensor, group_size: int, mask: Tensor, values: Tensor | None = None,
                 truncated: Tensor | None = None, old_logprobs: Tensor | None = None,
                 ref_logprobs: Tensor | None = None) -> Estimate:
        """Rewards [B] -> advantages, returns, loss mask [B, T] (see docs/api.md).

        Non-finite rewards (e.g. a reward function that failed with on_error=skip) are
        replaced by their group's mean finite reward -- so they do not move the group's
        baseline -- and their rows are removed from the loss mask.
        """
        algo = self.algorithm
        if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
            raise ValueError(f"rewards must be [B] and mask [B, T]; got {tuple(rewards.shape)} "
                             f"and {tuple(mask.shape)}")
        if group_size < 1 or rewards.shape[0] % group_size:
            raise ValueError(f"{rewards.shape[0]} rows are not a whole number of groups of {group_size}")
        if algo.uses_critic and values is None:
            raise ValueError(f"{algo.name}: baseline {algo['baseline'].component} needs values= (critic)")
        if algo.kl_in == "reward" and (old_logprobs is None or ref_logprobs is None):
            raise ValueError(f"{algo.name}: KL in the reward needs old_logprobs= and ref_logprobs=")
        if "overlong" in algo.components("filter") and truncated is None:
            raise ValueError(f"{algo.name}: filter overlong needs truncated=")
        rewards = rewards.detach().to(torch.float32)
        finite = torch.isfinite(rewards)
        clean = rewards
        if not bool(finite.all()):
            g = ops.group_view(torch.where(finite, rewards, torch.zeros_like(rewards)), group_size)
            cnt = ops.group_view(finite.float(), group_size).sum(-1, keepdim=True)
            fill = (g.sum(-1, keepdim=True) / cnt.clamp_min(1)).expand_as(g).reshape(-1)
            clean = torch.where(finite, rewards, fill)
        B = rewards.shape[0]
        if B == 0:
            z = torch.zeros(mask.shape, dtype=torch.float32)
            return Estimate(z, z, z, rewards, {"rows": 0.0})
        row_mask = mask.float() * finite.unsqueeze(-1).float()  # failed rewards: no tokens
        adv, returns, loss_mask, shaped = self._advantages(
            clean, row_mask, group_size, values, truncated, old_logprobs, ref_logprobs, self.state,
            finite)
        return Estimate(adv, returns, loss_mask, shaped, self._estimate_metrics(
            rewards, finite, shaped, adv, mask, loss_mask, group_size))

    def advantages(self, rewards: Tensor, group_size: int, mask: Tensor,
                   values: Tensor | None = None, **kw: Any) -> Tensor:
        """Rewards [B] -> advantages [B, T] (``estimate(...).advantages``)."""
        return self.estimate(rewards, group_size, mask, values, **kw).advantages

    @staticmethod
    def _estimate_metrics(raw: Tensor, finite: Tensor, shaped: Tensor, adv: Tensor, mask: Tensor,
                          loss_mask: Tensor, G: int) -> dict[str, float]:
        with torch.no_grad():
            r = raw[finite]
            groups = ops.group_view(torch.where(finite, raw, torch.zeros_like(raw)), G)
            zero_var = (groups.amax(-1) == groups.amin(-1)).float().mean()
            kept_rows = (loss_mask.sum(-1) > 0) | (mask.sum(-1) == 0)
            lm = loss_mask
            n = lm.sum().clamp_min(1)
            a_mean = (adv * lm).sum() / n
            vals = torch.stack([
                r.mean() if r.numel() else torch.tensor(float("nan")),
                r.std() if r.numel() > 1 else torch.tensor(0.0),
                shaped.mean(), zero_var, (~kept_rows).float().sum(), (~finite).float().sum(),
                a_mean, (((adv - a_mean) ** 2 * lm).sum() / n).sqrt(),
                torch.where(lm > 0, adv, torch.full_like(adv, -float("inf"))).max(),
                torch.where(lm > 0, adv, torch.full_like(adv, float("inf"))).min(),
            ]).tolist()
        keys = ["reward_mean", "reward_std", "reward_shaped_mean", "zero_variance_groups",
                "filtered_rows", "nonfinite_rewards", "adv_mean", "adv_std", "adv_max", "adv_min"]
        return dict(zip(keys, vals))

    # ---------------------------------------------------------------- loss

    def denominator(self, mask: Tensor, group_size: int | None = None) -> Tensor:
        """The local aggregation count (0-dim); sum it over micro-batches/ranks for ``denominator=``."""
        from .registry import REGISTRY
        agg = self.algorithm["aggregation"]
        if agg.component == "prompt_mean" and group_size is None:
            raise ValueError(f"{self.algorithm.name}: prompt_mean aggregation needs group_size=")
        if agg.formula is not None:  # written in the spec: the count of its generated lines
            if group_size is None and formula_hooks.needs_group_size(self.algorithm):
                raise ValueError(f"{self.algorithm.name}: {formula_hooks.needs_group_size(self.algorithm)} "
                                 "reads groups: pass group_size=")
            return formula_hooks.denominator(self.algorithm, mask, group_size or 1)
        comp = REGISTRY["aggregation"][agg.component]
        _, count = comp.fn(mask.float(), group_size or 1, **comp.fn_params(agg.params))
        return count

    def loss(self, logprobs: Tensor, old_logprobs: Tensor, adv: Tensor, mask: Tensor,
             ref_logprobs: Tensor | None = None, values: Tensor | None = None,
             returns: Tensor | None = None, old_values: Tensor | None = None,
             entropy: Tensor | None = None, group_size: int | None = None,
             denominator: Tensor | float | None = None, metrics: bool = True) -> LossOutput:
        """Per-token tensors [B, T] -> the scalar loss to minimise, value loss and metrics.

        ``metrics=False`` runs the same loss compiled without its diagnostics (faster on
        steps whose metrics are not logged); ``out.metrics`` is then empty.
        """
        algo = self.algorithm
        if algo.kl_in == "loss" and ref_logprobs is None:
            raise ValueError(f"{algo.name}: kl {algo['kl'].component} in the loss needs ref_logprobs=")
        if algo.uses_critic and (values is None or returns is None):
            raise ValueError(f"{algo.name}: the critic needs values= and returns=")
        if algo.uses_entropy and entropy is None:
            raise ValueError(f"{algo.name}: entropy bonus needs entropy=")
        if algo["aggregation"].component == "prompt_mean" and group_size is None:
            raise ValueError(f"{algo.name}: prompt_mean aggregation needs group_size=")
        if group_size is None and formula_hooks.needs_group_size(algo):
            raise ValueError(f"{algo.name}: {formula_hooks.needs_group_size(algo)} reads groups: pass group_size=")
        if denominator is not None and not isinstance(denominator, Tensor):
            denominator = torch.tensor(float(denominator))
        fn = self._loss
        if not metrics:
            if self._loss_no_metrics is None:
                eager = codegen.load_function(self._loss_no_metrics_source, "loss")
                self._loss_no_metrics = self._build(self._loss_no_metrics_source, eager)
            fn = self._loss_no_metrics
        if logprobs.numel() == 0:  # no rows: nothing to learn, and no reduction to take
            zero = (logprobs * 0).sum()
            return LossOutput(zero, None if not algo.uses_critic else zero, {})
        total, value_loss, mt = fn(
            logprobs, old_logprobs.detach(), adv.detach(), mask, ref_logprobs, values, returns,
            old_values, entropy, group_size or 1, denominator)
        names = list(mt)
        vals = torch.stack([mt[k].detach().float().reshape(()) for k in names]).tolist() if names else []
        return LossOutput(total, value_loss, dict(zip(names, vals)), mt)

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Tensor]:
        """Persistent state of stateful components (e.g. the ema baseline), for checkpoints."""
        return {k: v.clone() for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.state.clear()
        self.state.update({k: v.clone() for k, v in state.items()})


def compile(algo: Algorithm, compile: bool = True, **compile_kwargs: Any) -> CompiledAlgorithm:  # noqa: A001
    """Compile a resolved algorithm. ``compile=False`` (or ``RLDSL_COMPILE=0``) keeps it eager."""
    return CompiledAlgorithm(algo, compile=compile, **compile_kwargs)
