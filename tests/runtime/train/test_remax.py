"""ReMax in the runtime: one greedy generation per prompt per step, scored by the run's reward,
reaches estimate() as reward_baselines; specs that do not need it never pay for it."""
from __future__ import annotations

import pytest
import torch

from rldsl.runtime.run import loop
from rldsl.runtime.workers.local import LocalRollouts
from small_run import small_run, steps_of


def _spy(monkeypatch):
    """Record (prompts, n, temperature) of every generate() and every reward_baselines estimated."""
    calls: list[tuple[list[str], int, float]] = []
    seen: list[torch.Tensor | None] = []
    gen = LocalRollouts.generate

    def generate(self, prompts, answers, params, reward_prompts=None):
        calls.append((list(prompts), params.n, params.temperature))
        return gen(self, prompts, answers, params, reward_prompts)

    from rldsl.runtime.train.trainer import Trainer
    est = Trainer.estimate

    def estimate(self, rollout, rewards):
        seen.append(rollout.inputs.get("reward_baselines"))
        return est(self, rollout, rewards)

    monkeypatch.setattr(LocalRollouts, "generate", generate)
    monkeypatch.setattr(Trainer, "estimate", estimate)
    return calls, seen


@pytest.mark.slow
def test_remax_generates_one_greedy_response_per_prompt_per_step(model_dir, tmp_path, monkeypatch):
    calls, seen = _spy(monkeypatch)
    run = loop.train("remax", small_run(model_dir, tmp_path / "run"))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    sampled = [c for c in calls if c[1] == 4]  # the training rollouts (rollout.n=4)
    train_prompts = [c[0] for c in sampled]
    greedy = [c for c in calls if c[2] == 0 and c[0] in train_prompts]  # not the held-out evaluation
    assert len(sampled) == 3 and len(greedy) == 3
    for (sp, _, _), (gp, gn, _) in zip(sampled, greedy):
        assert gn == 1 and gp == sp  # the same 4 prompts, one greedy response each
    assert len(seen) == 3
    for b in seen:  # [B] = 16, one value per prompt repeated over its group of 4
        assert b is not None and b.shape == (16,)
        assert torch.equal(b.view(4, 4), b.view(4, 4)[:, :1].expand(4, 4))
    assert all(r["time/greedy_s"] >= 0 for r in recs)


@pytest.mark.slow
def test_specs_without_a_greedy_baseline_do_not_generate_one(model_dir, tmp_path, monkeypatch):
    calls, seen = _spy(monkeypatch)
    run = loop.train("grpo", small_run(model_dir, tmp_path / "run"))
    train_prompts = [c[0] for c in calls if c[1] == 4]
    assert len(train_prompts) == 3
    assert not [c for c in calls if c[2] == 0 and c[0] in train_prompts]
    assert seen == [None, None, None]
    assert all("time/greedy_s" not in r for r in steps_of(run))
