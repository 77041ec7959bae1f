"""The forwards a trainer runs over a rollout: a model's logprobs (with entropy, top-k gathers,
hidden states) and the critic's values under autocast, micro-batch by micro-batch within
``train.max_tokens_per_microbatch`` (train/microbatch.py), the no-grad passes over every row
(old / reference logprobs, values), the teacher's forward, and the tokens and FLOPs they
pushed (train/throughput.py), reported as ``perf/<phase>_*``.

:class:`ForwardPasses` is the base of train/trainer.py's ``Trainer``, which decides which passes
an algorithm needs and runs its estimate and update on them. ``_token_logprobs``,
``_microbatch_count`` and ``_all_ranks`` are the data-parallel hooks of these passes (identities
on one rank; the sharded trainer, workers/fsdp.py, overrides them).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from rldsl import CompiledAlgorithm

from ..batch import RolloutBatch, model_inputs
from ..models import moe
from ..models.kinds import ModelKind, model_kind
from .inputs import OLD_POLICY_STATISTICS, entropy_grad, whole_groups
from .logprobs import Forward, LogprobOptions, LogprobOut, compiled_body, token_logprobs
from .microbatch import plan, trim
from .teachers import RemoteTeacher, TeacherForward, privileged, teacher_topk
from .throughput import ModelDims, TokenCount


class ForwardPasses:
    """The forwards of ``policy`` (and critic, teacher, or any model given) over rollout batches,
    their micro-batches, and their token counts per phase (``"logprobs"``: no grad, ``"update"``)."""

    def __init__(self, fn: CompiledAlgorithm, policy: nn.Module, *, critic: nn.Module | None = None,
                 teacher: nn.Module | RemoteTeacher | None = None, temperature: float = 1.0,
                 logprob_chunk: int = 1024, max_tokens_per_microbatch: int | None = None,
                 autocast_dtype: torch.dtype | None = None, packing: bool = False,
                 packing_row_tokens: int | None = None, compile_policy: bool = False,
                 routing_replay: bool = False, kind: ModelKind | None = None):
        self.fn = fn
        self.policy = policy
        # the policy's family (models/kinds/): what its forwards feed beside the ids, chosen once
        # from its config; its reference and critic are of the same family
        self.kind = kind if kind is not None else model_kind(policy)
        self.critic = critic
        # a distill spec's teacher: a model (frozen, eval) on the policy's device, or a remote one
        # (a Ray actor, a server: train/teachers.py) that returns its logprobs
        self.teacher = teacher
        # the rollout's sampling temperature: old, new and reference logprobs and the entropy
        # are those of softmax(z / T), the distribution the engine sampled from
        self.temperature = float(temperature)
        self.logprob_chunk = logprob_chunk
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.autocast_dtype = autocast_dtype
        self.packing = packing  # padding-free forwards (train/packing.py)
        self.packing_row_tokens = packing_row_tokens
        # what the forwards pushed since the last report, per phase (train/throughput.py)
        self.counts: dict[str, TokenCount] = {"logprobs": TokenCount(), "update": TokenCount()}
        self._dims: dict[int, ModelDims] = {}
        self._waste = False  # the forwards now running are discarded copies (zero weight)
        # model.compile: a torch.compile'd view of the policy's body (the module itself is untouched,
        # so copies of it -- reference, critic, engine -- stay eager)
        self._compiled_body = compiled_body(policy) if compile_policy else None
        # a mixture-of-experts policy (models/moe.py): the forwards replay the engine's recorded
        # experts (rollout.routing_replay) and count what the routers did (moe/* metrics)
        self.moe = moe.is_moe(policy)
        self.routing_replay = routing_replay
        self.routing_stats = moe.RoutingStats()
        self._count_routing = True  # off while the policy stands in for its reference (LoRA)

    # -- logprobs

    # the sharded trainer (workers/fsdp.py) runs it under the FSDP root's hooks
    _token_logprobs = staticmethod(token_logprobs)

    def _logprobs(self, model: nn.Module, batch: RolloutBatch, *, grad: bool,
                  entropy: bool, groups: bool = True, sum_pi_squared: bool = False,
                  gather_ids: Tensor | None = None, hidden: bool = False,
                  router_aux: bool = False, topk: int = 0, sampled_is_top: bool = False,
                  self_certainty: bool = False) -> LogprobOut:
        """The logprobs [b, Tr] of ``batch`` under ``model``, and what the flags ask beside them
        (train/logprobs.py ``LogprobOut``): the entropy, sum_v pi_v^2, the logprobs of
        ``gather_ids`` [b, Tr, J], the hidden states the head ran on, each response token's
        load-balancing loss (with gradient), the K = ``topk`` largest logprobs and their ids, whether
        each sampled token is the most likely, the self-certainty logsumexp(z) - mean(z)."""
        ids, attn, pos = model_inputs(batch)
        Tr = batch.response_ids.shape[1]
        inputs = self.kind.forward_inputs(model, batch, ids, attn)  # rows that run whole share no prompt
        fwd = Forward(ids, attn, Tr, group_size=batch.group_size if groups and not inputs.whole_rows else None,
                      routing=batch.routed_experts if self.moe else None, inputs=inputs, gather_ids=gather_ids)
        count = TokenCount()
        options = LogprobOptions(entropy=entropy, entropy_grad=grad and entropy_grad(self.fn.algorithm),
                                 sum_pi_squared=sum_pi_squared, router_aux=router_aux, hidden=hidden,
                                 topk=topk, sampled_is_top=sampled_is_top, self_certainty=self_certainty,
                                 temperature=self.temperature, chunk_size=self.logprob_chunk, packing=self.packing,
                                 packing_row_tokens=self.packing_row_tokens, count=count,
                                 body=self._compiled_body if model is self.policy else None)
        with torch.set_grad_enabled(grad), self._autocast(model), self._routing(model, router_aux):
            out = self._token_logprobs(model, fwd, options)
        self._tally("update" if grad else "logprobs", count, model, backward=grad)
        return out

    def _routing(self, model: nn.Module, aux: bool = False) -> Any:
        """A MoE model's forwards replay the recorded routing (``routing_replay``); the policy's
        count into ``routing_stats`` and, with ``aux``, keep each token's load-balancing loss
        (models/moe.py)."""
        if not self.moe:
            return contextlib.nullcontext()
        counted = model is self.policy and self._count_routing
        return moe.routing(model, replay=self.routing_replay, stats=self.routing_stats if counted else None, aux=aux)

    @contextlib.contextmanager
    def _routing_uncounted(self) -> Iterator[None]:
        """The policy's forwards inside count nothing into ``routing_stats``: with LoRA the
        reference is the policy with its adapters off, which routes as the base model does, not as
        the policy that sampled (counted, its routing showed as ``moe/router_drift``)."""
        saved, self._count_routing = self._count_routing, False
        try:
            yield
        finally:
            self._count_routing = saved

    def _routing_metrics(self) -> dict[str, float]:
        """``moe/*`` of the policy's forwards since the last report (models/moe.py), then reset:
        estimate() reports its old-logprob forwards', update() its own when estimate ran none."""
        if not self.moe:
            return {}
        stats, self.routing_stats = self.routing_stats, moe.RoutingStats()
        return self._every_rank_routing(stats).metrics()

    def _every_rank_routing(self, stats: moe.RoutingStats) -> moe.RoutingStats:
        """This rank's routing stats -> every rank's (summed); on one rank its own."""
        return stats

    def _tally(self, phase: str, count: TokenCount, model: nn.Module, backward: bool) -> None:
        """Add one forward's tokens and FLOPs to its phase's count."""
        dims = self._dims.get(id(model))
        if dims is None:
            dims = self._dims[id(model)] = ModelDims.of(model)
        self.counts[phase].merge(count, dims, backward, waste=self._waste)

    @contextlib.contextmanager
    def _discarded(self, flag: bool) -> Any:
        """Count the forwards inside as padding when ``flag`` (a zero-weighted copy)."""
        before, self._waste = self._waste, self._waste or flag
        try:
            yield
        finally:
            self._waste = before

    def _perf_metrics(self, phase: str) -> dict[str, float]:
        """``perf/<phase>_*`` of the forwards since the last report (every rank's), then reset:
        real and computed tokens, model FLOPs, and the balance of real tokens over micro-batches
        and ranks (the largest over the mean; 1 = even)."""
        c = self.counts[phase]
        self.counts[phase] = TokenCount()
        forwards = [n for n in c.per_forward]
        micro = max(forwards) / (sum(forwards) / len(forwards)) if forwards and sum(forwards) else 1.0
        real, computed, padding, flops, rank_imbalance, micro = self._all_ranks(
            float(c.real), float(c.computed), float(c.padding), c.flops, micro)
        return {f"perf/{phase}_tokens": real, f"perf/{phase}_computed_tokens": computed,
                f"perf/{phase}_padding_tokens": padding, f"perf/{phase}_flops": flops,
                f"perf/{phase}_token_imbalance": rank_imbalance, f"perf/{phase}_microbatch_imbalance": micro}

    def _all_ranks(self, real: float, computed: float, padding: float, flops: float,
                   micro: float) -> tuple[float, float, float, float, float, float]:
        """(real, computed, padding, flops summed over ranks, the largest rank's real tokens over
        the mean, the largest micro-batch imbalance); on one rank its own, imbalance 1."""
        return real, computed, padding, flops, 1.0, micro

    def _autocast(self, model: nn.Module) -> Any:
        """Mixed precision: the forwards compute in ``autocast_dtype`` (parameters, gradients
        and optimizer state stay float32); a no-op without it."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device = next(model.parameters()).device
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def _values(self, batch: RolloutBatch, tr: int) -> Tensor:
        """The critic's values [b, tr] (float32)."""
        ids, attn, pos = model_inputs(batch)
        count = TokenCount()
        grad = torch.is_grad_enabled()
        with self._autocast(self.critic):
            out = self.critic(ids, attn, pos, tr, packing=self.packing, packing_row_tokens=self.packing_row_tokens,
                              group_size=batch.group_size, count=count).float()
        self._tally("update" if grad else "logprobs", count, self.critic, backward=grad)
        return out

    # -- micro-batches (train/microbatch.py)

    def _microbatches(self, batch: RolloutBatch) -> tuple[list[tuple[Tensor, float]], bool]:
        """([(row indices, weight)], whole groups) of the forwards over ``batch``: one with
        every row when there is no token budget. Weight 0 marks a padding copy that only keeps
        the ranks' collectives in step (its result is discarded)."""
        B = len(batch)
        if not self.max_tokens_per_microbatch or B == 0:
            return [(torch.arange(B), 1.0)], True
        whole = whole_groups(self.fn.algorithm["aggregation"].spec.facts.needs)  # e.g. prompt_mean
        rows, by_group = plan(batch, self.max_tokens_per_microbatch, whole_groups=whole)
        n = self._microbatch_count(len(rows))
        if n != len(rows):
            rows, by_group = plan(batch, self.max_tokens_per_microbatch, whole_groups=whole, min_bins=n)
        first = next(r for r in rows if len(r))
        return [(r, 1.0) if len(r) else (first, 0.0) for r in rows], by_group

    def _microbatch_count(self, local: int) -> int:
        """The number of micro-batches every rank runs (the largest rank's; here its own)."""
        return local

    def _per_microbatch(self, model: nn.Module, batch: RolloutBatch, what: str,
                        statistics: tuple[str, ...] = ()) -> Any:
        """Old/reference logprobs (``what="logprobs"``) or critic values (``"critic"``) [B, Tr] of
        every row, computed micro-batch by micro-batch (no grad). With ``statistics`` (keys of
        ``inputs.OLD_POLICY_STATISTICS``: sum_v pi_v^2, the entropy, the top-K logprobs, is-top-1,
        the self-certainty)
        a list: the logprobs, then each statistic ([B, Tr], or [B, Tr, K] for the top-K), then the
        top-K ids [B, Tr, K] when the top-K is among them, from the same forwards."""
        mbs, by_group = self._microbatches(batch)
        B, Tr = batch.response_ids.shape
        flags = [OLD_POLICY_STATISTICS[s] for s in statistics]
        topk = (self.fn.data.policy_topk or 0) if "top_logprobs" in flags else 0
        asks = {f: True for f in flags if f != "top_logprobs"}
        fields = flags + (["top_ids"] if topk else [])
        out: list[Tensor] | None = None
        for rows, weight in mbs:
            if not self.max_tokens_per_microbatch:
                sub, tr = batch, Tr
            else:
                sub, tr = trim(batch.select(rows))
            with self._discarded(weight == 0.0):
                if what == "critic":
                    parts = [self._values(sub, tr)]
                else:
                    # each flag a LogprobOut field the forward returns (entropy, sum_pi_squared)
                    got = self._logprobs(model, sub, grad=False, groups=by_group, topk=topk,
                                         **{"entropy": False, **asks})
                    parts = [got.logprobs] + [getattr(got, f) for f in fields]
            if weight == 0.0:
                continue
            if out is None:
                out = [t.new_zeros((B, Tr) + tuple(t.shape[2:])) for t in parts]
            for k, t in enumerate(parts):  # zeros in the trimmed (masked) columns
                out[k][rows.to(t.device), :t.shape[1]] = t
        assert out is not None
        return out if statistics else out[0]

    # -- the teacher (train/teachers.py)

    def _teacher_forward(self, rollout: RolloutBatch) -> TeacherForward | None:
        """The teacher's logprobs of the sampled tokens and, for a top-k divergence, its k largest
        logprobs and their ids [B, Tr, k], for a JSD over the vocabulary its last hidden states
        [B, Tr, H_t]; micro-batch by micro-batch, no grad, at the rollout temperature, after each
        row's privileged prompt where the batch has one (``teacher_prompt_ids``); None when the
        spec reads no teacher."""
        if self.teacher is None or not self.fn.algorithm.uses_teacher:
            return None
        rollout = privileged(rollout)  # teacher.context_key: each row's privileged prompt, same response
        k, jsd = self.fn.data.teacher_topk, self.fn.data.jsd_beta is not None
        if k is None and not jsd and isinstance(self.teacher, nn.Module):
            return TeacherForward(self._per_microbatch(self.teacher, rollout, "logprobs"), None, None)
        mbs, by_group = self._microbatches(rollout)
        B, Tr = rollout.response_ids.shape
        dev = rollout.response_mask.device
        lp = torch.zeros(B, Tr, device=dev)
        top = torch.full((B, Tr, k or 0), -math.inf, device=dev)
        ids = torch.zeros(B, Tr, k or 0, dtype=torch.long, device=dev)
        hidden = None
        for rows, weight in mbs:
            sub, tr = (rollout, Tr) if not self.max_tokens_per_microbatch else trim(rollout.select(rows))
            out = self._teacher_topk(sub, k or 0, by_group, jsd)
            if weight == 0.0:
                continue
            r = rows.to(dev)
            lp[r, :tr], top[r, :tr], ids[r, :tr] = out[0].float(), out[1].float(), out[2]
            if jsd:
                if hidden is None:
                    hidden = out[3].new_zeros((B, Tr, out[3].shape[-1]))
                hidden[r, :tr] = out[3]
        return TeacherForward(lp, top if k else None, ids if k else None, hidden)

    def _teacher_topk(self, batch: RolloutBatch, k: int, groups: bool, hidden: bool) -> tuple[Tensor, ...]:
        """(logprobs [b, Tr], top-k logprobs, ids [b, Tr, k][, hidden]) of the teacher over ``batch``:
        its forward here, or the remote teacher's answer."""
        assert self.teacher is not None
        group_size = batch.group_size if groups else None
        if not isinstance(self.teacher, nn.Module):
            return self.teacher.topk(batch, k, self.temperature, group_size, hidden)
        return teacher_topk(self.teacher, batch, k, temperature=self.temperature, chunk=self.logprob_chunk,
                            group_size=group_size, autocast=self._autocast(self.teacher), hidden=hidden)
