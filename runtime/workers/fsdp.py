"""The trainer on one rank of an FSDP2 group: N ranks compute exactly the update of one rank.

Each rank holds the policy (and reference, critic) sharded with ``fully_shard`` per
transformer block and at the root, with its shard of the optimizer state. Rows are split
by whole prompt groups; old/reference logprobs and values are assembled by an all-reduce
of zero-padded tensors; rank 0's advantages are broadcast so every rank takes the same
skip decisions; each rank's loss gets the all-reduced denominator and FSDP reduces
gradients as a plain sum. A rank without a group runs a zero-weighted copy so the
collectives stay in step. Why each step is exact: docs/runtime.md, "Trainer ranks".

Nothing here knows Ray, nor the run's config: fsdp_rank.py starts a rank from both.
"""
from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


from ..batch import RolloutBatch
from ..models.lora import LoraAdapter, adapter_of, lora_scalings, merge_state
from ..records.metrics import combine_ranks
from ..models.loading import with_tied
from ..train.logprobs import Forward, LogprobOptions, LogprobOut, token_logprobs
from ..train.microbatch import rank_groups, row_tokens
from ..train.trainer import TrainBatch, Trainer

LOGPROBS_METHOD = "rldsl_token_logprobs"
_BLOCK_LISTS = ("layers", "h", "blocks", "block")


# ----------------------------------------------------------------------------- FSDP2

def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of an HF causal LM (or a ValueModel's body): one FSDP unit each."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and name.rsplit(".", 1)[-1] in _BLOCK_LISTS:
            return list(module)
    raise ValueError(f"{type(model).__name__}: no list of transformer blocks found (looked for "
                     f"a ModuleList named one of {_BLOCK_LISTS})")


def shard_module(module: nn.Module, mesh: Any, *, mixed_precision: torch.dtype | None, gloo: bool) -> nn.Module:
    """``fully_shard`` every transformer block, then the root; gradients are summed over ranks.
    ``mixed_precision``: the dtype the unsharded parameters compute in (gradients reduced in
    float32, master weights float32), or None (no mixed precision)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    mp = (MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
          if mixed_precision is not None else MixedPrecisionPolicy())
    for block in transformer_blocks(module):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(module, mesh=mesh, mp_policy=mp)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, not mean: each rank holds a part of one loss
            if gloo:
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return module


def attach_logprobs(model: nn.Module) -> None:
    """Give the (FSDP root) model a method running ``token_logprobs`` under its FSDP hooks.

    ``token_logprobs`` calls the backbone and reads the LM head's weight directly, outside
    the root ``forward``; registering it as an FSDP forward method makes the root's
    parameters (embedding, final norm, head) unsharded while it runs, and their gradients
    reduce-scattered after the backward, as for ``forward``.
    """
    from torch.distributed.fsdp import register_fsdp_forward_method

    def rldsl_token_logprobs(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return token_logprobs(self, *args, **kwargs)

    setattr(model, LOGPROBS_METHOD, types.MethodType(rldsl_token_logprobs, model))
    register_fsdp_forward_method(model, LOGPROBS_METHOD)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in ``Optimizer.state_dict()`` index order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _index_keyed(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A full optimizer state dict keyed by parameter name -> keyed by index (one-process format)."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[k]: v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [index[k] for k in g["params"]]} for g in osd["param_groups"]]}


def _name_keyed(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`_index_keyed`."""
    return {"state": {names[int(k)]: v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [names[int(k)] for k in g["params"]]} for g in osd["param_groups"]]}


# ----------------------------------------------------------------------------- trainer

