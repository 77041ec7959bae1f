"""The trainer: old/reference logprobs, advantages and minibatch updates with the compiled loss.

Every formula comes from the :class:`rldsl.CompiledAlgorithm` (``estimate`` and ``loss``);
this module only moves tensors: it picks the no-grad forwards the algorithm needs, splits the
batch into minibatches of whole prompt groups with exact global denominators, clips gradients
and steps the optimizers. The forwards themselves (memory-lean logprobs, values, the teacher's,
micro-batches, token counts) are train/passes.py's, the parts a run's config makes of a
trainer train/parts.py's.

Shapes: B = P*G rows, Tp prompt tokens (left padded), Tr response tokens (right padded),
L = Tp + Tr.
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from rldsl import CompiledAlgorithm
from rldsl.formula.hooks import batch_wide_loss

from ..batch import RolloutBatch, group_rows
from ..config import RunConfig
from ..records.metrics import CRITIC_GRAD_NORM, GRAD_NORM, LOSS, OPTIMIZER_STEPS, SKIPPED_NONFINITE, SKIPPED_ZERO_ADV
from ..records.metrics import LOSS_SCALE, SKIPPED_STEPS
from ..records.metrics import combine, timed
from .inputs import (OLD_POLICY_STATISTICS, Forwards, Micro, advantages_read_old_policy, estimate_inputs,
                     loss_inputs, old_policy_statistics, reads_engine, reads_router_aux)
from .microbatch import row_tokens, trim
from .parts import trainer_parts
from .passes import ForwardPasses
from .teachers import RemoteTeacher, TeacherForward, ema_update, vocabulary_jsd


# ----------------------------------------------------------------------------- batches

@dataclass
class TrainBatch:
    """A rollout with its old/reference logprobs and advantages, ready for updates
    (all [B, Tr] unless noted)."""

    rollout: RolloutBatch
    rewards: Tensor               # [B] verifier rewards (NaN = failed reward, masked)
    old_logprobs: Tensor | None   # None: exactly on-policy, or bypass; the update passes its own (detached)
    mask: Tensor                  # loss mask (filters applied)
    advantages: Tensor
    returns: Tensor
    ref_logprobs: Tensor | None = None
    old_values: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    teacher: "TeacherForward | None" = None  # the teacher's forward, when the spec reads it
    # the old policy's entropy, when the spec reads it (None: exactly on-policy, the update's own)
    old_entropy: Tensor | None = None
    # the old policy's top-K (the spec's K): its K largest logprobs and their ids [B, Tr, K], and
    # whether each sampled token is its most likely [B, Tr]; None: not read, or exactly on-policy
    # (the update forward picks them)
    old_topk_logprobs: Tensor | None = None
    old_topk_ids: Tensor | None = None
    is_top1: Tensor | None = None

    @property
    def group_size(self) -> int:
        return self.rollout.group_size


def _rows(t: Tensor | None, idx: Tensor) -> Tensor | None:
    return None if t is None else t[idx]


# ----------------------------------------------------------------------------- trainer

class Trainer(ForwardPasses):
    """Owns the policy (and reference, critic), their optimizers, and one update step; the
    forwards it runs are its base's (:class:`~.passes.ForwardPasses`, train/passes.py).

    The trainer is a plain object with tensor-in/metrics-out methods so that it can live in
    its own process (a Ray actor) in the distributed runtime.
    """

    def __init__(self, fn: CompiledAlgorithm, policy: nn.Module, *, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, reference: nn.Module | None = None,
                 critic: nn.Module | None = None, critic_optimizer: torch.optim.Optimizer | None = None,
                 ppo_epochs: int = 1, minibatches: int = 1, grad_clip: float = 1.0,
                 skip_zero_advantage: bool = True, logprob_chunk: int = 1024,
                 temperature: float = 1.0, critic_lr_factor: Callable[[int], float] | None = None,
                 max_tokens_per_microbatch: int | None = None,
                 autocast_dtype: torch.dtype | None = None,
                 reference_off: Callable[[], Any] | None = None,
                 packing: bool = False, packing_row_tokens: int | None = None,
                 compile_policy: bool = False, teacher: nn.Module | RemoteTeacher | None = None,
                 teacher_ema: float | None = None, loss_scaler: Any = None, routing_replay: bool = False):
        super().__init__(fn, policy, critic=critic, teacher=teacher, temperature=temperature,
                         logprob_chunk=logprob_chunk, max_tokens_per_microbatch=max_tokens_per_microbatch,
                         autocast_dtype=autocast_dtype, packing=packing, packing_row_tokens=packing_row_tokens,
                         compile_policy=compile_policy, routing_replay=routing_replay)
        self.reference = reference
        # teacher.ema: the teacher is a frozen copy of the policy, moved toward it after each
        # optimizer step by this decay (train/teachers.py ema_update)
        self.teacher_ema = teacher_ema
        if teacher_ema is not None and not isinstance(teacher, nn.Module):
            raise ValueError("teacher_ema needs the teacher's module (a copy of the policy)")
        self.reference_off = reference_off  # LoRA: the reference is the policy with adapters off
        # model.dtype = float16: dynamic loss scaling (a train/loss_scale.py LossScaler, which
        # train/parts.py makes for it); None otherwise
        self.loss_scaler = loss_scaler
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.critic_optimizer = critic_optimizer
        self.ppo_epochs = ppo_epochs
        self.minibatches = minibatches
        self.grad_clip = grad_clip
        self.skip_zero_advantage = skip_zero_advantage
        # the critic follows the policy's LR schedule: lr_c(step) = critic base lr x factor(step)
        self.critic_lr_factor = critic_lr_factor
        self.critic_base_lrs = [g["lr"] for g in critic_optimizer.param_groups] if critic_optimizer else []
        self._set_critic_lr(0)
        algo = fn.algorithm
        # the loss slots whose formula reads a batch_* statistic (rldsl.formula.hooks): loss()
        # gets the whole minibatch in every call (docs/formulas.md, "The batch")
        self._batch_wide = bool(batch_wide_loss(algo.slots))
        if algo.uses_reference and reference is None and reference_off is None:
            raise ValueError(f"{algo.name} has a KL term: the trainer needs a reference model")
        if algo.uses_critic and (critic is None or critic_optimizer is None):
            raise ValueError(f"{algo.name} uses a critic: the trainer needs one and its optimizer")
        if algo.uses_teacher and teacher is None:
            raise ValueError(f"{algo.name} distills from a teacher: the trainer needs one (teacher.path)")

    @classmethod
    def from_config(cls, cfg: RunConfig, fn: CompiledAlgorithm, policy: nn.Module, *,
                    prepare: Callable[[nn.Module, nn.Module | None, nn.Module | None], None] | None = None,
                    reference_off: Callable[[], Any] | None = None, tokenizer: Any = None,
                    **kwargs: Any) -> "Trainer":
        """The trainer of ``policy`` for a run: reference and critic copies, optimizers, LR schedule
        (train/parts.py).

        ``prepare(policy, reference, critic)``, if given, runs after the copies are made and
        before the optimizers are built (the sharded trainer shards the modules there).
        ``reference_off()``, if given, is a context in which the policy computes the reference
        logprobs (LoRA: adapters disabled), so no reference copy is made. ``kwargs`` go to the
        constructor (a subclass's own arguments). A spec that reads a teacher gets the run's
        (``teacher=`` overrides it); ``tokenizer``, the policy's, checks a teacher server's.
        """
        parts = trainer_parts(cfg, fn, policy, prepare=prepare, reference_off=reference_off, tokenizer=tokenizer,
                              teacher="teacher" not in kwargs)
        return cls(fn, policy, **parts, **kwargs)

    # -- estimate

    @torch.no_grad()
    def estimate(self, rollout: RolloutBatch, rewards: Tensor) -> TrainBatch:
        """Old (and reference) logprobs, values, and the algorithm's advantages for a rollout;
        ``rewards`` are taken as float32 (the verifiers' float64 values are the records')."""
        rewards = rewards.to(torch.float32)
        self.policy.eval()
        self._routing_metrics()  # moe/*: this rollout's forwards only
        forwards = Forwards(*self._recompute(rollout))
        old, ref, values = forwards.old_logprobs, forwards.ref_logprobs, forwards.values
        replay_metrics: dict[str, float] = {}
        if rollout.replayed is not None and bool(rollout.replayed.any()):  # sampling replay
            old, replay_metrics = self._replayed_old(rollout, old)
        mask = rollout.response_mask.float()
        est = self.fn.estimate(rewards, rollout.group_size, mask,
                               **estimate_inputs(self, rollout, forwards))
        advantages = est.advantages
        if rollout.kept_advantages is not None:  # replay(advantage=keep): a replayed row's own advantage
            kept = rollout.kept_advantages.to(advantages.device, advantages.dtype)
            advantages = torch.where(torch.isnan(kept), advantages, kept)
        metrics = dict(est.metrics)
        metrics.update(replay_metrics)
        metrics.update(self._perf_metrics("logprobs"))
        metrics.update(self._routing_metrics())
        valid = mask > 0
        if old is not None and valid.any():
            # train/inference mismatch: engine logprobs vs recomputed ones (both at the rollout T)
            metrics["rollout_logprob_diff"] = float((rollout.logprobs - old).abs()[valid].mean())
        teacher = None
        if self.teacher is not None and self.fn.algorithm.uses_teacher:
            with timed(metrics, "teacher"):  # time/teacher_s: in-process, an actor or a server alike
                teacher = self._teacher_forward(rollout)
                if teacher is not None and teacher.logprobs.is_cuda:  # its kernels, not their launch
                    torch.cuda.synchronize(teacher.logprobs.device)
        return TrainBatch(rollout, rewards, old, est.mask, advantages, est.returns, ref,
                          values, metrics, teacher, old_entropy=forwards.old_entropy,
                          old_topk_logprobs=forwards.old_topk_logprobs, old_topk_ids=forwards.old_topk_ids,
                          is_top1=forwards.is_top1)

    @torch.no_grad()
    def response_logprobs(self, batch: RolloutBatch) -> Tensor:
        """The policy's logprobs [B, Tr] of a batch's response tokens (no grad, micro-batch by
        micro-batch, at the rollout's temperature): what the rollout stage scores other sequences
        than the sampled ones with (``answer_prob``: the reference answer after each row's
        reasoning, train/answers.py). A mixture-of-experts policy's routing over these sequences, which
        the engine never sampled, counts into no moe/* metric."""
        self.policy.eval()
        device = next(self.policy.parameters()).device
        with self._routing_uncounted():
            return self._per_microbatch(self.policy, batch.to(device), "logprobs")

    def _replayed_old(self, rollout: RolloutBatch, old: Tensor | None) -> tuple[Tensor | None, dict[str, float]]:
        """pi_old of a batch with replayed groups (``sampling replay``, rollout/replay.py): on a
        replayed row, the behaviour policy's recorded logprobs (``rollout.logprobs``), so the loss's
        ratio is pi_theta / mu and every correction and trust region acts on it unchanged; on the
        others, this policy's (the old-logprob forward; made here when the update would have used
        its own). With a bypass correction pi_old is the engine's logprobs already (None stays).
        Also the replayed rows' ratio at the update's start, exp(log pi_theta - log mu), over their
        response tokens: ``replay/ratio_mean``, ``_min``, ``_max``."""
        current = old if old is not None else self._per_microbatch(self.policy, rollout, "logprobs")
        rows = rollout.replayed.to(current.device)[:, None]
        behaviour = rollout.logprobs.to(current.device, current.dtype)
        valid = rows & (rollout.response_mask.to(current.device) > 0)
        rho = torch.exp(current - behaviour)[valid]
        metrics = {"replay/ratio_mean": float(rho.mean()), "replay/ratio_min": float(rho.min()),
                   "replay/ratio_max": float(rho.max())} if rho.numel() else {}
        if self.fn.algorithm.old_from_rollout:
            return old, metrics
        return torch.where(rows, behaviour, current), metrics

    def _divergence(self, hidden: Tensor, batch: TrainBatch, rows: Tensor, tr: int) -> Tensor:
        """The generalized JSD [b, tr] of the policy (``hidden`` [b*tr, H], with gradient) from the
        teacher over the whole vocabulary, in chunks (train/divergence.py), at the spec's beta and
        temperature."""
        assert self.teacher is not None and batch.teacher is not None and batch.teacher.hidden is not None
        data = self.fn.data
        t_hidden = batch.teacher.hidden[rows][:, :tr].reshape(hidden.shape[0], -1).to(hidden.device)
        # a teacher on an actor: its LM head, copied here once (train/teachers.py)
        teacher = self.teacher if isinstance(self.teacher, nn.Module) else self.teacher.head(hidden.device)
        with self._autocast(self.policy):
            d = vocabulary_jsd(self.policy, teacher, hidden, t_hidden, data.jsd_beta, data.jsd_temperature,
                               self.logprob_chunk)
        return d.view(-1, tr).float()

    def _recompute(self, rollout: RolloutBatch) -> tuple[Tensor | None, ...]:
        """Old logprobs, reference logprobs, values, sum_v pi_v^2, the old policy's entropy, top-K
        logprobs [B, Tr, K], is-top-1, self-certainty and top-K ids [B, Tr, K] of every row (no grad).

        Old logprobs are None when the update is exactly on-policy (:meth:`_old_is_current`):
        the update then uses its own logprobs, detached, instead of a separate forward (and its
        own entropy as the old one). The statistics of the old policy (sum_v pi_v^2 of `baseline
        optimal_token`, the entropy a formula reads as ``old_ent``, the self-certainty an advantage
        formula reads) come from the old-logprob forward, and only when the spec reads them; else
        None. One the advantage stage reads runs that forward even where the update would not need
        it (exactly on-policy, or a bypass correction whose pi_old is the engine's).
        """
        algo = self.fn.algorithm
        old = None
        stats: dict[str, Tensor] = {}
        ids: list[Tensor] = []
        wanted = old_policy_statistics(algo, self.fn.data.policy_topk)
        # exactly on-policy, a statistic only the loss reads is the update forward's own (detached)
        now = set(algo.needs("advantage")) & set(wanted)
        if wanted and (now or not self._old_is_current()):
            made = self._per_microbatch(self.policy, rollout, "logprobs", tuple(wanted))  # logprobs, each, ids
            stats = dict(zip(wanted, made[1:]))
            ids = made[len(wanted) + 1:]  # the old top-K ids, when the top-K is read
            if not algo.old_from_rollout:  # bypass: pi_old stays the engine's
                old = made[0]
        elif algo.old_from_rollout:
            pass  # correction bypass: pi_old is the engine's logprobs, which the loss reads itself
        elif not self._old_is_current():
            old = self._per_microbatch(self.policy, rollout, "logprobs")
        ref = None
        if algo.uses_reference and self.reference is None:
            with self.reference_off(), self._routing_uncounted():  # type: ignore[misc]
                ref = self._per_microbatch(self.policy, rollout, "logprobs")
        elif algo.uses_reference:
            ref = self._per_microbatch(self.reference, rollout, "logprobs")
        values = None
        if algo.uses_critic:
            values = self._per_microbatch(self.critic, rollout, "critic")
        # in the order of Forwards: its statistics fields follow OLD_POLICY_STATISTICS, then the top-K ids
        return (old, ref, values) + tuple(stats.get(s) for s in OLD_POLICY_STATISTICS) + \
            (ids[0] if ids else None,)

    # -- update

    def _minibatch_rows(self, batch: TrainBatch, generator: torch.Generator | None) -> list[Tensor]:
        """Row indices of each minibatch: whole prompt groups, shuffled when there are several."""
        G = batch.group_size
        P = batch.rewards.shape[0] // G
        order = torch.randperm(P, generator=generator) if self.minibatches > 1 else torch.arange(P)
        groups = order.chunk(self.minibatches)
        return [group_rows(g, G) for g in groups if len(g)]

    def update(self, batch: TrainBatch, generator: torch.Generator | None = None) -> dict[str, float]:
        """``ppo_epochs`` passes of minibatch updates; returns their metrics, combined over
        minibatches and epochs by each metric's kind (records/metrics.py ``COMBINE``).

        A minibatch whose loss or gradient is not finite is skipped (no optimizer step, the
        weights untouched) and counted in ``skipped_nonfinite``. When every advantage is 0
        and the loss has no other term, the optimizer step is skipped (``skipped_zero_adv``).
        """
        algo = self.fn.algorithm
        only_pg = not (algo.kl_in == "loss" or algo.uses_entropy or algo.uses_critic or algo.uses_teacher)
        if self.skip_zero_advantage and only_pg and not bool((batch.advantages * batch.mask).any()):
            return {SKIPPED_ZERO_ADV: 1.0, SKIPPED_NONFINITE: 0.0, OPTIMIZER_STEPS: 0.0}
        self.policy.train()
        parts: list[tuple[dict[str, float], float, float]] = []
        skipped = 0
        steps = 0
        for _ in range(self.ppo_epochs):
            for rows in self._minibatch_rows(batch, generator):
                m = self._step(batch, rows)
                if m is None:
                    skipped += 1
                    continue
                steps += 1
                parts.append((m,) + _weights(batch.mask[rows]))
        out = combine(parts, whole=True)
        out.update(self._perf_metrics("update"))
        # moe/*: estimate()'s old-logprob forward reported them; else (on-policy) the update's first
        out.update({k: v for k, v in self._routing_metrics().items() if k not in batch.metrics})
        out.update({SKIPPED_NONFINITE: float(skipped), SKIPPED_ZERO_ADV: 0.0, OPTIMIZER_STEPS: float(steps)})
        if self.loss_scaler is not None:  # (of the skipped minibatches, those an overflow skipped)
            out.update({LOSS_SCALE: self.loss_scaler.scale, SKIPPED_STEPS: float(self.loss_scaler.take_skipped())})
        return out

    def _step(self, batch: TrainBatch, rows: Tensor) -> dict[str, float] | None:
        """One optimizer step on a minibatch: forward/backward micro-batch by micro-batch,
        each loss over the minibatch's global denominator, gradients summed."""
        fn = self.fn
        algo = fn.algorithm
        G = batch.group_size
        minibatch = rows
        rows, share = self._local_rows(rows, G, row_tokens(batch.rollout)[rows])
        sub = batch.rollout.select(rows)
        mask = batch.mask[rows]
        denom = self._global_denominator(fn.denominator(mask, G), share)
        vdenom = self._global_denominator(fn.value_denominator(mask, G), share) if algo.uses_critic else None
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        mbs, by_group = self._microbatches(sub)
        Tr = sub.response_ids.shape[1]
        ent_coef = fn.entropy_coef()  # `entropy adaptive`: the same coefficient for every micro-batch
        parts: list[tuple[dict[str, float], tuple[float, float], bool]] = []
        # a loss formula reading a batch_* statistic: each micro-batch's loss() call gets the
        # whole minibatch (every rank's rows), the other micro-batches' values from a no-grad
        # pass before this step, gathered from every rank
        whole = None
        if self._batch_wide and (len(mbs) > 1 or self._ranks() > 1):
            whole, at = self._every_rank(self._whole_minibatch(batch, sub, rows, mbs, by_group),
                                         minibatch, rows, share)
            wsub = batch.rollout.select(minibatch)
            denom = fn.denominator(batch.mask[minibatch], G).to(denom.device)  # = the ranks' sum
            if vdenom is not None:
                vdenom = fn.value_denominator(batch.mask[minibatch], G).to(vdenom.device)
        for mb, weight in mbs:
            w = share * weight
            r = rows[mb]
            if self.max_tokens_per_microbatch:
                part, tr = trim(sub.select(mb))
            else:
                part, tr = sub, Tr
            with self._discarded(w == 0.0):
                fwd = self._update_forward(batch, part, r, tr, by_group)
                if whole is None:
                    m = self._loss_backward(batch, part, r, tr, fwd, denom, vdenom, w, ent_coef)
                else:
                    m = self._loss_backward(batch, wsub, minibatch, Tr, _put(whole, at[mb], fwd), denom, vdenom,
                                            w, ent_coef)
            if m is None:
                self.optimizer.zero_grad(set_to_none=True)
                if self.critic_optimizer is not None:
                    self.critic_optimizer.zero_grad(set_to_none=True)
                return None
            if whole is None:
                parts.append((m, _weights(batch.mask[r]) if w else (0.0, 0.0), bool(w)))
            elif not parts:  # every call gave the whole minibatch's loss and metrics: keep one
                parts.append((m, _weights(batch.mask[minibatch]), True))
        params = [p for p in self.policy.parameters() if p.grad is not None]
        critic_params = [p for p in self.critic.parameters() if p.grad is not None] if self.critic is not None else []
        if self.loss_scaler is not None:  # float16: the gradients unscaled before clipping
            self.loss_scaler.unscale(params + critic_params)
        gnorm = _clip(params, self.grad_clip)
        cnorm = None
        if self.critic is not None:
            cnorm = _clip(critic_params, self.grad_clip)
        finite = math.isfinite(gnorm) and (cnorm is None or math.isfinite(cnorm))
        if self.loss_scaler is not None:  # an overflow: the step is skipped and the scale backs off
            self.loss_scaler.update(finite)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            if self.critic_optimizer is not None:
                self.critic_optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        if self.teacher_ema is not None:  # teacher.ema: ema = decay*ema + (1-decay)*policy
            assert isinstance(self.teacher, nn.Module)
            ema_update(self.teacher, self.policy, self.teacher_ema)
        if self.critic_optimizer is not None:
            self.critic_optimizer.step()
        metrics = combine([(m, *tw) for m, tw, real in parts if real]
                          or [(m, 0.0, 0.0) for m, _, _ in parts])
        metrics[GRAD_NORM] = gnorm
        if cnorm is not None:
            metrics[CRITIC_GRAD_NORM] = cnorm
        if whole is None:  # (the whole-minibatch metrics are every rank's already, the same on each)
            metrics = self._reduce_metrics(metrics, mask, share)
        if ent_coef is not None:  # the step's mean entropy (every micro-batch and rank) moves it
            metrics.update(fn.update_entropy_coef(metrics["entropy"]))
        return metrics

    def _update_forward(self, batch: TrainBatch, sub: RolloutBatch, rows: Tensor, tr: int,
                        groups: bool) -> dict[str, Tensor | None]:
        """The policy's (and critic's) forward of one micro-batch (rows of ``batch``, trimmed to
        ``tr`` response columns), with gradient unless under ``torch.no_grad()``: its logprobs,
        entropy, top-k logprobs of the teacher's tokens, divergence and values [b, tr(, J)], and the
        policy's top-K (:meth:`_topk_asks`)."""
        teacher_ids = None
        if batch.teacher is not None and batch.teacher.topk_ids is not None:
            teacher_ids = batch.teacher.topk_ids[rows][:, :tr].to(sub.response_ids.device)
        jsd = self.fn.data.jsd_beta is not None and batch.teacher is not None
        aux = reads_router_aux(self.fn.algorithm)
        gather, topk, top1 = self._topk_asks(batch, rows, tr, teacher_ids, sub.response_ids.device)
        out = self._logprobs(self.policy, sub, grad=torch.is_grad_enabled(), entropy=True,
                             groups=groups, gather_ids=gather, hidden=jsd, router_aux=aux, topk=topk, sampled_is_top=top1)
        J = 0 if teacher_ids is None else teacher_ids.shape[-1]
        teacher_topk = None if teacher_ids is None else out.gathered[..., :J]
        policy_topk = out.top_logprobs if topk else (out.gathered[..., J:] if gather is not None and
                                                       gather.shape[-1] > J else None)
        return {"logp": out.logprobs, "ent": out.entropy, "router_aux": out.router_aux, "topk": teacher_topk,
                "policy_topk": policy_topk, "top1": out.sampled_is_top,
                "divergence": self._divergence(out.hidden, batch, rows, tr) if jsd else None,
                "values": self._values(sub, tr) if self.fn.algorithm.uses_critic else None}

    def _topk_asks(self, batch: TrainBatch, rows: Tensor, tr: int, teacher_ids: Tensor | None,
                   device: torch.device) -> tuple[Tensor | None, int, bool]:
        """What the update forward asks for the policy's top-K (the spec's K): the ids to gather
        at -- the teacher's top-k, then the old policy's top-K ids the old forward kept --, the K
        of a forward that picks its own (exactly on-policy: no old forward ran, this forward's
        policy is the old one), and whether it says which sampled tokens are its most likely
        (on-policy, when the spec reads that)."""
        K = self.fn.data.policy_topk or 0
        gather = teacher_ids
        if K and batch.old_topk_ids is not None:
            old_ids = batch.old_topk_ids[rows][:, :tr].to(device)
            gather = old_ids if teacher_ids is None else torch.cat([teacher_ids, old_ids], dim=-1)
            K = 0
        fields = {OLD_POLICY_STATISTICS[s] for s in old_policy_statistics(self.fn.algorithm)}
        return gather, K, batch.is_top1 is None and "sampled_is_top" in fields

    def _whole_minibatch(self, batch: TrainBatch, sub: RolloutBatch, rows: Tensor,
                         mbs: list[tuple[Tensor, float]], groups: bool) -> dict[str, Tensor | None]:
        """The update forward's values [n, Tr(, J)] of every row of the minibatch ``sub`` (rows
        ``rows`` of ``batch``), micro-batch by micro-batch, without gradient: the current policy
        before this optimizer step, what each micro-batch's whole-minibatch loss() call reads for
        the rows of the others (docs/formulas.md, "The batch")."""
        Tr = sub.response_ids.shape[1]
        out: dict[str, Tensor | None] = {}
        with torch.no_grad():
            for mb, weight in mbs:
                part, tr = trim(sub.select(mb)) if self.max_tokens_per_microbatch else (sub, Tr)
                with self._discarded(weight == 0.0):
                    fwd = self._update_forward(batch, part, rows[mb], tr, groups)
                for k, t in fwd.items():
                    if t is None:
                        out[k] = None
                        continue
                    if out.get(k) is None:
                        out[k] = t.new_zeros((len(rows), Tr) + tuple(t.shape[2:]))
                    out[k][mb.to(t.device), :tr] = t  # type: ignore[index]
        return out

    def _loss_backward(self, batch: TrainBatch, sub: RolloutBatch, rows: Tensor, tr: int,
                       fwd: dict[str, Tensor | None], denom: Tensor, vdenom: Tensor | None, weight: float,
                       entropy_coef: Tensor | None = None) -> dict[str, float] | None:
        """The loss of rows ``rows`` of ``batch`` (``sub``, trimmed to ``tr`` response columns)
        from the update forward's values ``fwd``, over the minibatch's denominator, and its
        backward scaled by ``weight``; None (and no backward) when the loss is not finite on
        some rank."""
        fn = self.fn
        logp = fwd["logp"]
        assert logp is not None
        micro = Micro(batch, sub, rows, tr, fwd["ent"], fwd["values"], entropy_coef, fwd["topk"],
                      fwd["divergence"], fwd.get("router_aux"), fwd.get("policy_topk"), fwd.get("top1"))
        old = micro.cols(batch.old_logprobs) if batch.old_logprobs is not None else logp.detach()
        mask = micro.cols(batch.mask)
        out = fn.loss(logp, old, micro.cols(batch.advantages), mask, denominator=denom,
                      value_denominator=vdenom, **loss_inputs(self, micro, logp.device))
        total = out.loss if out.value_loss is None else out.loss + out.value_loss
        if not self._all_finite(total):
            return None
        if self.loss_scaler is not None:  # float16: the backward runs on the scaled loss
            weight = weight * self.loss_scaler.scale
        (total if weight == 1.0 else total * weight).backward()
        metrics = dict(out.metrics)
        metrics[LOSS] = float(out.loss.detach())
        valid = sub.response_mask > 0
        if batch.old_logprobs is None and valid.any():  # estimate() left the mismatch metric to us
            metrics["rollout_logprob_diff"] = float(
                (sub.logprobs.to(old.device) - old).abs()[valid.to(old.device)].mean())
        return metrics

    def _old_is_current(self) -> bool:
        """Whether the old logprobs are exactly the logprobs the update computes anyway.

        True for one update per rollout (``ppo_epochs == 1``, one minibatch) of a policy
        without active dropout, when the advantages do not need them (no KL in the reward):
        the one optimizer step happens after the only forward, so pi_old == pi_theta and the
        ratio is 1 either way. Then ``estimate`` skips its forward pass (TRL does the same:
        ``old_per_token_logps = per_token_logps.detach()`` when num_iterations == 1).
        """
        if self.ppo_epochs != 1 or self.minibatches != 1 or self.fn.algorithm.kl_in == "reward" \
                or advantages_read_old_policy(self.fn.algorithm) \
                or self._corrects():  # a correction compares pi_old with the engine before the update
            return False  # (an advantage formula reading old_logp needs them before any update)
        # whether the policy has active dropout: read once per policy module (a walk over its
        # modules and its config, which no step changes), not at every step
        known = getattr(self, "_dropout_of", None)
        if known is None or known[0] is not self.policy:
            known = self._dropout_of = (self.policy, _has_dropout(self.policy))
        return not known[1]

    def _corrects(self) -> bool:
        """The spec reads the engine's logprobs (a correction): pi_old is compared with them."""
        return reads_engine(self.fn.algorithm)

    # -- data parallelism: identities on one rank; the sharded trainer (workers/fsdp.py)
    #    overrides them so that N ranks compute one rank's update

    def _local_rows(self, rows: Tensor, group_size: int, tokens: Tensor) -> tuple[Tensor, float]:
        """This rank's rows of a minibatch (whole groups, balanced by the rows' real ``tokens``)
        and its share: 1, or 0 for a rank that got no group and runs a zero-weighted copy to
        keep the collectives in step."""
        return rows, 1.0

    def _global_denominator(self, local: Tensor, share: float) -> Tensor:
        """The aggregation count over every rank (docs/api.md, "Denominators")."""
        return local

    def _ranks(self) -> int:
        """How many trainer ranks share each minibatch."""
        return 1

    def _every_rank(self, local: dict[str, Tensor | None], minibatch: Tensor, rows: Tensor,
                    share: float) -> tuple[dict[str, Tensor | None], Tensor]:
        """The no-grad update values ``local`` of this rank's ``rows`` [n, Tr(, J)] -> those of every
        row of ``minibatch`` (every rank's), and the positions of ``rows`` in it."""
        return local, torch.arange(len(rows))

    def _all_finite(self, loss: Tensor) -> bool:
        """Whether the loss is finite on every rank (all ranks skip the step together)."""
        return bool(torch.isfinite(loss))

    def _reduce_metrics(self, metrics: dict[str, float], mask: Tensor, share: float) -> dict[str, float]:
        """Metrics of the whole minibatch from each rank's own (``mask``: this rank's rows'), by
        their kinds (records/metrics.py ``COMBINE``)."""
        return metrics

    def teacher_state(self) -> dict[str, Tensor] | None:
        """The EMA teacher's weights (``teacher.ema``) as a checkpoint keeps them (CPU copies);
        None for any other teacher."""
        if self.teacher_ema is None:
            return None
        assert isinstance(self.teacher, nn.Module)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.teacher.state_dict().items()}

    def load_teacher_state(self, state: dict[str, Tensor] | None) -> None:
        """Restore :meth:`teacher_state`'s weights; a checkpoint without them (saved with no
        ``teacher.ema``) starts the EMA teacher from the restored policy."""
        if self.teacher_ema is None:
            return
        assert isinstance(self.teacher, nn.Module)
        if state is None:
            self.teacher.load_state_dict(self.policy.state_dict())
        else:
            self.teacher.load_state_dict(state)

    def step_schedule(self) -> None:
        """Advance the LR schedule once per training step (also when the update was skipped)."""
        if self.scheduler is not None:
            with warnings.catch_warnings():  # torch's warning when the first update was skipped; the filter's
                # message is a regular expression: unescaped, "step()" matched "step" then nothing, and it leaked
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                self.scheduler.step()
            self._set_critic_lr(self.scheduler.last_epoch)

    def _set_critic_lr(self, step: int) -> None:
        """The critic's LR at ``step`` of the policy's schedule (stateless: a resumed run's
        restored policy scheduler gives it back)."""
        if self.critic_optimizer is None or self.critic_lr_factor is None:
            return
        f = self.critic_lr_factor(step)
        for g, base in zip(self.critic_optimizer.param_groups, self.critic_base_lrs):
            g["lr"] = base * f


def _put(whole: dict[str, Tensor | None], mb: Tensor, fwd: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    """The minibatch's values ``whole`` with the rows ``mb`` (positions in it) replaced by one
    micro-batch's forward ``fwd`` [b, tr(, J)], which carries the gradient: the other rows are
    constants here, their gradient comes from their own micro-batch's call."""
    out: dict[str, Tensor | None] = {}
    for k, t in fwd.items():
        w = whole.get(k)
        if t is None or w is None:
            out[k] = t if w is None else w
            continue
        merged = w.clone()
        merged[mb.to(w.device), :t.shape[1]] = t.to(w.dtype)
        out[k] = merged
    return out


def _weights(mask: Tensor) -> tuple[float, float]:
    """(loss-mask tokens, rows with one) of rows' ``mask`` [b, T]: a piece's weights when its
    metrics are combined with others' (records/metrics.py ``combine``)."""
    return float(mask.sum()), float((mask.sum(-1) > 0).sum())


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
