"""token_logprobs at a sampling temperature, through each architecture's own logit transform.

The training-side logprobs must be those of the distribution the engine sampled from:
softmax(z / T), z the logits of the model's own forward (Gemma's soft cap, Cohere's and
Granite's logit scales included). References: the full ``model(...).logits`` divided by T,
and hand-computed distributions of a two-token vocabulary.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.batch import position_ids_from_mask
from rldsl.runtime.train.logprobs import _ChunkedHead, Forward, LogitTransform, LogprobOptions, token_logprobs
from rldsl.runtime.rollout.engines.base import SamplingParams
from tiny_archs import ARCHS, SCALED, build

TEMPERATURES = (0.5, 0.7, 1.0, 1.3)
PROMPTS = ["1+2=", "33+44=", "(5)*6-7=", "9="]  # different lengths: left padding


@pytest.fixture(scope="module")
def models(tokenizer):
    cache: dict[str, nn.Module] = {}

    def get(name: str) -> nn.Module:
        if name not in cache:
            cache[name] = build(name, tokenizer)
        return cache[name]

    return get


def _batch(tokenizer, seed: int = 0):
    """A left-padded prompt batch with right-padded random responses (rows of 3-6 tokens)."""
    g = torch.Generator().manual_seed(seed)
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    B, Tr = len(PROMPTS), 6
    resp = torch.randint(4, len(tokenizer), (B, Tr), generator=g)
    resp_mask = (torch.arange(Tr)[None] < torch.tensor([[6], [3], [5], [4]])).long()
    ids = torch.cat([enc["input_ids"], resp.masked_fill(resp_mask == 0, tokenizer.pad_token_id)], 1)
    mask = torch.cat([enc["attention_mask"], resp_mask], 1)
    return ids, mask, Tr, resp_mask.float()


def _reference(model, ids, mask, Tr, T):
    """log_softmax(model(x).logits / T) gathered, and -sum p log p at T: [B, Tr] each."""
    logits = model(input_ids=ids, attention_mask=mask,
                   position_ids=position_ids_from_mask(mask)).logits.float()[:, -Tr - 1:-1]
    logp_all = torch.log_softmax(logits / T, dim=-1)  # [B, Tr, V]
    logp = logp_all.gather(-1, ids[:, -Tr:, None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("arch", ARCHS + SCALED)
@pytest.mark.parametrize("T", TEMPERATURES)
def test_logprobs_and_entropy_equal_the_models_logits_at_temperature(arch, T, models, tokenizer):
    model = models(arch)
    ids, mask, Tr, m = _batch(tokenizer)
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(1)) * m

    model.zero_grad()
    ref_logp, ref_ent = _reference(model, ids, mask, Tr, T)
    ((ref_logp + 0.3 * ref_ent) * weights).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    out = token_logprobs(model, Forward(ids, mask, Tr), LogprobOptions(temperature=T, entropy_grad=True, chunk_size=5))
    logp, ent = out.logprobs, out.entropy
    ((logp + 0.3 * ent) * weights).sum().backward()

    torch.testing.assert_close(logp * m, ref_logp.detach() * m, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent * m, ref_ent.detach() * m, atol=1e-5, rtol=0)
    params = dict(model.named_parameters())
    for name, g in ref_grads.items():  # fp32 rounding relative to the largest entry
        err = (params[name].grad - g).abs().max().item()
        assert err <= 1e-5 * max(1.0, g.abs().max().item()), (name, err)
    if T != 1.0:  # the temperature changes the values: a forgotten 1/T would fail above
        assert (logp - token_logprobs(model, Forward(ids, mask, Tr)).logprobs).mul(m).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "cohere", "granite"])
def test_the_transform_matters_for_these_models(arch, models, tokenizer):
    """The plain linear head alone would be wrong by far more than the tolerance."""
    model = models(arch)
    ids, mask, Tr, m = _batch(tokenizer)
    with torch.no_grad():
        h = model.get_decoder()(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
                                position_ids=position_ids_from_mask(mask)[:, :-1]).last_hidden_state
        plain = torch.log_softmax(model.get_output_embeddings()(h[:, -Tr:]).float(), -1)
        plain = plain.gather(-1, ids[:, -Tr:, None])[..., 0]
        logp = token_logprobs(model, Forward(ids, mask, Tr)).logprobs
    assert ((logp - plain) * m).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # the cached sampler; model.generate
@pytest.mark.parametrize("T", TEMPERATURES)
def test_equal_to_the_engines_logprobs_at_its_temperature(arch, T, models, tokenizer):
    model = models(arch)
    batch = HFEngine(model, tokenizer).generate(
        PROMPTS, SamplingParams(n=3, temperature=T, max_new_tokens=6, seed=3))
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    with torch.no_grad():
        logp = token_logprobs(model, Forward(ids, mask, batch.response_ids.shape[1], group_size=3),
                              LogprobOptions(temperature=T)).logprobs
    m = batch.response_mask.float()
    torch.testing.assert_close(logp * m, batch.logprobs, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- by hand

class _TwoTokenModel(nn.Module):
    """Hidden state [1] everywhere and a head with logits [0, a]: a known distribution."""

    base_model_prefix = "model"

    def __init__(self, a: float, **config: float):
        super().__init__()
        self.config = SimpleNamespace(**config)
        self.model = _Constant()
        self.lm_head = nn.Linear(1, 2, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.tensor([[0.0], [a]]))

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


class _Constant(nn.Module):
    def forward(self, input_ids, **_):
        return SimpleNamespace(last_hidden_state=torch.ones(*input_ids.shape, 1))


def _two_token(z1: float) -> tuple[float, float]:
    """log p(token 1) and the entropy of softmax([0, z1])."""
    p1 = 1 / (1 + math.exp(-z1))
    return math.log(p1), -(p1 * math.log(p1) + (1 - p1) * math.log(1 - p1))


@pytest.mark.parametrize(("config", "z1"), [
    ({}, math.log(3)),                                          # plain head: logits [0, ln 3]
    ({"logit_scale": 2.0}, 2 * math.log(3)),                    # Cohere: s x
    ({"logits_scaling": 4.0}, math.log(3) / 4),                 # Granite: x / s
    ({"final_logit_softcapping": 0.5}, 0.5 * math.tanh(math.log(3) / 0.5)),     # Gemma: c tanh(x / c)
    ({"logit_scale": 2.0, "final_logit_softcapping": 1.0}, math.tanh(2 * math.log(3))),  # scale, then cap
])
@pytest.mark.parametrize("T", TEMPERATURES)
def test_hand_computed_logprob_and_entropy(config, z1, T):
    model = _TwoTokenModel(math.log(3), **config)
    ids = torch.tensor([[1, 1, 0, 1]])  # predicts tokens 1, 0, 1 (the first is the "prompt")
    out = token_logprobs(model, Forward(ids, torch.ones_like(ids), 3), LogprobOptions(temperature=T))
    logp, ent = out.logprobs, out.entropy
    lp1, h = _two_token(z1 / T)
    lp0 = lp1 - z1 / T  # log p(0) = log p(1) - z1 / T
    assert logp[0].tolist() == pytest.approx([lp1, lp0, lp1], abs=1e-6)
    assert ent[0].tolist() == pytest.approx([h] * 3, abs=1e-6)


def test_hand_numbers_at_half_temperature():
    """softmax([0, ln 3] / 0.5) = [1/10, 9/10]: logprob ln 0.9, entropy 0.3251 nats."""
    out = token_logprobs(_TwoTokenModel(math.log(3)), Forward(torch.tensor([[1, 1]]), torch.ones(1, 2, dtype=torch.long), 1),
                         LogprobOptions(temperature=0.5))
    logp, ent = out.logprobs, out.entropy
    assert logp.item() == pytest.approx(math.log(0.9), abs=1e-6)
    assert ent.item() == pytest.approx(-(0.1 * math.log(0.1) + 0.9 * math.log(0.9)), abs=1e-6)


@pytest.mark.parametrize("tf", [LogitTransform(1.0, None, 0.7), LogitTransform(3.0, None, 1.3),
                                LogitTransform(0.5, 1.5, 0.7), LogitTransform(2.0, 0.8, 1.0)])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_head_gradients_through_the_transform(tf, entropy_grad):
    """_ChunkedHead's hand-written backward against autograd of the same transform."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 29, 8, 40
    h0, w0, b0 = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g), torch.randn(V, generator=g)
    y = torch.randint(0, V, (N,), generator=g)
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)

    def run(fn):
        h, w, b = (t.clone().requires_grad_() for t in (h0, w0, b0))
        lp, ent = fn(h, w, b)
        ((lp * gl).sum() + ((ent * ge).sum() if entropy_grad else 0)).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad, b.grad

    def reference(h, w, b):
        u = tf.scale * nn.functional.linear(h, w, b)
        z = (tf.softcap * torch.tanh(u / tf.softcap) if tf.softcap else u) / tf.temperature
        logp_all = torch.log_softmax(z, -1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, y[:, None])[:, 0], ent if entropy_grad else ent.detach()

    ref = run(reference)
    got = run(lambda h, w, b: _ChunkedHead.apply(h, w, b, y, 8, True, entropy_grad, tf)[:2])
    for name, a, r in zip(("logprob", "entropy", "grad_h", "grad_w", "grad_b"), got, ref):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("arch", ARCHS + SCALED)
