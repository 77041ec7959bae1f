"""The trainer: old/reference logprobs, advantages and minibatch updates with the compiled loss.

Every formula comes from the :class:`rldsl.CompiledAlgorithm` (``estimate`` and ``loss``);
this module only moves tensors: it builds the model inputs, recomputes logprobs with the
memory-lean selective log-softmax, splits the batch into minibatches of whole prompt
groups with exact global denominators, clips gradients and steps the optimizers.

Shapes: B = P*G rows, Tp prompt tokens (left padded), Tr response tokens (right padded),
L = Tp + Tr.
"""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from rldsl import CompiledAlgorithm

from ..batch import RolloutBatch, group_rows, model_inputs
from ..config import RunConfig
from .logprobs import token_logprobs
from .optim import build_optimizer, build_scheduler
from .value_model import ValueModel


# ----------------------------------------------------------------------------- batches

@dataclass
class TrainBatch:
    """A rollout with its old/reference logprobs and advantages, ready for updates
    (all [B, Tr] unless noted)."""

    rollout: RolloutBatch
    rewards: Tensor               # [B] verifier rewards (NaN = failed reward, masked)
    old_logprobs: Tensor | None   # None: exactly on-policy, the update uses its own (detached)
    mask: Tensor                  # loss mask (filters applied)
    advantages: Tensor
    returns: Tensor
    ref_logprobs: Tensor | None = None
    old_values: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def group_size(self) -> int:
        return self.rollout.group_size


def _rows(t: Tensor | None, idx: Tensor) -> Tensor | None:
    return None if t is None else t[idx]


# ----------------------------------------------------------------------------- trainer