class ShardedTrainer(Trainer):
    """The :class:`Trainer` on one rank of an FSDP2 group (see the module docstring).

    Only the data-parallel hooks change; the loss is the compiled algorithm's, as on one rank.
    """

    def __init__(self, *args: Any, rank: int, world: int, device: torch.device, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.rank, self.world, self.device = rank, world, device

    # -- forward

    def _token_logprobs(self, model: nn.Module, fwd: Forward,  # type: ignore[override]
                        options: LogprobOptions) -> LogprobOut:
        return getattr(model, LOGPROBS_METHOD)(fwd.to(self.device), options)

    def _groups(self, rows: Tensor, group_size: int, tokens: Tensor) -> tuple[Tensor, float]:
        """This rank's whole groups of ``rows``, balanced over the ranks by real ``tokens``
        (train/microbatch.py ``rank_groups``)."""
        groups = rows.view(-1, group_size)
        load = tokens.view(-1, group_size).sum(1).tolist()
        mine = rank_groups(load, self.world)[self.rank]
        if not mine:  # fewer groups than ranks: a zero-weighted copy keeps collectives in step
            return groups[:1].reshape(-1), 0.0
        return groups[torch.tensor(mine)].reshape(-1), 1.0

    def _recompute(self, rollout: RolloutBatch) -> tuple[Tensor, Tensor | None, Tensor | None]:
        B = len(rollout)
        rows, share = self._groups(torch.arange(B), rollout.group_size, row_tokens(rollout))
        with self._discarded(share == 0.0):
            local = super()._recompute(rollout.select(rows))
        return tuple(None if t is None else self._assemble(t, rows, B, share) for t in local)  # type: ignore[return-value]

    def _assemble(self, local: Tensor, rows: Tensor, B: int, share: float) -> Tensor:
        """[b, T] rows of this rank -> [B, T] of every rank (each row written by one rank)."""
        full = local.new_zeros((B,) + tuple(local.shape[1:]))
        if share:
            full[rows.to(full.device)] = local
        dist.all_reduce(full)
        return full

    @torch.no_grad()
    def estimate(self, rollout: RolloutBatch, rewards: Tensor) -> TrainBatch:
        tb = super().estimate(rollout, rewards)
        for name in ("advantages", "returns", "mask"):  # one decision for every rank
            t = getattr(tb, name)
            buf = t.contiguous()
            dist.broadcast(buf, src=0)
            if buf is not t:
                setattr(tb, name, buf)
        return tb

    # -- update hooks (Trainer._step)

    def _local_rows(self, rows: Tensor, group_size: int, tokens: Tensor) -> tuple[Tensor, float]:
        return self._groups(rows, group_size, tokens)

    def _microbatch_count(self, local: int) -> int:
        n = torch.tensor([local], device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return int(n.item())

    def _ranks(self) -> int:
        return self.world

    def _every_rank(self, local: dict[str, Tensor | None], minibatch: Tensor, rows: Tensor,
                    share: float) -> tuple[dict[str, Tensor | None], Tensor]:
        """Each rank's rows written into a zero [N, Tr(, J)] buffer, summed over the ranks (each
        row written by one rank; a rank without groups writes none)."""
        at = (rows.view(-1, 1) == minibatch.view(1, -1)).int().argmax(1)
        out: dict[str, Tensor | None] = {}
        for k, t in local.items():
            if t is None:
                out[k] = None
                continue
            full = t.new_zeros((len(minibatch),) + tuple(t.shape[1:])).to(self.device)
            if share:
                full[at.to(full.device)] = t.to(full.device)
            dist.all_reduce(full)
            out[k] = full
        return out, at

    def _global_denominator(self, local: Tensor, share: float) -> Tensor:
        total = (local.detach().float() * share).to(self.device)
        dist.all_reduce(total)
        return total

    def _all_finite(self, loss: Tensor) -> bool:
        bad = torch.tensor([0.0 if bool(torch.isfinite(loss)) else 1.0], device=self.device)
        dist.all_reduce(bad)
        return bool(bad.item() == 0.0)

    def _all_ranks(self, real: float, computed: float, padding: float, flops: float,
                   micro: float) -> tuple[float, float, float, float, float, float]:
        sums = torch.tensor([real, computed, padding, flops], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        peaks = torch.tensor([real, micro], dtype=torch.float64, device=self.device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        total, largest = float(sums[0]), float(peaks[0])
        imbalance = largest / (total / self.world) if total > 0 else 1.0
        return total, float(sums[1]), float(sums[2]), float(sums[3]), imbalance, float(peaks[1])

    def _reduce_metrics(self, metrics: dict[str, float], mask: Tensor, share: float) -> dict[str, float]:
        """Every rank's metrics of the minibatch combined by their kinds (records/metrics.py
        ``COMBINE``: sums, extremes, means weighted by this rank's loss-mask tokens or rows)."""
        rows = float((mask.sum(-1) > 0).sum())
        return combine_ranks(metrics, float(mask.sum()), rows, share, self._reduce_floats)

    def _every_rank_routing(self, stats: Any) -> Any:
        """moe/* of the whole batch: every rank's routing counts summed (models/moe.py)."""
        return stats.summed(self._reduce_floats)

    def _reduce_floats(self, values: list[float], op: str) -> list[float]:
        """``values`` summed (``op`` "sum"), or their max / min, over the ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t.tolist()

    # -- full (unsharded) states: collectives every rank joins; the result is rank 0's

    def full_weights(self) -> dict[str, Tensor] | None:
        """The policy's full state dict on CPU under the plain model's names (rank 0; None
        elsewhere): what a rollout engine loads. LoRA adapters are merged into their base
        weights (``lora.merge_state``), so no LoRA tensor reaches an engine."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sd = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        scalings = lora_scalings(self.policy)
        return merge_state(sd, scalings) if scalings else sd

    def full_adapter(self) -> LoraAdapter | None:
        """The policy's LoRA adapters alone, gathered (``full_tensor()``, every rank joins, in
        ``named_parameters`` order) to rank 0's CPU (None elsewhere): what
        ``model.lora.sync = "adapter"`` sends; the frozen base is never gathered."""
        gathered: dict[str, Tensor] = {}
        for name, p in self.policy.named_parameters():
            if ".lora_" in name:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                if self.rank == 0:
                    gathered[name] = full.detach().cpu()
        return adapter_of(self.policy, gathered) if self.rank == 0 else None

    def full_state(self) -> dict[str, Any] | None:
        """Full model and optimizer states in the one-process checkpoint format (rank 0)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        out: dict[str, Any] = {
            "policy": get_model_state_dict(self.policy, options=opts),
            "optimizer": get_optimizer_state_dict(self.policy, self.optimizer, options=opts),
            "critic": None, "critic_optimizer": None}
        if self.critic is not None:
            out["critic"] = get_model_state_dict(self.critic, options=opts)
            out["critic_optimizer"] = get_optimizer_state_dict(self.critic, self.critic_optimizer, options=opts)
        if self.rank != 0:
            return None
        out["optimizer"] = _index_keyed(out["optimizer"], _param_names(self.policy, self.optimizer))
        if self.critic is not None:
            out["critic_optimizer"] = _index_keyed(out["critic_optimizer"],
                                                   _param_names(self.critic, self.critic_optimizer))
        out["scheduler"] = self.scheduler.state_dict() if self.scheduler is not None else None
        out["algorithm"] = self.fn.state_dict()
        out["loss_scale"] = self.loss_scaler.state_dict() if self.loss_scaler is not None else None
        return out

    def load_full_state(self, state: dict[str, Any]) -> None:
        """Load full states (a checkpoint of any number of ranks) into this rank's shards."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.policy, with_tied(state["policy"], self.policy), options=opts)
        set_optimizer_state_dict(self.policy, self.optimizer,
                                 _name_keyed(state["optimizer"], _param_names(self.policy, self.optimizer)),
                                 options=opts)
        if self.critic is not None:
            if state.get("critic") is None or state.get("critic_optimizer") is None:
                raise ValueError("the checkpoint holds no critic (or no critic optimizer) state")
            set_model_state_dict(self.critic, state["critic"], options=opts)
            set_optimizer_state_dict(self.critic, self.critic_optimizer,
                                     _name_keyed(state["critic_optimizer"],
                                                 _param_names(self.critic, self.critic_optimizer)),
                                     options=opts)
        if self.scheduler is not None:
            if state.get("scheduler") is None:
                raise ValueError("the checkpoint holds no scheduler state")
            self.scheduler.load_state_dict(state["scheduler"])
        self.fn.load_state_dict(state.get("algorithm") or {})
        if self.loss_scaler is not None and state.get("loss_scale") is not None:  # float16
            self.loss_scaler.load_state_dict(state["loss_scale"])
