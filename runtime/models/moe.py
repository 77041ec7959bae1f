"""Mixture-of-experts policies: which experts each token was routed to, recorded by the engine
and replayed by the trainer (``rollout.routing_replay``; docs/moe.md).

Shapes: N tokens of one forward (flattened rows), E experts, K = top-k, Y = the model's MoE
layers (its sparse blocks, in order), B rows, L = Tp + Tr columns of a rollout.

A sparse block (transformers 5: Qwen3-MoE, Mixtral) is ``mlp.gate`` -- a top-k router returning
``(router_logits [N, E], top_k_weights [N, K], top_k_index [N, K])`` -- then ``mlp.experts(hidden,
top_k_index, top_k_weights)``.

- Recording (:class:`RoutingTrace`, the HF engine): a forward pre-hook on each block's
  ``experts`` keeps the indices it is given; the engine lays each call's rows out as
  ``routed_experts`` [B, L, Y, K] (int16, -1 where nothing was recorded: padding, and the last
  token of a response, which no forward is fed).
- Replay (:func:`feeding`, the trainer's forwards): a forward hook on each router replaces its
  output by the recorded indices: p = softmax(logits) in float32 (the router's fresh logits, so
  its gradient flows), weights p gathered at the recorded indices, renormalised when the model
  renormalises (Mixtral always, Qwen3-MoE with ``norm_topk_prob``), cast as the model casts. At
  unchanged weights the recorded and the fresh top-k are the same: replay is then bit-identical
  to the plain forward.
- Measuring (:class:`RoutingStats`): per forward, the (token, layer) pairs whose top-k set the
  forward used differs from the engine's (0 under replay), those the router's own top-k would
  change (``drift``), the experts' loads, and the router logits for the load-balancing loss.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers (``mlp.gate`` of each sparse block), in layer order."""
    return [m.gate for m in model.modules() if _is_sparse_block(m)]


def _is_sparse_block(m: nn.Module) -> bool:
    gate, experts = getattr(m, "gate", None), getattr(m, "experts", None)
    return isinstance(gate, nn.Module) and isinstance(experts, nn.Module) and hasattr(gate, "top_k") \
        and isinstance(getattr(gate, "weight", None), Tensor) and type(gate).__name__.endswith("TopKRouter")


def is_moe(model: nn.Module) -> bool:
    return bool(routers(model))


# ------------------------------------------------------------------------------ recording

