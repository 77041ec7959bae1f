"""GDPO in the runtime: a reward spec of several functions reaches estimate() as one column per
function ([B, K]) with the spec's weights; the scalar reward stays their weighted sum."""
from __future__ import annotations

import pytest
import torch

import peer_refs as R
from rldsl.runtime.run import loop
from small_run import small_run, steps_of

TWO = "reward_helpers:parity=1.0,reward_helpers:answer_prefix=0.5"


def _spy(monkeypatch) -> list:
    from rldsl.runtime.train.trainer import Trainer
    seen = []
    est = Trainer.estimate

    def estimate(self, rollout, rewards):
        tb = est(self, rollout, rewards)
        seen.append((rollout, rewards.clone(), tb.advantages.clone()))
        return tb

    monkeypatch.setattr(Trainer, "estimate", estimate)
    return seen


@pytest.mark.slow
def test_gdpo_trains_on_two_reward_functions_normalised_one_by_one(model_dir, tmp_path, monkeypatch):
    seen = _spy(monkeypatch)
    run = loop.train("gdpo", small_run(model_dir, tmp_path / "run", **{"reward.name": TWO}))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert any(r.get("optimizer_steps", 0) > 0 for r in recs)
    assert len(seen) == 3
    for rollout, rewards, adv in seen:
        comps, w = rollout.inputs.get("reward_components"), rollout.inputs.get("reward_weights")
        assert comps.shape == (16, 2) and w.tolist() == [1.0, 0.5]
        parity = torch.tensor([float(len(c) % 2) for c in rollout.completions])
        assert torch.equal(comps[:, 0].cpu(), parity)
        # the rewards as the verifiers returned them (float64), taken by the trainer as float32
        torch.testing.assert_close(rewards.cpu().float(), comps[:, 0].cpu() + 0.5 * comps[:, 1].cpu())
        m = rollout.response_mask.double().cpu()
        tlr = [torch.zeros_like(m).index_put_((torch.arange(16), (m.sum(-1).long() - 1).clamp_min(0)), c.double())
               for c in comps.cpu().T]
        ref = R.verl_gdpo(tlr, m, [i // 4 for i in range(16)], w.tolist())
        torch.testing.assert_close(adv.double().cpu() * m, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_specs_without_gdpo_get_no_per_function_rewards(model_dir, tmp_path, monkeypatch):
    seen = _spy(monkeypatch)
    loop.train("grpo", small_run(model_dir, tmp_path / "run", **{"reward.name": TWO}))
    assert [s[0].inputs.get("reward_components") for s in seen] == [None, None, None]