class Trainer:
    """Owns the policy (and reference, critic), their optimizers, and one update step.

    The trainer is a plain object with tensor-in/metrics-out methods so that it can live in
    its own process (a Ray actor) in the distributed runtime.
    """

    def __init__(self, fn: CompiledAlgorithm, policy: nn.Module, *, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, reference: nn.Module | None = None,
                 critic: nn.Module | None = None, critic_optimizer: torch.optim.Optimizer | None = None,
                 ppo_epochs: int = 1, minibatches: int = 1, grad_clip: float = 1.0,
                 skip_zero_advantage: bool = True, logprob_chunk: int = 1024):
        self.fn = fn
        self.policy = policy
        self.reference = reference
        self.critic = critic
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.critic_optimizer = critic_optimizer
        self.ppo_epochs = ppo_epochs
        self.minibatches = minibatches
        self.grad_clip = grad_clip
        self.skip_zero_advantage = skip_zero_advantage
        self.logprob_chunk = logprob_chunk
        algo = fn.algorithm
        if algo.uses_reference and reference is None:
            raise ValueError(f"{algo.name} has a KL term: the trainer needs a reference model")
        if algo.uses_critic and (critic is None or critic_optimizer is None):
            raise ValueError(f"{algo.name} uses a critic: the trainer needs one and its optimizer")

    @classmethod
    def from_config(cls, cfg: RunConfig, fn: CompiledAlgorithm, policy: nn.Module, *,
                    prepare: Callable[[nn.Module, nn.Module | None, nn.Module | None], None] | None = None,
                    **kwargs: Any) -> "Trainer":
        """The trainer of ``policy`` for a run: reference and critic copies, optimizers, LR schedule.

        ``prepare(policy, reference, critic)``, if given, runs after the copies are made and
        before the optimizers are built (the sharded trainer shards the modules there).
        ``kwargs`` go to the constructor (a subclass's own arguments).
        """
        algo = fn.algorithm
        reference = None
        if algo.uses_reference:
            reference = copy.deepcopy(policy).eval()
            for p in reference.parameters():
                p.requires_grad_(False)
        critic = critic_opt = None
        if algo.uses_critic:
            critic = ValueModel(policy).to(cfg.device)
        if prepare is not None:
            prepare(policy, reference, critic)
        t = cfg.train
        if critic is not None:
            critic_opt = build_optimizer(critic.parameters(), t, lr=t.critic_lr or t.lr)
        optimizer = build_optimizer(policy.parameters(), t)
        return cls(fn, policy, optimizer=optimizer, scheduler=build_scheduler(optimizer, t),
                   reference=reference, critic=critic, critic_optimizer=critic_opt,
                   ppo_epochs=t.ppo_epochs, minibatches=t.minibatches, grad_clip=t.grad_clip,
                   skip_zero_advantage=t.skip_zero_advantage, **kwargs)

    # -- logprobs

    # the sharded trainer (workers/fsdp.py) runs it under the FSDP root's hooks
    _token_logprobs = staticmethod(token_logprobs)

    def _logprobs(self, model: nn.Module, batch: RolloutBatch, *, grad: bool,
                  entropy: bool) -> tuple[Tensor, Tensor | None]:
        ids, attn, pos = model_inputs(batch)
        Tr = batch.response_ids.shape[1]
        with torch.set_grad_enabled(grad):
            return self._token_logprobs(model, ids, attn, Tr, with_entropy=entropy,
                                  entropy_grad=grad and self.fn.algorithm.uses_entropy,
                                  chunk_size=self.logprob_chunk, group_size=batch.group_size)

    @torch.no_grad()
    def estimate(self, rollout: RolloutBatch, rewards: Tensor) -> TrainBatch:
        """Old (and reference) logprobs, values, and the algorithm's advantages for a rollout."""
        self.policy.eval()
        old, ref, values = self._recompute(rollout)
        mask = rollout.response_mask.float()
        est = self.fn.estimate(rewards, rollout.group_size, mask, values=values,
                               truncated=rollout.truncated, old_logprobs=old, ref_logprobs=ref,
                               rollout_logprobs=rollout.logprobs if self._corrects() else None)
        metrics = dict(est.metrics)
        valid = mask > 0
        if old is not None and valid.any():
            # train/inference mismatch: engine logprobs vs recomputed ones (same temperature 1 only)
            metrics["rollout_logprob_diff"] = float((rollout.logprobs - old).abs()[valid].mean())
        return TrainBatch(rollout, rewards, old, est.mask, est.advantages, est.returns, ref,
                          values, metrics)

    def _recompute(self, rollout: RolloutBatch) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Old logprobs, reference logprobs and values [B, Tr] of every row (no grad).

        Old logprobs are None when the update is exactly on-policy (:meth:`_old_is_current`):
        the update then uses its own logprobs, detached, instead of a separate forward.
        """
        algo = self.fn.algorithm
        old = None
        if not self._old_is_current():
            old, _ = self._logprobs(self.policy, rollout, grad=False, entropy=False)
        ref = None
        if algo.uses_reference:
            ref, _ = self._logprobs(self.reference, rollout, grad=False, entropy=False)
        values = None
        if algo.uses_critic:
            ids, attn, pos = model_inputs(rollout)
            values = self.critic(ids, attn, pos, rollout.response_ids.shape[1])
        return old, ref, values

    # -- update

    def _minibatch_rows(self, batch: TrainBatch, generator: torch.Generator | None) -> list[Tensor]:
        """Row indices of each minibatch: whole prompt groups, shuffled when there are several."""
        G = batch.group_size
        P = batch.rewards.shape[0] // G
        order = torch.randperm(P, generator=generator) if self.minibatches > 1 else torch.arange(P)
        groups = order.chunk(self.minibatches)
        return [group_rows(g, G) for g in groups if len(g)]

    def update(self, batch: TrainBatch, generator: torch.Generator | None = None) -> dict[str, float]:
        """``ppo_epochs`` passes of minibatch updates; returns averaged metrics.

        A minibatch whose loss or gradient is not finite is skipped (no optimizer step, the
        weights untouched) and counted in ``skipped_nonfinite``. When every advantage is 0
        and the loss has no other term, the optimizer step is skipped (``skipped_zero_adv``).
        """
        algo = self.fn.algorithm
        only_pg = not (algo.kl_in == "loss" or algo.uses_entropy or algo.uses_critic)
        if self.skip_zero_advantage and only_pg and not bool((batch.advantages * batch.mask).any()):
            return {"skipped_zero_adv": 1.0, "skipped_nonfinite": 0.0, "optimizer_steps": 0.0}
        self.policy.train()
        sums: dict[str, float] = {}
        n = 0
        skipped = 0
        steps = 0
        for _ in range(self.ppo_epochs):
            for rows in self._minibatch_rows(batch, generator):
                m = self._step(batch, rows)
                if m is None:
                    skipped += 1
                    continue
                steps += 1
                n += 1
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
        out = {k: v / max(n, 1) for k, v in sums.items()}
        out.update(skipped_nonfinite=float(skipped), skipped_zero_adv=0.0, optimizer_steps=float(steps))
        return out

    def _step(self, batch: TrainBatch, rows: Tensor) -> dict[str, float] | None:
        fn = self.fn
        algo = fn.algorithm
        G = batch.group_size
        rows, share = self._local_rows(rows, G)
        sub = batch.rollout.select(rows)
        mask = batch.mask[rows]
        denom = self._global_denominator(fn.denominator(mask, G), share)
        logp, ent = self._logprobs(self.policy, sub, grad=True, entropy=True)
        values = None
        if algo.uses_critic:
            ids, attn, pos = model_inputs(sub)
            values = self.critic(ids, attn, pos, sub.response_ids.shape[1])
        old = batch.old_logprobs[rows] if batch.old_logprobs is not None else logp.detach()
        out = fn.loss(logp, old, batch.advantages[rows], mask,
                      ref_logprobs=_rows(batch.ref_logprobs, rows), values=values,
                      returns=batch.returns[rows], old_values=_rows(batch.old_values, rows),
                      entropy=ent, group_size=G, denominator=denom,
                      rollout_logprobs=sub.logprobs.to(logp.device) if self._corrects() else None)
        total = out.loss if out.value_loss is None else out.loss + out.value_loss
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        if not self._all_finite(total):
            return None
        (total if share == 1.0 else total * share).backward()
        params = [p for p in self.policy.parameters() if p.grad is not None]
        gnorm = _clip(params, self.grad_clip)
        cnorm = None
        if self.critic is not None:
            cnorm = _clip([p for p in self.critic.parameters() if p.grad is not None], self.grad_clip)
        if not math.isfinite(gnorm) or (cnorm is not None and not math.isfinite(cnorm)):
            self.optimizer.zero_grad(set_to_none=True)
            if self.critic_optimizer is not None:
                self.critic_optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        if self.critic_optimizer is not None:
            self.critic_optimizer.step()
        metrics = dict(out.metrics)
        metrics["loss"] = float(out.loss.detach())
        metrics["grad_norm"] = gnorm
        if cnorm is not None:
            metrics["critic_grad_norm"] = cnorm
        valid = sub.response_mask > 0
        if batch.old_logprobs is None and valid.any():  # estimate() left the mismatch metric to us
            metrics["rollout_logprob_diff"] = float((sub.logprobs.to(old.device) - old).abs()[valid.to(old.device)].mean())
        return self._reduce_metrics(metrics, mask, share)

    def _old_is_current(self) -> bool:
        """Whether the old logprobs are exactly the logprobs the update computes anyway.

        True for one update per rollout (``ppo_epochs == 1``, one minibatch) of a policy
        without active dropout, when the advantages do not need them (no KL in the reward):
        the one optimizer step happens after the only forward, so pi_old == pi_theta and the
        ratio is 1 either way. Then ``estimate`` skips its forward pass (TRL does the same:
        ``old_per_token_logps = per_token_logps.detach()`` when num_iterations == 1).
        """
        if self.ppo_epochs != 1 or self.minibatches != 1 or self.fn.algorithm.kl_in == "reward" \
                or self._corrects():  # a correction compares pi_old with the engine before the update
            return False
        return not _has_dropout(self.policy)

    def _corrects(self) -> bool:
        """The spec has a correction: the engine's logprobs go to estimate() and loss()."""
        return "rollout_logprobs" in self.fn.algorithm.needs()

    # -- data parallelism: identities on one rank; the sharded trainer (workers/fsdp.py)
    #    overrides them so that N ranks compute one rank's update

    def _local_rows(self, rows: Tensor, group_size: int) -> tuple[Tensor, float]:
        """This rank's rows of a minibatch (whole groups) and its share: 1, or 0 for a rank
        that got no group and runs a zero-weighted copy to keep the collectives in step."""
        return rows, 1.0

    def _global_denominator(self, local: Tensor, share: float) -> Tensor:
        """The aggregation count over every rank (docs/api.md, "Denominators")."""
        return local

    def _all_finite(self, loss: Tensor) -> bool:
        """Whether the loss is finite on every rank (all ranks skip the step together)."""
        return bool(torch.isfinite(loss))

    def _reduce_metrics(self, metrics: dict[str, float], mask: Tensor, share: float) -> dict[str, float]:
        """Metrics of the whole minibatch from each rank's own."""
        return metrics

    def step_schedule(self) -> None:
        """Advance the LR schedule once per training step (also when the update was skipped)."""
        if self.scheduler is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
                self.scheduler.step()


def _has_dropout(model: nn.Module) -> bool:
    """Any dropout that is active in train mode: a module with p > 0 or a config rate > 0."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    if config is None:
        return False
    for key, value in config.to_dict().items():
        if ("dropout" in key or key.endswith("_pdrop")) and isinstance(value, (int, float)) \
                and not isinstance(value, bool) and value > 0:
            return True
    return False


def _clip(params: list[Tensor], max_norm: float) -> float:
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm and max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # FSDP2 (DTensor) parameters: the global norm, replicated
        norm = norm.full_tensor()
    return float(norm)