class RoutingTrace:
    """The experts of every token fed through ``model`` while it is open (a context manager),
    laid out as ``routed_experts`` [B, L, Y, K] by the engine's calls to :meth:`prefill` and
    :meth:`decode` after each forward."""

    def __init__(self, model: nn.Module, rows: int, columns: int):
        blocks = [m for m in model.modules() if _is_sparse_block(m)]
        self.k = int(blocks[0].gate.top_k)
        self.layers = len(blocks)
        self.out = torch.full((rows, columns, self.layers, self.k), -1, dtype=torch.int16)
        self._blocks = blocks
        self._calls: list[Tensor | None] = [None] * self.layers
        self._handles: list[Any] = []

    def __enter__(self) -> "RoutingTrace":
        for i, b in enumerate(self._blocks):
            self._handles.append(b.experts.register_forward_pre_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            self._calls[i] = args[1].detach()  # top_k_index [N, K]
        return hook

    def _take(self) -> Tensor:
        """[N, Y, K] of the last forward."""
        if any(c is None for c in self._calls):
            raise RuntimeError("RoutingTrace: a forward ran without reaching every sparse block")
        got = torch.stack([c for c in self._calls], dim=1).to("cpu", torch.int16)  # type: ignore[misc]
        self._calls = [None] * self.layers
        return got

    def prefill(self, mask: Tensor, group_size: int) -> None:
        """After the prefill of P prompts (mask [P, Tp], left padded), each run G times."""
        P, Tp = mask.shape
        got = self._take().view(P, Tp, self.layers, self.k)
        got = got.masked_fill(~mask.bool().cpu()[:, :, None, None], -1)
        self.out[:, :Tp] = got.repeat_interleave(group_size, dim=0)

    def decode(self, rows: Tensor, column: int) -> None:
        """After a forward of one token for each row in ``rows`` [b], at ``column``."""
        self.out[rows.cpu(), column] = self._take()

    def result(self, columns: int) -> Tensor:
        """[B, columns, Y, K] (cut or padded with -1)."""
        out = self.out[:, :columns]
        if out.shape[1] < columns:
            out = F.pad(out, (0, 0, 0, 0, 0, columns - out.shape[1]), value=-1)
        return out


# ------------------------------------------------------------------------------ replay, measure

@dataclass
class RoutingStats:
    """What the routers did over the forwards it was attached to: the (token, layer) pairs with a
    record, those routed otherwise than recorded (``mismatched``: by the forward as run; ``drift``:
    by the router's own top-k), the experts' counts per layer, the load-balancing loss's terms."""

    recorded: int = 0
    mismatched: int = 0
    drift: int = 0
    counts: list[Tensor] = field(default_factory=list)  # per layer [E] of the experts used
    aux_total: float = 0.0  # the load-balancing loss of each (forward, layer), summed
    aux_calls: int = 0

    def add_counts(self, layer: int, idx: Tensor, experts: int) -> None:
        c = torch.bincount(idx.reshape(-1).long(), minlength=experts).to("cpu", torch.float64)
        while len(self.counts) <= layer:
            self.counts.append(torch.zeros(experts, dtype=torch.float64))
        self.counts[layer] += c

    def summed(self, reduce: Callable[[list[float], str], list[float]]) -> "RoutingStats":
        """The stats of every rank's forwards: each count summed over the ranks by ``reduce(values,
        op)`` (an all-reduce of floats, ``op`` "sum" or "max"; every rank calls this alike), so
        that ``moe/*`` are the whole batch's, not one rank's share (their ratios are of sums)."""
        layers, experts = (int(x) for x in reduce([float(len(self.counts)),
                                                   float(max((len(c) for c in self.counts), default=0))], "max"))
        counts = [c.tolist() + [0.0] * (experts - len(c)) for c in self.counts]
        counts += [[0.0] * experts for _ in range(layers - len(counts))]
        got = reduce([float(self.recorded), float(self.mismatched), float(self.drift), self.aux_total,
                      float(self.aux_calls)] + [x for c in counts for x in c], "sum")
        return RoutingStats(int(got[0]), int(got[1]), int(got[2]),
                            [torch.tensor(got[5 + i * experts:5 + (i + 1) * experts], dtype=torch.float64)
                             for i in range(layers)], got[3], int(got[4]))

    def metrics(self) -> dict[str, float]:
        """``moe/routing_mismatch``, ``moe/router_drift`` (when routing was recorded),
        ``moe/expert_load_max`` (the busiest expert's share times E, the largest over layers; 1 =
        even), ``moe/expert_load_cv`` (std / mean of the experts' counts, mean over layers) and
        ``moe/aux_loss`` (the routers' load-balancing loss, mean over forwards and layers)."""
        out: dict[str, float] = {}
        if self.recorded:
            out["moe/routing_mismatch"] = self.mismatched / self.recorded
            out["moe/router_drift"] = self.drift / self.recorded
        if self.aux_calls:
            out["moe/aux_loss"] = self.aux_total / self.aux_calls
        layers = [c for c in self.counts if float(c.sum()) > 0]
        if layers:
            out["moe/expert_load_max"] = max(float(c.max() / c.mean()) for c in layers)
            out["moe/expert_load_cv"] = sum(float(c.std(unbiased=False) / c.mean()) for c in layers) / len(layers)
        return out


@dataclass
class _Feed:
    """What the routers of one model read during a forward (``feeding``)."""

    replay: bool = False
    stats: RoutingStats | None = None
    aux: bool = False  # keep the routers' probabilities with gradient (the aux loss is trained)
    layers: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # per layer: probs [N, E], picks [E]
    layers_real: Tensor | None = None  # [N] the real tokens of the call ``layers`` are of
    current: Tensor | None = None  # [N, Y, K] recorded routing of the tokens of this body call
    real: Tensor | None = None  # [N] bool: real tokens (not padding) of this body call


def _gate_hook(module: nn.Module, args: tuple, output: Any) -> Any:
    feed: _Feed | None = getattr(module, "_rldsl_feed", None)
    if feed is None or feed.real is None:
        return None
    logits, weights, natural = output
    n = logits.shape[0]
    if feed.real.shape[0] != n:
        raise RuntimeError(f"routing replay: the router saw {n} tokens, the layout {feed.real.shape[0]}")
    layer = module._rldsl_layer  # type: ignore[attr-defined]
    real = feed.real
    idx = natural
    if feed.current is not None:
        rec = feed.current[:, layer].to(device=natural.device, dtype=natural.dtype)  # [N, K]
        has = (rec >= 0).all(-1) & real  # [N]
        differs = (natural.sort(-1).values != rec.sort(-1).values).any(-1) & has
        if feed.replay:
            idx = torch.where(has[:, None], rec, natural)
        if feed.stats is not None:
            feed.stats.recorded += int(has.sum())
            feed.stats.drift += int(differs.sum())
            used = (idx.sort(-1).values != rec.sort(-1).values).any(-1) & has
            feed.stats.mismatched += int(used.sum())
    if feed.stats is not None:
        feed.stats.add_counts(layer, idx[real], int(logits.shape[-1]))
    if feed.aux is not None or feed.stats is not None:
        E = logits.shape[-1]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E]
        if feed.aux is None:
            probs = probs.detach()
        feed.layers.append((probs, torch.bincount(natural[real].reshape(-1), minlength=E)))
    if idx is natural:
        return None
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E]
    w = probs.gather(-1, idx)  # [N, K]
    if getattr(module, "norm_topk_prob", True):
        w = w / w.sum(dim=-1, keepdim=True)
    return logits, w.to(weights.dtype), idx


