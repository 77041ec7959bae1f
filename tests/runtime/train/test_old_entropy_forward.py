"""The old policy's per-token entropy (input ``old_entropy``, a formula's ``old_ent``) reaches
``loss()`` from the forward that makes the old logprobs -- packed or padded, in one micro-batch
or several -- equal to the entropy computed directly from the policy before the update; exactly
on-policy (no old forward) it is the update forward's own entropy."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rldsl
from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs
from rldsl.runtime.train.microbatch import row_tokens
from rldsl.runtime.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]
ERC = ROOT / "algorithms" / "examples" / "erc.rl"
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])



def _spied_trainer(model, batch, monkeypatch, **kw):
    fn = rldsl.compile(rldsl.load(ERC), compile=False)
    trainer = Trainer(fn, model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                      skip_zero_advantage=False, **kw)
    seen: list[dict] = []
    real = fn.loss

    def spy(*args, **kwargs):
        seen.append({k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
                    | {"mask": args[3].detach().clone()})
        return real(*args, **kwargs)

    monkeypatch.setattr(fn, "loss", spy)
    return trainer, seen


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("micro", [1, 2])
def test_old_ent_is_the_old_policys_entropy(rollout, monkeypatch, packing, micro):
    model, batch = rollout
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    attn = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    Tr = batch.response_ids.shape[1]
    with torch.no_grad():  # the direct computation: the policy before any update, padded, whole batch
        direct = token_logprobs(model, Forward(ids, attn, Tr), LogprobOptions(entropy=True)).entropy
    budget = None if micro == 1 else int(row_tokens(batch).sum()) // 2 + 1
    # two epochs: the old policy is not the current one after the first step, so the old forward runs
    trainer, seen = _spied_trainer(model, batch, monkeypatch, ppo_epochs=2, packing=packing,
                                   max_tokens_per_microbatch=budget)
    tb = trainer.estimate(batch, REWARDS)
    m = batch.response_mask > 0
    assert tb.old_entropy is not None
    torch.testing.assert_close(tb.old_entropy[m], direct[m], atol=1e-5, rtol=1e-5)
    trainer.update(tb)
    first_step = seen[:len(seen) // 2]
    assert len(first_step) == micro
    for kw in first_step:  # before the first optimizer step the current policy is the old one
        valid = kw["mask"] > 0
        assert kw["old_entropy"].shape == kw["entropy"].shape
        torch.testing.assert_close(kw["old_entropy"][valid], kw["entropy"][valid], atol=1e-5, rtol=1e-5)
    later = seen[len(seen) // 2:]  # after it they differ: old_ent stays the old policy's
    assert any(not torch.allclose(kw["old_entropy"][kw["mask"] > 0], kw["entropy"][kw["mask"] > 0], atol=1e-4)
               for kw in later)


def test_on_policy_old_ent_is_the_update_forwards_own(rollout, monkeypatch):
    model, batch = rollout
    trainer, seen = _spied_trainer(model, batch, monkeypatch)
    assert trainer._old_is_current()
    tb = trainer.estimate(batch, REWARDS)
    assert tb.old_logprobs is None and tb.old_entropy is None  # no old forward ran
    trainer.update(tb)
    assert len(seen) == 1 and torch.equal(seen[0]["old_entropy"], seen[0]["entropy"])


def test_the_update_entropy_carries_its_gradient_where_a_loss_formula_reads_it():
    from rldsl.runtime.train import inputs as producers

    bonus = rldsl.loads("algorithm b extends grpo\n  define ent_bonus\n    l = -w * A - 0.01 * ent\n  end\n"
                        "  objective ent_bonus\n", "b.rl")
    assert producers.entropy_grad(bonus)  # ent is a value of its loss: d loss / d ent reaches the policy
    assert not producers.entropy_grad(rldsl.load("grpo"))
    assert producers.entropy_grad(rldsl.load(str(ROOT / "algorithms" / "examples" / "entropy_advantage.rl")))
