"""The old policy's self-certainty in the runtime's forwards (train/logprobs.py
``LogprobOptions.self_certainty``, the trainer's old-logprob forward): logsumexp(z) - mean(z) of the
tempered logits against full logits, padded = packed = micro-batches of a token budget, nothing
computed when no formula reads it, and an Intuitor run (algorithms/examples/intuitor.rl) of 3
steps on the tiny model."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import rldsl
from rldsl.runtime.batch import position_ids_from_mask
from rldsl.runtime.config import RunConfig
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs
from rldsl.runtime.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]
INTUITOR = ROOT / "algorithms" / "examples" / "intuitor.rl"
PROMPTS = ["1+2=", "33+44=", "(5)*6-7=", "9="]
TEMPERATURE = 1.5


def _sampled(model, tokenizer, seed: int = 0, n: int = 2, tokens: int = 7):
    batch = HFEngine(model, tokenizer).generate(PROMPTS, SamplingParams(n=n, temperature=TEMPERATURE,
                                                                        max_new_tokens=tokens, seed=seed))
    return batch, torch.cat([batch.prompt_ids, batch.response_ids], 1), torch.cat([batch.prompt_mask,
                                                                                    batch.response_mask], 1)


def _reference(model, batch, temperature: float = TEMPERATURE) -> torch.Tensor:
    """The authors' definition on full logits (Intuitor's verl dp_actor.py: logits / temperature
    at the positions predicting the response, then logsumexp - mean) [B, Tr]."""
    Tr = batch.response_ids.shape[1]
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    z = logits.double()[:, -Tr - 1:-1] / temperature
    return (torch.logsumexp(z, -1) - z.mean(-1)).float()


class _VocabMeans(TorchFunctionMode):
    """Counts the means taken over a last axis of ``vocab`` entries (what the self-certainty takes;
    the model's own norms average over its hidden size)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if getattr(func, "__name__", "") == "mean" and args and getattr(args[0], "shape", (0,))[-1:] == (self.vocab,):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunk_size", [5, 1024])
@pytest.mark.parametrize("packing", [False, True])
def test_self_certainty_matches_full_logits(tiny_model, tokenizer, chunk_size, packing) -> None:
    """logsumexp(z) - mean(z) of the logits divided by the temperature, in ragged chunks and in one,
    padded and packed, no gradient; the logprobs of the same forward unchanged."""
    batch, ids, mask = _sampled(tiny_model, tokenizer, seed=3)
    Tr = batch.response_ids.shape[1]
    want = _reference(tiny_model, batch)
    m = batch.response_mask > 0
    opts = dict(chunk_size=chunk_size, temperature=TEMPERATURE, packing=packing, packing_row_tokens=30)
    out = token_logprobs(tiny_model, Forward(ids, mask, Tr), LogprobOptions(self_certainty=True, **opts))
    plain = token_logprobs(tiny_model, Forward(ids, mask, Tr), LogprobOptions(**opts))
    assert out.self_certainty.shape == (len(batch), Tr) and not out.self_certainty.requires_grad
    torch.testing.assert_close(out.self_certainty[m], want[m], atol=1e-5, rtol=0)
    assert float(want[m].std()) > 1e-3  # positions differ: not a constant
    torch.testing.assert_close(out.logprobs, plain.logprobs, atol=0, rtol=0)
    assert plain.self_certainty is None


def test_nothing_asked_nothing_made(tiny_model, tokenizer) -> None:
    """Without self_certainty the forward takes no mean over the vocabulary; with it, one per chunk."""
    batch, ids, mask = _sampled(tiny_model, tokenizer)
    Tr = batch.response_ids.shape[1]
    V = tiny_model.config.vocab_size
    for asked, chunk in ((False, 1024), (True, 1024), (True, 5)):
        with torch.no_grad(), _VocabMeans(V) as means:
            token_logprobs(tiny_model, Forward(ids, mask, Tr), LogprobOptions(self_certainty=asked, chunk_size=chunk))
        assert means.count == (math.ceil(len(batch) * Tr / chunk) if asked else 0)


def _trainer(spec, model, *, packing: bool = False, epochs: int = 1, budget: int | None = None) -> Trainer:
    cfg = RunConfig()
    cfg.train.ppo_epochs = epochs
    cfg.train.packing = packing
    cfg.train.packing_row_tokens = 30
    cfg.train.max_tokens_per_microbatch = budget
    cfg.train.skip_zero_advantage = False
    cfg.rollout.temperature = TEMPERATURE
    fn = rldsl.compile(rldsl.load(str(spec)), compile=False)
    t = Trainer.from_config(cfg, fn, model)
    t.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return t


def test_a_spec_without_it_computes_none(tiny_model, tokenizer) -> None:
    """grpo (no formula reads self_certainty): its estimate and update take no mean over the
    vocabulary, and estimate() gets no self_certainty."""
    batch, _, _ = _sampled(tiny_model, tokenizer, seed=5, n=4, tokens=12)
    t = _trainer("grpo", copy.deepcopy(tiny_model), epochs=2)
    seen: list[dict] = []
    estimate = t.fn.estimate
    t.fn.estimate = lambda *a, **kw: seen.append(kw) or estimate(*a, **kw)
    with _VocabMeans(tiny_model.config.vocab_size) as means:
        t.update(t.estimate(batch, torch.ones(len(batch))))
    assert means.count == 0 and "self_certainty" not in seen[0]


@pytest.mark.parametrize("epochs,budget", [(1, None), (2, 60)])
def test_estimate_reads_the_old_policys_self_certainty(tiny_model, tokenizer, epochs, budget) -> None:
    """What estimate() receives: the old policy's self-certainty at the rollout temperature, also
    exactly on-policy (one epoch: the old forward runs for it), padded = packed, also in
    micro-batches of a token budget (trimmed columns: 0 there); the advantages are GRPO's on its
    masked mean per answer, whatever the reward (all 0 here)."""
    batch, _, _ = _sampled(tiny_model, tokenizer, seed=5, n=4, tokens=12)
    want = _reference(tiny_model, batch)
    m = batch.response_mask > 0
    got = []
    for packing in (False, True):
        t = _trainer(INTUITOR, copy.deepcopy(tiny_model), packing=packing, epochs=epochs, budget=budget)
        seen: list[dict] = []
        estimate = t.fn.estimate
        t.fn.estimate = lambda *a, **kw: seen.append(kw) or estimate(*a, **kw)  # noqa: B023
        est = t.estimate(batch, torch.zeros(len(batch)))
        sc = seen[0]["self_certainty"]
        torch.testing.assert_close(sc[m], want[m], atol=1e-5, rtol=0)
        # the random model is near uniform: every mean is ~log V = 3.14 and a group's std ~5e-4, so
        # the float32 stage holds A to ~1e-3 here (exactness: tests/language/test_new_algorithms_2.py)
        mean = (sc.double() * m).sum(-1) / m.sum(-1)
        g = mean.view(-1, 4)
        adv = ((g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-6)).reshape(-1)
        torch.testing.assert_close(est.advantages[m].double(), adv[:, None].expand_as(m)[m], atol=2e-3, rtol=0)
        assert float(est.advantages.abs().max()) > 0.5
        got.append(sc)
    torch.testing.assert_close(got[1][m], got[0][m], atol=1e-5, rtol=0)


def test_intuitor_trains_three_steps(model_dir, tmp_path) -> None:
    """A 3-step run of the Intuitor example spec on the tiny model: finite losses and gradients, the
    weights move."""
    from rldsl.runtime.run import loop
    from small_run import small_run, steps_of

    run = loop.train(str(INTUITOR), small_run(model_dir, tmp_path / "run"))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    updated = [r for r in recs if r.get("optimizer_steps", 0) > 0]
    assert updated
    for r in updated:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
