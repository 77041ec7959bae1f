"""The mixture-of-experts tests' shared helpers (tests/runtime/models/test_moe.py and the vLLM
engine's tests/runtime/rollout/engines/test_vllm_moe.py): the trainer's logprobs with the recorded
routing, an Adam step that moves the routers, and the logprobs of each row run alone under its
recorded experts."""
from __future__ import annotations

import torch

from rldsl.runtime.batch import RolloutBatch, model_inputs
from rldsl.runtime.models import moe
from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs


def routed_logprobs(model, batch: RolloutBatch, replay: bool, **kw) -> tuple[torch.Tensor, dict[str, float]]:
    """The trainer's logprobs of the batch [B, Tr] and its ``moe/*`` metrics, the recorded routing
    replayed (``replay``) or only measured."""
    ids, attn, _ = model_inputs(batch)
    stats = moe.RoutingStats()
    with torch.no_grad(), moe.routing(model, replay=replay, stats=stats):
        lp = token_logprobs(model, Forward(ids, attn, batch.response_ids.shape[1], group_size=batch.group_size,
                                           routing=batch.routed_experts), LogprobOptions(**kw)).logprobs
    return lp, stats.metrics()


def move(model, batch: RolloutBatch, lr: float = 1e-2) -> None:
    """One Adam step on the batch's logprobs: the routers move."""
    ids, attn, _ = model_inputs(batch)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    lp = token_logprobs(model, Forward(ids, attn, batch.response_ids.shape[1])).logprobs
    (-(lp * batch.response_mask).sum()).backward()
    opt.step()
    model.zero_grad()


def forced_logprobs(model, batch: RolloutBatch) -> torch.Tensor:
    """The reference: each row alone, unpadded, its routers' forwards replaced by ones that return
    the recorded experts (no code of models/moe.py's layout or hooks)."""
    ids, attn, _ = model_inputs(batch)
    B, T = ids.shape
    Tr = batch.response_ids.shape[1]
    out = torch.zeros(B, Tr)
    gates = [layer.mlp.gate for layer in model.model.layers]
    originals = [g.forward for g in gates]
    try:
        for b in range(B):
            real = attn[b].bool()
            first = int(real.long().argmax())
            n = int(real.sum())
            rec = batch.routed_experts[b, first:first + n - 1].long()  # [n - 1, Y, K]
            for i, g in enumerate(gates):
                def forward(h, g=g, i=i, rec=rec):
                    logits = torch.nn.functional.linear(h.reshape(-1, g.hidden_dim), g.weight)
                    p = torch.softmax(logits.float(), dim=-1)
                    has = (rec[:, i] >= 0).all(-1, keepdim=True)
                    idx = torch.where(has, rec[:, i], torch.topk(p, g.top_k, dim=-1).indices)
                    w = p.gather(-1, idx)
                    return logits, w / w.sum(-1, keepdim=True), idx
                g.forward = forward
            with torch.no_grad():
                logits = model(ids[b:b + 1, first:first + n - 1]).logits[0].float()  # [n - 1, V]
            lp = torch.log_softmax(logits, -1).gather(-1, ids[b, first + 1:first + n, None]).squeeze(-1)
            k = n - (T - Tr - first)  # real response tokens
            out[b, :k] = lp[-k:]
    finally:
        for g, f in zip(gates, originals):
            g.forward = f
    return out


def check_episode_routing(model, batch: RolloutBatch, logprob_tol: float = 1e-5,
                          observed_rows: int | None = None) -> None:
    """Every token fed is recorded (padding and each row's last token are not), laid out as the
    trainer's columns; at the engine's weights the trainer routes as recorded (its logprobs the
    engine's to ``logprob_tol``); after an Adam step (``model`` moves) the replayed logprobs
    (padded, packed) equal the rows run alone under the recorded experts. ``observed_rows``: how
    many rows at least went on past their first turn (default: every row)."""
    ids, attn, _ = model_inputs(batch)
    r = batch.routed_experts
    assert r is not None and r.shape[:2] == ids.shape and r.dtype == torch.int16
    observed = (batch.response_attention - batch.response_mask).sum(1)
    # the environment's tokens between the turns, in every row (or observed_rows of them)
    assert int((observed > 0).sum()) >= (len(batch) if observed_rows is None else observed_rows), observed
    fed = attn.bool().clone()
    Tp = batch.prompt_ids.shape[1]
    fed[torch.arange(len(batch)), Tp + batch.response_attention.sum(1) - 1] = False  # the last token
    assert bool((r >= 0).all(-1).all(-1).eq(fed).all())
    plain, metrics = routed_logprobs(model, batch, replay=False)
    valid = batch.response_mask.bool()
    assert metrics["moe/routing_mismatch"] == 0.0, metrics
    assert (plain - batch.logprobs)[valid].abs().max() < logprob_tol
    move(model, batch)
    plain, before = routed_logprobs(model, batch, replay=False)
    replayed, after = routed_logprobs(model, batch, replay=True)
    packed, _ = routed_logprobs(model, batch, replay=True, packing=True)
    assert before["moe/routing_mismatch"] > 0.1 and after["moe/routing_mismatch"] == 0.0
    forced = forced_logprobs(model, batch)
    assert (replayed - forced)[valid].abs().max() < 1e-6 and (packed - forced)[valid].abs().max() < 1e-6
    assert (plain - forced)[valid].abs().max() > 1e-3
