"""The policy's top-K in the runtime's forwards (train/logprobs.py ``LogprobOptions.topk`` /
``sampled_is_top``, the trainer's old and update forwards): values and gradients against full
logits, packed = padded, nothing computed when no formula reads them, and a SimKO run
(algorithms/examples/simko.rl) of 3 steps on the tiny model."""
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
SIMKO = ROOT / "algorithms" / "examples" / "simko.rl"
PROMPTS = ["1+2=", "33+44=", "(5)*6-7=", "9="]
K = 3


def _sampled(model, tokenizer, seed: int = 0, n: int = 2, tokens: int = 7):
    batch = HFEngine(model, tokenizer).generate(PROMPTS, SamplingParams(n=n, temperature=1.5, max_new_tokens=tokens,
                                                                        seed=seed))
    return batch, torch.cat([batch.prompt_ids, batch.response_ids], 1), torch.cat([batch.prompt_mask,
                                                                                    batch.response_mask], 1)


class _Calls(TorchFunctionMode):
    """Records the torch functions and tensor methods called inside (their names)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.names.add(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunk_size", [5, 1024])
def test_top_k_logprobs_ids_top1_and_gradients_match_full_logits(tiny_model, tokenizer, chunk_size) -> None:
    """The K largest logprobs of each position and their ids (with a teacher's gathered ids in the
    same forward), whether each sampled token is the top-1, and the gradient of a loss on the
    sampled, top-K and gathered logprobs together, against the full log_softmax."""
    batch, ids, mask = _sampled(tiny_model, tokenizer, seed=3)
    Tr = batch.response_ids.shape[1]
    g = torch.Generator().manual_seed(1)
    teacher_ids = torch.randint(0, tiny_model.config.vocab_size, (len(batch), Tr, 2), generator=g)
    w, w_top, w_t = (torch.randn(s, generator=g) for s in [(len(batch), Tr), (len(batch), Tr, K), teacher_ids.shape])

    tiny_model.zero_grad()
    logits = tiny_model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    full = torch.log_softmax(logits.float()[:, -Tr - 1:-1], -1)
    top, top_ids = full.topk(K, dim=-1)
    sampled = full.gather(-1, ids[:, -Tr:, None])[..., 0]
    ((sampled * w).sum() + (top * w_top).sum() + (full.gather(-1, teacher_ids) * w_t).sum()).backward()
    ref = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}

    tiny_model.zero_grad()
    out = token_logprobs(tiny_model, Forward(ids, mask, Tr, gather_ids=teacher_ids),
                         LogprobOptions(chunk_size=chunk_size, topk=K, sampled_is_top=True))
    assert out.top_logprobs.shape == out.top_ids.shape == (len(batch), Tr, K) and out.top_logprobs.requires_grad
    assert torch.equal(out.top_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.gathered, full.gather(-1, teacher_ids).detach(), atol=1e-5, rtol=0)
    is_max = (sampled.detach() >= full.detach().amax(-1) - 1e-6).float()
    assert torch.equal(out.sampled_is_top, is_max) and bool(is_max.any()) and not bool(is_max.all())
    ((out.logprobs * w).sum() + (out.top_logprobs * w_top).sum() + (out.gathered * w_t).sum()).backward()
    for name, p in tiny_model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], atol=1e-5, rtol=1e-4, msg=name)


def test_nothing_asked_nothing_made(tiny_model, tokenizer) -> None:
    """Without topk / sampled_is_top the forward runs no top-k and returns None for them; with them
    it runs one (the check that the recorder sees it)."""
    batch, ids, mask = _sampled(tiny_model, tokenizer)
    Tr = batch.response_ids.shape[1]
    for asked in (False, True):
        with torch.no_grad(), _Calls() as calls:
            out = token_logprobs(tiny_model, Forward(ids, mask, Tr),
                                 LogprobOptions(topk=K if asked else 0, sampled_is_top=asked))
        assert ("topk" in calls.names) == asked, calls.names
        assert (out.top_logprobs is None) == (out.top_ids is None) == (out.sampled_is_top is None) == (not asked)
    with pytest.raises(ValueError, match="top-K of 99 tokens from a vocabulary of 23"):
        token_logprobs(tiny_model, Forward(ids, mask, Tr), LogprobOptions(topk=99))


def _trainer(spec, model, *, packing: bool = False, epochs: int = 1, minibatches: int = 1,
             budget: int | None = None) -> Trainer:
    cfg = RunConfig()
    cfg.train.ppo_epochs = epochs
    cfg.train.minibatches = minibatches
    cfg.train.packing = packing
    cfg.train.packing_row_tokens = 30
    cfg.train.max_tokens_per_microbatch = budget
    cfg.train.skip_zero_advantage = False
    fn = rldsl.compile(rldsl.load(str(spec)), compile=False)
    t = Trainer.from_config(cfg, fn, model)
    t.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return t


def _rollout(model, tokenizer):
    batch, _, _ = _sampled(model, tokenizer, seed=5, n=4, tokens=12)
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(batch))])
    return batch, rewards


def test_a_spec_without_top_k_runs_no_top_k_in_its_step(tiny_model, tokenizer) -> None:
    """grpo (no top-K input): its estimate and update run no top-k and keep no top-K tensors."""
    batch, rewards = _rollout(tiny_model, tokenizer)
    t = _trainer("grpo", copy.deepcopy(tiny_model), epochs=2)
    with _Calls() as calls:
        est = t.estimate(batch, rewards)
        t.update(est)
    assert "topk" not in calls.names
    assert est.old_topk_logprobs is None and est.old_topk_ids is None and est.is_top1 is None


@pytest.mark.parametrize("epochs,minibatches,budget", [(1, 1, None), (2, 2, None), (2, 2, 60)])
def test_top_k_inputs_are_the_old_policys_ids_and_packed_equals_padded(tiny_model, tokenizer, epochs,
                                                                       minibatches, budget) -> None:
    """What loss() receives: old_topk_logprobs are the old policy's K largest logprobs, its
    is_top1 its top-1, policy_topk_logprobs the current policy's at the same ids (equal to the old
    ones before the first step); exactly on-policy (one epoch, one minibatch) no old forward runs and
    the update forward picks them; packed = padded for all of it, losses and gradients included,
    also in micro-batches of a token budget (trimmed columns)."""
    batch, rewards = _rollout(tiny_model, tokenizer)
    Tr = batch.response_ids.shape[1]
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    with torch.no_grad():
        logits = tiny_model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        full = torch.log_softmax(logits.float()[:, -Tr - 1:-1], -1)
    want_top = full.topk(K, dim=-1).values
    want_top1 = (full.gather(-1, batch.response_ids[..., None])[..., 0] >= full.amax(-1)).float()
    m = batch.response_mask > 0
    results = []
    for packing in (False, True):
        model = copy.deepcopy(tiny_model)
        t = _trainer(SIMKO, model, packing=packing, epochs=epochs, minibatches=minibatches, budget=budget)
        seen: list[dict] = []
        loss = t.fn.loss

        def spy(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            seen.append({k: kw[k].detach().clone() for k in ("policy_topk_logprobs", "old_topk_logprobs", "is_top1")})
            return loss(*args, **kw)

        t.fn.loss = spy
        est = t.estimate(batch, rewards)
        assert (est.old_topk_logprobs is None) == (epochs == 1)  # on-policy: no old forward
        metrics = t.update(est, torch.Generator().manual_seed(0))
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        first = seen[0]
        rows = torch.arange(len(batch)) if minibatches == 1 else None
        if rows is not None:
            torch.testing.assert_close(first["old_topk_logprobs"][m], want_top[m], atol=1e-5, rtol=0)
            torch.testing.assert_close(first["policy_topk_logprobs"][m], want_top[m], atol=1e-5, rtol=0)
            assert torch.equal(first["is_top1"][m], want_top1[m])
        else:
            torch.testing.assert_close(est.old_topk_logprobs[m], want_top[m], atol=1e-5, rtol=0)
            assert torch.equal(est.is_top1[m], want_top1[m])
            # after the first optimizer step the current policy's values at the old ids move
            assert any(float((s["policy_topk_logprobs"] - s["old_topk_logprobs"]).abs().max()) > 1e-6
                       for s in seen[1:])
        results.append((metrics, grads, seen, est))
    (m0, g0, s0, e0), (m1, g1, s1, e1) = results
    assert m1["loss"] == pytest.approx(m0["loss"], abs=1e-5) and math.isfinite(m0["loss"])
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    if e0.old_topk_ids is not None:
        assert torch.equal(e0.old_topk_ids[m], e1.old_topk_ids[m])
    for a, b in zip(s0, s1):
        mk = (b["old_topk_logprobs"] != 0).all(-1)  # the response tokens (packed: 0 on padding)
        assert int(mk.sum()) > 0
        for k in a:
            torch.testing.assert_close(b[k][mk], a[k][mk], atol=1e-5, rtol=0, msg=k)


def test_simko_trains_three_steps(model_dir, tmp_path) -> None:
    """A 3-step run of the SimKO example spec on the tiny model: finite losses and gradients, the
    weights move."""
    from rldsl.runtime.run import loop
    from small_run import small_run, steps_of

    run = loop.train(str(SIMKO), small_run(model_dir, tmp_path / "run", **{"train.ppo_epochs": 2}))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    updated = [r for r in recs if r.get("optimizer_steps", 0) > 0]
    assert updated
    for r in updated:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