@pytest.mark.parametrize("T", (0.7, 1.3))
def test_sum_pi_squared_equals_the_models_softmax_at_temperature(arch, T, models, tokenizer):
    """sum_pi_squared: sum_v softmax(logits / T)_v^2 of the model's own logits (its soft cap
    and logit scale included), chunked, group-shared or not; logprobs and entropy unchanged."""
    model = models(arch)
    ids, mask, Tr, m = _batch(tokenizer)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask,
                       position_ids=position_ids_from_mask(mask)).logits.float()[:, -Tr - 1:-1]
        want = torch.softmax(logits / T, dim=-1).square().sum(-1)  # [B, Tr]
        out = token_logprobs(model, Forward(ids, mask, Tr),
                             LogprobOptions(temperature=T, chunk_size=5, sum_pi_squared=True))
        logp, ent, spp = out.logprobs, out.entropy, out.sum_pi_squared
        out = token_logprobs(model, Forward(ids, mask, Tr), LogprobOptions(temperature=T, chunk_size=5))
        logp2, ent2 = out.logprobs, out.entropy
    assert not spp.requires_grad and spp.shape == m.shape
    torch.testing.assert_close(spp * m, want * m, atol=1e-6, rtol=1e-5)
    assert bool(((spp > 0) & (spp <= 1 + 1e-6)).all())
    assert torch.equal(logp, logp2) and torch.equal(ent, ent2)


@pytest.mark.parametrize("T", [0.0, -1.0, float("inf"), float("nan"), True])
def test_bad_temperature(T, tiny_model):
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be a positive finite number"):
        token_logprobs(tiny_model, Forward(ids, torch.ones_like(ids), 1), LogprobOptions(temperature=T))


def test_a_transform_it_cannot_apply_is_refused(tiny_model):
    tiny_model.config.final_logit_softcapping = -3.0
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="final_logit_softcapping=-3.0"):
        token_logprobs(tiny_model, Forward(ids, torch.ones_like(ids), 1))
