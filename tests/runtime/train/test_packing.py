"""Packed forwards (train/packing.py): the layout, and logprobs, entropies, values, losses and
gradients equal to the padded path's for every architecture the suite covers."""
from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import rldsl
from rldsl.runtime.config import RunConfig
from rldsl.runtime.models.loading import backbone
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.logprobs import Forward, LogprobOptions, layout, token_logprobs
from rldsl.runtime.train.packing import packed_rows, packing_supported, shared_packed_rows, shared_packing_supported
from rldsl.runtime.train.throughput import TokenCount
from rldsl.runtime.train.trainer import Trainer
from tiny_archs import ARCHS, SCALED, build

ALGOS = Path(__file__).parents[3] / "algorithms"
PROMPTS = ["1+2=", "33+44=", "(5)*6-7=", "9="]  # different lengths: left padding
LENGTHS = [6, 1, 5, 3, 2, 6, 4, 1]  # response tokens of the 8 rows (2 per prompt)


@pytest.fixture(scope="module")
def models(tokenizer):
    cache: dict[str, nn.Module] = {}

    def get(name: str) -> nn.Module:
        if name not in cache:
            cache[name] = build(name, tokenizer)
        return cache[name]

    return get


def _batch(tokenizer, seed: int = 0):
    """Groups of 2 rows per prompt (left padded) with right-padded random responses of LENGTHS."""
    g = torch.Generator().manual_seed(seed)
    enc = tokenizer([p for p in PROMPTS for _ in range(2)], return_tensors="pt", padding=True)
    B, Tr = len(LENGTHS), max(LENGTHS)
    resp = torch.randint(4, len(tokenizer), (B, Tr), generator=g)
    resp_mask = (torch.arange(Tr)[None] < torch.tensor(LENGTHS)[:, None]).long()
    ids = torch.cat([enc["input_ids"], resp.masked_fill(resp_mask == 0, tokenizer.pad_token_id)], 1)
    mask = torch.cat([enc["attention_mask"], resp_mask], 1)
    return ids, mask, Tr, resp_mask.bool()


def test_layout_restarts_positions_and_keeps_whole_sequences(tokenizer) -> None:
    ids, mask, Tr, m = _batch(tokenizer)
    n = mask.sum(1).tolist()
    rows = packed_rows(ids, mask, Tr, row_tokens=max(n) + 3)
    assert rows is not None
    assert rows.input_ids.shape[1] <= max(n) + 3 and rows.computed_tokens < ids.numel()
    assert sorted(rows.lengths) == sorted(k - 1 for k in n)  # the last token predicts nothing
    # every sequence's real tokens appear in order, positions 0..n-1 in one row
    flat_ids, flat_pos = rows.input_ids.reshape(-1), rows.position_ids.reshape(-1)
    starts = (flat_pos == 0).nonzero().squeeze(1).tolist()
    seqs = [flat_ids[a:b].tolist() for a, b in zip(starts, starts[1:] + [flat_ids.numel()])]
    for b in range(len(n)):
        assert ids[b][mask[b].bool()].tolist()[:-1] in seqs
    # one index per real response token, pointing at the token before it
    assert rows.predictor.numel() == int(m.sum())
    assert torch.equal(flat_ids[rows.predictor], ids.reshape(-1)[rows.target - 1])
    response = torch.zeros_like(mask, dtype=torch.bool)
    response[:, -Tr:] = m
    assert sorted(rows.target.tolist()) == response.reshape(-1).nonzero().squeeze(1).tolist()


def test_layout_refuses_non_contiguous_rows(tokenizer) -> None:
    ids, mask, Tr, _ = _batch(tokenizer)
    holed = mask.clone()
    holed[0, -Tr + 1] = 0  # a hole inside row 0's response
    assert packed_rows(ids, holed, Tr) is None
    empty = mask.clone()
    empty[1, :-Tr] = 0  # row 1 without a prompt: its first response token has no predecessor
    assert packed_rows(ids, empty, Tr) is None