def _balance_terms(layers: list[tuple[Tensor, Tensor]], real: Tensor) -> Tensor:
    """[N] each token's share of the load-balancing loss E sum_e f_e P_e as transformers'
    ``load_balancing_loss_func`` computes it over the real tokens of all the MoE layers together:
    f_e the share of the router's own top-k picks on expert e over every layer (no gradient), P_e
    the mean router probability; a_t = E sum_e f_e p_te averaged over the layers, 0 on tokens that
    are not real, so the mean of a over the real tokens is that loss."""
    probs = torch.stack([p for p, _ in layers])  # [Y, N, E]
    counts = torch.stack([c for _, c in layers]).sum(0).to(probs.dtype)  # [E]
    Y, _, E = probs.shape
    f = counts / max(int(real.sum()) * Y, 1)  # [E] (sums to K)
    return torch.where(real, E * (probs * f).sum(-1).mean(0), 0.0)


def install(model: nn.Module) -> _Feed:
    """Hook the model's routers (once) and return the feed they read."""
    feed = getattr(model, "_rldsl_moe_feed", None)
    gates = routers(model)
    if feed is not None and all(getattr(g, "_rldsl_feed", None) is feed for g in gates):
        return feed
    feed = _Feed()
    object.__setattr__(model, "_rldsl_moe_feed", feed)
    for i, g in enumerate(gates):
        if getattr(g, "_rldsl_hooked", False) is False:
            g.register_forward_hook(_gate_hook)
            object.__setattr__(g, "_rldsl_hooked", True)
        object.__setattr__(g, "_rldsl_feed", feed)
        object.__setattr__(g, "_rldsl_layer", i)
    return feed


def active(model: nn.Module) -> bool:
    """A forward of ``model`` now runs with its routing fed or measured (:func:`routing`)."""
    feed = getattr(model, "_rldsl_moe_feed", None)
    return feed is not None and (feed.replay or feed.stats is not None or feed.aux)


@contextlib.contextmanager
def routing(model: nn.Module, *, replay: bool, stats: RoutingStats | None,
            aux: bool = False) -> Iterator[None]:
    """The forwards of ``model`` inside replay the recorded routing (``replay``), count into
    ``stats`` (the load-balancing loss too) and, with ``aux``, keep the routers' probabilities
    with gradient for :func:`balance` (each body call through :func:`feeding`)."""
    feed = install(model)
    before = (feed.replay, feed.stats, feed.aux)
    feed.replay, feed.stats, feed.aux = replay, stats, aux
    try:
        yield
    finally:
        feed.replay, feed.stats, feed.aux = before


@contextlib.contextmanager
def feeding(model: nn.Module, recorded: Tensor | None, real: Tensor) -> Iterator[None]:
    """One body call of ``model`` on N tokens: ``recorded`` [N, Y, K] their recorded experts (or
    None), ``real`` [N] which are real tokens. A no-op unless inside :func:`routing`."""
    if not active(model):
        yield
        return
    feed: _Feed = model._rldsl_moe_feed  # type: ignore[attr-defined]
    feed.current = recorded if feed.replay or feed.stats is not None else None
    feed.real = real.reshape(-1).bool()
    feed.layers, feed.layers_real = [], feed.real
    try:
        yield
        if feed.stats is not None and feed.layers and bool(feed.real.any()):
            terms = _balance_terms([(p.detach(), c) for p, c in feed.layers], feed.real)
            feed.stats.aux_total += float(terms[feed.real].mean())
            feed.stats.aux_calls += 1
    finally:
        feed.current, feed.real = None, None
        if not feed.aux:
            feed.layers, feed.layers_real = [], None


def balance(model: nn.Module) -> Tensor | None:
    """[N] the last body call's per-token load-balancing loss, averaged over the MoE layers (with
    gradient); None outside :func:`routing` with ``aux``."""
    feed = getattr(model, "_rldsl_moe_feed", None)
    if feed is None or not feed.aux or not feed.layers:
        return None
    assert feed.layers_real is not None
    return _balance_terms(feed.layers, feed.layers_real)
