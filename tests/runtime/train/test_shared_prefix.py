"""The speed paths of the runtime give what the plain paths give (bench/README.md measures them).

- ``token_logprobs(..., group_size=G)`` runs each group's prompt once: same values and
  gradients as the full forward, and the full forward whenever the shortcut is not exact;
- ``HFEngine``'s KV-cached sampler: same distribution as ``generate`` (same first tokens
  for a seed, same greedy output), HF's top-p filter, and the ``generate`` fallback;
- ``Trainer``: with one update per rollout the old-logprob forward is skipped, and the
  update equals the one with the recomputed old logprobs.
"""
from __future__ import annotations

import copy

import pytest
import torch

import rldsl
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine, _top_p
from rldsl.runtime.train.logprobs import Forward, _shared_prompt_hidden, token_logprobs
from rldsl.runtime.train.trainer import Trainer, _has_dropout

PROMPTS = ["1+2=", "33+44=", "(5)*6-7=", "9="]  # different lengths: left padding


def _batch(model, tokenizer, *, n=3, seed=0, max_new_tokens=6, temperature=1.5):
    batch = HFEngine(model, tokenizer).generate(
        PROMPTS, SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed))
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    return batch, ids, mask


def _logp_and_grads(model, ids, mask, Tr, weights, group_size=None):
    model.zero_grad()
    out = token_logprobs(model, Forward(ids, mask, Tr, group_size=group_size))
    logp, ent = out.logprobs, out.entropy
    (logp * weights).sum().backward()
    return logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_shared_prompt_forward_equals_full_forward(tiny_model, tokenizer, max_new_tokens) -> None:
    G = 3
    batch, ids, mask = _batch(tiny_model, tokenizer, n=G, max_new_tokens=max_new_tokens)
    Tr = batch.response_ids.shape[1]
    m = batch.response_mask.float()
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(0)) * m
    with torch.no_grad():
        assert _shared_prompt_hidden(tiny_model, ids, mask, Tr, G) is not None  # the shortcut is taken
    ref, ref_ent, ref_grads = _logp_and_grads(tiny_model, ids, mask, Tr, weights)
    got, ent, grads = _logp_and_grads(tiny_model, ids, mask, Tr, weights, group_size=G)
    torch.testing.assert_close(got * m, ref * m, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent * m, ref_ent * m, atol=1e-6, rtol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_groups_with_different_prompts_run_in_full(tiny_model, tokenizer) -> None:
    batch, ids, mask = _batch(tiny_model, tokenizer, n=3)
    Tr = batch.response_ids.shape[1]
    with torch.no_grad():
        assert _shared_prompt_hidden(tiny_model, ids, mask, Tr, 2) is None  # groups of 2 straddle prompts
        assert _shared_prompt_hidden(tiny_model, ids, mask, Tr, 5) is None  # 12 rows: not groups of 5
        a = token_logprobs(tiny_model, Forward(ids, mask, Tr, group_size=2)).logprobs
        b = token_logprobs(tiny_model, Forward(ids, mask, Tr)).logprobs
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_shared_prompt_forward_absolute_positions(tokenizer) -> None:
    """GPT-2 (learned positions, its own cache layout): same values as the full forward."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    batch, ids, mask = _batch(model, tokenizer, n=4, seed=3)
    Tr = batch.response_ids.shape[1]
    m = batch.response_mask.float()
    with torch.no_grad():
        a = token_logprobs(model, Forward(ids, mask, Tr, group_size=4)).logprobs
        b = token_logprobs(model, Forward(ids, mask, Tr)).logprobs
    torch.testing.assert_close(a * m, b * m, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- engine

def _hf_engine(model, tokenizer) -> HFEngine:
    engine = HFEngine(model, tokenizer)
    engine._sampler_ok = False  # force model.generate
    return engine


def test_sampler_first_tokens_and_greedy_equal_generate(tiny_model, tokenizer) -> None:
    ours, hf = HFEngine(tiny_model, tokenizer), _hf_engine(tiny_model, tokenizer)
    assert ours._cached_sampling_ok()
    params = SamplingParams(n=5, temperature=1.3, max_new_tokens=6, seed=11)
    a, b = ours.generate(PROMPTS, params), hf.generate(PROMPTS, params)
    # the same RNG draws on the same probabilities: identical until a row finishes (ours then
    # drops finished rows from the batch, so later draws go to other rows)
    assert torch.equal(a.response_ids[:, 0], b.response_ids[:, 0])
    torch.testing.assert_close(a.logprobs[:, 0], b.logprobs[:, 0], atol=1e-6, rtol=0)
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    a, b = ours.generate(PROMPTS, greedy), hf.generate(PROMPTS, greedy)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert a.completions == b.completions and a.finish_reason == b.finish_reason
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-6, rtol=0)


def test_sampler_matches_generate_in_distribution(tiny_model, tokenizer) -> None:
    """Token frequencies of the second position agree (it is drawn after rows start finishing)."""
    params = lambda seed: SamplingParams(n=64, temperature=2.0, max_new_tokens=3, seed=seed)  # noqa: E731
    V = tiny_model.config.vocab_size
    counts = {}
    for name, engine in (("ours", HFEngine(tiny_model, tokenizer)), ("hf", _hf_engine(tiny_model, tokenizer))):
        c = torch.zeros(V)
        for seed in range(6):
            r = engine.generate(["12+34="], params(seed))
            keep = r.response_mask[:, 1] > 0
            c += torch.bincount(r.response_ids[keep, 1], minlength=V).float()
        counts[name] = c / c.sum()
    assert (counts["ours"] - counts["hf"]).abs().sum() < 0.15  # total variation x 2, 384 samples each


def test_generate_fallback_layout(tiny_model, tokenizer) -> None:
    batch = _hf_engine(tiny_model, tokenizer).generate(
        PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=0))
    assert batch.response_ids.shape[0] == 8 and batch.group_size == 2
    assert (batch.response_ids[batch.response_mask == 0] == tokenizer.pad_token_id).all()
    assert batch.response_mask[:, 0].all()


def test_top_p_matches_transformers() -> None:
    from transformers.generation.logits_process import TopPLogitsWarper

    z = torch.randn(6, 30, generator=torch.Generator().manual_seed(0)) * 3
    for p in (0.05, 0.5, 0.9, 0.999):
        assert torch.equal(_top_p(z, p), TopPLogitsWarper(p)(None, z.clone()))


# ----------------------------------------------------------------------------- trainer

SPEC = """algorithm t extends dapo
  "x"
  normalizer    group_std(eps=1e-4)
  sampling      once
  shaping       none
"""


def _trainer(model, **kw) -> Trainer:
    fn = rldsl.compile(rldsl.loads(SPEC, "t.rl"), compile=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Trainer(fn, model, optimizer=opt, skip_zero_advantage=False, **kw)


def test_on_policy_update_skips_old_forward_and_equals_recompute(tiny_model, tokenizer) -> None:
    G = 4
    batch, _, _ = _batch(tiny_model, tokenizer, n=G, seed=5)
    rewards = torch.rand(len(batch), generator=torch.Generator().manual_seed(1)).round()
    fast_model, slow_model = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    fast, slow = _trainer(fast_model), _trainer(slow_model)
    slow._old_is_current = lambda: False  # type: ignore[method-assign]  # the recompute path
    assert fast._old_is_current()
    tb_fast, tb_slow = fast.estimate(batch, rewards), slow.estimate(batch, rewards)
    assert tb_fast.old_logprobs is None and tb_slow.old_logprobs is not None
    torch.testing.assert_close(tb_fast.advantages, tb_slow.advantages, atol=0, rtol=0)
    m_fast, m_slow = fast.update(tb_fast), slow.update(tb_slow)
    for k in ("loss", "grad_norm", "ratio_mean", "clip_fraction"):
        assert m_fast[k] == pytest.approx(m_slow[k], abs=1e-6), k
    assert m_fast["ratio_mean"] == 1.0
    # the mismatch metric moves from estimate() to update()
    assert m_fast["rollout_logprob_diff"] == pytest.approx(tb_slow.metrics["rollout_logprob_diff"], abs=1e-6)
    for (name, p), q in zip(fast_model.named_parameters(), slow_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)


def test_old_logprobs_recomputed_when_not_exactly_on_policy(tiny_model) -> None:
    assert not _trainer(tiny_model, ppo_epochs=2)._old_is_current()
    assert not _trainer(tiny_model, minibatches=2)._old_is_current()
    dropped = copy.deepcopy(tiny_model)
    dropped.config.attention_dropout = 0.1
    assert _has_dropout(dropped) and not _trainer(dropped)._old_is_current()
    assert not _has_dropout(tiny_model)


def test_an_advantage_formula_reading_old_logprobs_gets_them_on_policy(tiny_model, tokenizer) -> None:
    """estimate() runs before the update: a shaping formula reading old_seq_logp needs the old
    forward even where the update alone would skip it (it failed, 'needs old_logprobs=')."""
    spec = SPEC.replace("  shaping       none\n", "  define lik\n    r = r + 0.1 * old_seq_logp / L\n  end\n"
                                                  "  shaping       lik\n")
    fn = rldsl.compile(rldsl.loads(spec, "t.rl"), compile=False)
    tr = Trainer(fn, tiny_model, optimizer=torch.optim.AdamW(tiny_model.parameters(), lr=1e-2),
                 skip_zero_advantage=False)
    assert not tr._old_is_current()
    batch, _, _ = _batch(tiny_model, tokenizer, n=4, seed=5)
    tb = tr.estimate(batch, torch.ones(len(batch)))
    assert tb.old_logprobs is not None and torch.isfinite(tb.advantages).all()


# ----------------------------------------------------------------------------- LM head

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_head_matches_autograd_with_bias(dtype, entropy_grad) -> None:
    """_ChunkedHead (token_logprobs' LM head) against plain autograd: bias, bf16, ragged chunks."""
    from rldsl.runtime.train.logprobs import _ChunkedHead, Forward, LogitTransform

    g = torch.Generator().manual_seed(0)
    N, H, V = 37, 16, 50
    h0 = torch.randn(N, H, generator=g).to(dtype)
    w0 = (torch.randn(V, H, generator=g) / 4).to(dtype)
    b0 = torch.randn(V, generator=g).to(dtype)
    y = torch.randint(0, V, (N,), generator=g)
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def run(fn):
        h, w, b = (t.clone().requires_grad_() for t in (h0, w0, b0))
        lp, ent = fn(h, w, b)
        loss = (lp * gl).sum() + ((ent * ge).sum() if entropy_grad else 0)
        loss.backward()
        return lp.detach(), ent.detach(), h.grad.float(), w.grad.float(), b.grad.float()

    def reference(h, w, b):
        logp_all = torch.log_softmax(torch.nn.functional.linear(h, w, b).float(), -1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, y[:, None]).squeeze(-1), ent if entropy_grad else ent.detach()

    ref = run(reference)
    got = run(lambda h, w, b: _ChunkedHead.apply(h, w, b, y, 8, True, entropy_grad,
                                                      LogitTransform())[:2])
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, a, r in zip(("logprob", "entropy", "grad_h", "grad_w", "grad_b"), got, ref):
        torch.testing.assert_close(a, r, msg=name, **tol)