@pytest.mark.parametrize("name", ARCHS + SCALED)
def test_logprobs_entropy_and_gradients_equal_padded(models, tokenizer, name) -> None:
    """float32: values within 1e-5, gradients within 1e-5 of their largest entry (the two paths
    sum in different orders; the padded path's own float32 rounding is of that size)."""
    tol, dtype = 1e-5, torch.float32
    model = models(name)
    if name == "opt":
        pytest.skip("OPT ignores restarting positions: it falls back (tested below)")
    assert packing_supported(backbone(model))
    ids, mask, Tr, m = _batch(tokenizer)
    w = torch.randn(m.shape, generator=torch.Generator().manual_seed(1), dtype=dtype) * m

    def run(packing: bool, row_tokens: int | None):
        model.zero_grad(set_to_none=True)
        count = TokenCount()
        out = token_logprobs(model, Forward(ids, mask, Tr),
                             LogprobOptions(entropy_grad=True, temperature=0.7, packing=packing, packing_row_tokens=row_tokens, count=count))
        logp, ent = out.logprobs, out.entropy
        ((logp * w).sum() + (ent * w).sum()).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return logp, ent, grads, count

    lp0, e0, g0, c0 = run(False, None)
    for row_tokens in (None, 40):  # rows of the longest sequence; rows of several sequences
        lp1, e1, g1, c1 = run(True, row_tokens)
        torch.testing.assert_close(lp1[m], lp0[m], atol=tol, rtol=0)
        torch.testing.assert_close(e1[m], e0[m], atol=tol, rtol=0)
        assert float(lp1.detach()[~m].abs().max()) == 0.0  # padding: zeros
        assert len(g1) == len(g0)
        for a, b in zip(g0, g1):
            torch.testing.assert_close(b, a, atol=tol * float(a.abs().max()), rtol=0)
        assert c1.real == c0.real == int(mask.sum()) - len(mask)  # the last tokens are not fed
        assert c0.computed == ids[:, :-1].numel() and c1.computed < c0.computed
        assert c0.padding == c0.computed - c0.real and c1.padding == c1.computed - c1.real


def test_shared_layout_lays_each_prompt_once_per_row_and_responses_after_it(tokenizer) -> None:
    """Groups of 2 rows per prompt: the prompt once per row holding the group, positions going
    on from it into each response, every response attending to the prompt and itself only."""
    ids, mask, Tr, m = _batch(tokenizer)
    B, T = ids.shape
    prompt_len = mask[:, :-Tr].sum(1).tolist()
    for row_tokens in (None, 12):
        rows = shared_packed_rows(ids, mask, Tr, 2, row_tokens)
        assert rows is not None and rows.allowed is not None
        R, S = rows.input_ids.shape
        plain = packed_rows(ids, mask, Tr, row_tokens)
        assert rows.placed < sum(rows.lengths) and rows.computed_tokens <= plain.computed_tokens
        flat_ids, flat_pos = rows.input_ids.reshape(-1), rows.position_ids.reshape(-1)
        allowed = rows.allowed[:, 0]  # [R, S, S]
        assert rows.predictor.numel() == int(m.sum())
        # each predictor holds the token before its target, at the position before the target's
        assert torch.equal(flat_ids[rows.predictor], ids.reshape(-1)[rows.target - 1])
        target_pos = torch.tensor([prompt_len[int(t) // T] + int(t) % T - (T - Tr) for t in rows.target])
        assert torch.equal(flat_pos[rows.predictor], target_pos - 1)
        # what a response's last predictor attends to is its prompt, then its own tokens, in order
        for b in range(B):
            idx = (rows.out // Tr == b).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            last = int(rows.predictor[idx[-1]])
            r, q = divmod(last, S)
            seen = rows.input_ids[r][allowed[r, q]].tolist()
            assert seen == ids[b][mask[b].bool()].tolist()[:-1]
        # rows never exceed the cap unless one prompt + response does on its own
        cap = row_tokens or max(rows.lengths)
        assert S <= max(cap, max(prompt_len) + max(LENGTHS) - 1)
    assert shared_packed_rows(ids, mask, Tr, None) is None  # no groups
    other = ids.clone()
    other[1, -Tr - 1] = (other[1, -Tr - 1] + 1) % len(tokenizer)  # row 1's prompt differs from row 0's
    assert shared_packed_rows(other, mask, Tr, 2) is None


def test_shared_rows_mask_is_the_same_written_whole_or_by_blocks(tokenizer, monkeypatch) -> None:
    """Large masks are written block by block, small ones compared whole: the same mask, and
    each query sees exactly its prompt and its own response so far."""
    from rldsl.runtime.train import packing
    ids, mask, Tr, _ = _batch(tokenizer)
    whole = shared_packed_rows(ids, mask, Tr, 2, 20)
    monkeypatch.setattr(packing, "_WHOLE_MASK_ELEMENTS", 0)
    blocks = shared_packed_rows(ids, mask, Tr, 2, 20)
    assert torch.equal(whole.allowed, blocks.allowed) and torch.equal(whole.input_ids, blocks.input_ids)
    allowed = whole.allowed[:, 0]
    pos = whole.position_ids
    # a query never sees a later key, and sees keys of positions 0 .. its own exactly once each
    assert not bool((allowed & ~torch.ones_like(allowed[0]).tril()).any())
    for r in range(allowed.shape[0]):
        for q in range(allowed.shape[1]):
            assert sorted(pos[r][allowed[r, q]].tolist()) == list(range(int(pos[r, q]) + 1))


@pytest.mark.parametrize("name", ARCHS + SCALED + ("llama-eager",))
def test_shared_prompt_rows_equal_padded(models, tokenizer, name) -> None:
    """Shared-prompt rows (groups of 2 rows per prompt): logprobs, entropies and gradients
    within 1e-5 of the padded forward's for every architecture that takes them; the others
    (sliding windows) take the plain layout, still equal. ``llama-eager``: eager attention,
    which takes the tree as an additive mask (sdpa: a boolean one)."""
    tol = 1e-5
    if name == "llama-eager":
        model = copy.deepcopy(models("llama"))
        model.set_attn_implementation("eager")
        assert backbone(model).config._attn_implementation == "eager"
    else:
        model = models(name)
    ids, mask, Tr, m = _batch(tokenizer)
    w = torch.randn(m.shape, generator=torch.Generator().manual_seed(1)) * m
    takes = shared_packing_supported(backbone(model))
    # gemma: sliding windows, which a custom mask would bypass; OPT takes them (its own mask,
    # not restarting positions, keeps the responses apart)
    assert takes == (name not in ("gemma2", "gemma3")), name

    def run(packing: bool, row_tokens: int | None):
        model.zero_grad(set_to_none=True)
        count = TokenCount()
        out = token_logprobs(model, Forward(ids, mask, Tr, group_size=2),
                             LogprobOptions(entropy_grad=True, temperature=0.7, packing=packing, packing_row_tokens=row_tokens, count=count))
        logp, ent = out.logprobs, out.entropy
        ((logp * w).sum() + (ent * w).sum()).backward()
        return logp, ent, [p.grad.clone() for p in model.parameters() if p.grad is not None], count

    lp0, e0, g0, c0 = run(False, None)
    for row_tokens in (None, 20):  # both push fewer tokens than the padded shared-prompt forward
        lp1, e1, g1, c1 = run(True, row_tokens)
        torch.testing.assert_close(lp1[m], lp0[m], atol=tol, rtol=0)
        torch.testing.assert_close(e1[m], e0[m], atol=tol, rtol=0)
        assert float(lp1.detach()[~m].abs().max()) == 0.0
        scale = max(float(a.abs().max()) for a in g0)
        for a, b in zip(g0, g1, strict=True):  # (a key bias's gradient is 0 up to rounding: OPT)
            torch.testing.assert_close(b, a, atol=tol * max(float(a.abs().max()), 1e-3 * scale), rtol=0)
        assert c1.real == c0.real == int(mask.sum()) - len(mask)
        if takes:  # each prompt once per row holding its group: fewer than the plain layout
            shared = shared_packed_rows(ids, mask, Tr, 2, row_tokens)
            assert c1.computed == shared.computed_tokens < packed_rows(ids, mask, Tr, row_tokens).computed_tokens
            assert c1.padding == shared.filler


def test_architecture_that_ignores_positions_falls_back_once(models, tokenizer) -> None:
    model = copy.deepcopy(models("opt"))  # a model not checked yet (the checks are kept per model)
    ids, mask, Tr, m = _batch(tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            lp1 = token_logprobs(model, Forward(ids, mask, Tr), LogprobOptions(packing=True)).logprobs
            token_logprobs(model, Forward(ids, mask, Tr), LogprobOptions(packing=True))
            lp0 = token_logprobs(model, Forward(ids, mask, Tr)).logprobs
    said = [w for w in caught if "train.packing" in str(w.message)]
    assert len(said) == 1 and "OPTModel" in str(said[0].message)
    torch.testing.assert_close(lp1[m], lp0[m], atol=0, rtol=0)


def test_one_function_chooses_the_layout_from_the_record_and_options(tiny_model, tokenizer) -> None:
    """``layout``: packed when packing is asked and pushes fewer tokens, the shared prompt for
    groups that share one (and no compiled body), padded otherwise and whenever the result needs
    the [B, Tr] layout (gathered ids, hidden states)."""
    enc = tokenizer(["1+2=", "1+2=", "33+44=", "33+44="], return_tensors="pt", padding=True)
    resp = torch.full((4, 6), 5)
    ids = torch.cat([enc["input_ids"], resp], 1)
    mask = torch.cat([enc["attention_mask"], (torch.arange(6)[None] < torch.tensor([[6], [1], [2], [1]])).long()], 1)
    grouped, single = Forward(ids, mask, 6, group_size=2), Forward(ids, mask, 6)
    gather = dataclasses.replace(grouped, gather_ids=torch.zeros(4, 6, 1, dtype=torch.long))

    def chosen(fwd, **opts):
        return layout(tiny_model, fwd, LogprobOptions(**opts)).func.__name__

    assert chosen(single) == "_padded" and chosen(grouped) == "_shared"
    assert chosen(single, packing=True) == chosen(grouped, packing=True) == "_packed"
    assert chosen(grouped, body=backbone(tiny_model)) == "_padded"  # no KV cache through a compiled body
    assert chosen(grouped, packing=True, hidden=True) == "_shared"  # hidden states keep the [B, Tr] layout
    assert chosen(gather, packing=True) == "_packed"  # gathered ids are taken at the packed tokens' rows


def test_shared_prompt_path_kept_when_it_pushes_fewer_tokens(tiny_model, tokenizer) -> None:
    """Long shared prompts, short answers: the shared-prompt forward pushes fewer tokens than
    packing; it is kept and counted."""
    enc = tokenizer(["1+2+3+4+5+6+7+8+9="] * 4, return_tensors="pt", padding=True)
    resp = torch.full((4, 2), 5)
    ids = torch.cat([enc["input_ids"], resp], 1)
    mask = torch.cat([enc["attention_mask"], torch.ones(4, 2, dtype=torch.long)], 1)
    counts = {}
    for packing in (False, True):
        counts[packing] = TokenCount()
        with torch.no_grad():
            token_logprobs(tiny_model, Forward(ids, mask, 2, group_size=4),
                           LogprobOptions(packing=packing, count=counts[packing]))
    Tp = enc["input_ids"].shape[1]
    assert counts[True].computed == counts[False].computed == Tp + 4 * 1


def _long_tailed(batch, pad_id: int):
    """The batch with most answers cut short (a few at the limit): what packing is for."""
    B, Tr = batch.response_ids.shape
    g = torch.Generator().manual_seed(0)
    lengths = torch.where(torch.rand(B, generator=g) < 0.2, Tr, torch.randint(1, 6, (B,), generator=g))
    keep = torch.arange(Tr)[None] < lengths[:, None]  # [B, Tr]
    return dataclasses.replace(
        batch, response_ids=batch.response_ids.masked_fill(~keep, pad_id),
        response_mask=batch.response_mask * keep, logprobs=batch.logprobs * keep,
        finish_reason=["length" if int(n) == Tr else "stop" for n in lengths])


def _trainer(spec: str, model, packing: bool, budget: int | None, reference_off=None):
    cfg = RunConfig()
    cfg.train.ppo_epochs = 2  # old logprobs recomputed, two steps
    cfg.train.minibatches = 2
    cfg.train.packing = packing
    cfg.train.packing_row_tokens = 30
    cfg.train.max_tokens_per_microbatch = budget
    cfg.train.skip_zero_advantage = False
    fn = rldsl.compile(rldsl.load(str(ALGOS / f"{spec}.rl")), compile=False)
    t = Trainer.from_config(cfg, fn, model, reference_off=reference_off)
    t.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    if t.critic is not None:
        torch.manual_seed(1)
        torch.nn.init.normal_(t.critic.head.weight, std=0.1)
        t.critic_optimizer = torch.optim.SGD(t.critic.parameters(), lr=0.1)
    return t


@pytest.mark.parametrize("spec,budget,lora", [("grpo", None, False), ("ppo", None, False),
                                              ("scalerl", 60, False), ("lite_ppo", 60, False),
                                              ("grpo", None, True)])
def test_packed_update_equals_padded(tiny_model, tokenizer, spec, budget, lora) -> None:
    """seq_mean_token_mean + a reference KL (grpo), a critic (ppo), prompt_mean (scalerl) and
    token_mean (lite_ppo) under a token budget, LoRA with the reference as the adapters-off
    policy: same old/ref logprobs, values, advantages, losses, gradients and parameters,
    packed or padded."""
    batch = _long_tailed(HFEngine(tiny_model, tokenizer).generate(
        PROMPTS, SamplingParams(n=4, temperature=1.5, max_new_tokens=20, min_new_tokens=20, seed=3)),
        tokenizer.pad_token_id)
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(batch))])
    results = []
    for packing in (False, True):
        model, off = copy.deepcopy(tiny_model), None
        if lora:
            pytest.importorskip("peft")
            from rldsl.runtime.models.lora import adapters_disabled, apply_lora
            torch.manual_seed(0)
            model, wrapped = apply_lora(model, rank=4, alpha=8, dropout=0.0, target_modules="all-linear")
            off = lambda w=wrapped: adapters_disabled(w)  # noqa: E731
        t = _trainer(spec, model, packing, budget, off)
        est = t.estimate(batch, rewards)
        metrics = t.update(est, torch.Generator().manual_seed(0))
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        if t.critic is not None:
            grads += [p.grad.clone() for p in t.critic.parameters() if p.grad is not None]
        results.append((est, metrics, grads, [p.detach().clone() for p in model.parameters()]))
    (e0, m0, g0, p0), (e1, m1, g1, p1) = results
    mk = e0.mask > 0
    for name in ("old_logprobs", "ref_logprobs", "old_values", "advantages"):
        a, b = getattr(e0, name), getattr(e1, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(b[mk], a[mk], atol=1e-5, rtol=0, msg=name)
    for k in ("loss", "pg_loss", "value_loss", "grad_norm", "entropy", "kl"):
        if k in m0:
            assert m1[k] == pytest.approx(m0[k], abs=1e-5), k
    assert m1["perf/update_computed_tokens"] < m0["perf/update_computed_tokens"]
    assert m1["perf/update_tokens"] == m0["perf/update_tokens"]
    assert m1["perf/update_padding_tokens"] < m0["perf/update_padding_tokens"]
    assert len(g0) == len(g1) > 0
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    for a, b in zip(p0, p1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_packing_taken_when_checkpointing_rules_out_the_shared_prompt(tiny_model, tokenizer) -> None:
    """Under gradient checkpointing the shared-prompt forward is not tried (no cache through a
    checkpointed layer): packing must not step aside for it."""
    from rldsl.runtime.models.loading import enable_gradient_checkpointing
    model = copy.deepcopy(tiny_model)
    enable_gradient_checkpointing(model)
    model.train()
    enc = tokenizer(["1+2+3+4+5+6+7+8+9="] * 4, return_tensors="pt", padding=True)
    resp_mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 0]])
    ids = torch.cat([enc["input_ids"], torch.full((4, 2), 5)], 1)
    mask = torch.cat([enc["attention_mask"], resp_mask], 1)
    count = TokenCount()
    lp = token_logprobs(model, Forward(ids, mask, 2, group_size=4),
                        LogprobOptions(packing=True, packing_row_tokens=100, count=count)).logprobs
    prompt = int(enc["attention_mask"][0].sum())
    # one packed row, the prompt once (shared-prompt rows), then row 0's first response token
    assert count.computed == prompt + 1 and count.padding == 0 and count.real == 4 * prompt + 1
    lp.sum().backward()
