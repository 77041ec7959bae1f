"""Dynamic sampling and the pass-rate cap in the step: which groups a step trains on.

verl's rule: keep drawing until the batch is informative; after ``max_rounds`` train on the
informative groups only. A zero-variance group (A = 0) must never enter the loss
denominator, and a failed (NaN) reward is left out of every group statistic.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

import rldsl
from rldsl.runtime.run import step_batch as run_rollouts
from rldsl.runtime.config import load_config
from rldsl.runtime.data.datasets import Example, PromptSource, rollout_prompts
from rldsl.runtime.data.sources import FILE
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.rewards.functions import RewardFn, RewardResult
from rldsl.runtime.train.optim import build_optimizer
from rldsl.runtime.train.trainer import Trainer
from rldsl.runtime.workers.base import Generation

NAN = math.nan
G = 4
# rewards of the 4 groups of each round: only the starred groups are informative
ROUNDS = [
    [[1, 1, 1, 1], [0, 1, 0, 0], [1, 1, 1, NAN], [0, 0, 0, 0]],   # * group 1; [1,1,1,NaN] is not
    [[0, 0, 0, 0], [1, 1, 1, 1], [NAN, 0, 0, 0], [1, 1, 1, 1]],   # none
    [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, NAN, 1], [0, 0, 0, 0]],   # * group 2
]


class ScriptedRollouts:
    """Real samples from a tiny model, rewards from ``ROUNDS`` (one entry per call)."""

    def __init__(self, model, tokenizer, rounds):
        self.engine, self.rounds, self.calls = HFEngine(model, tokenizer), list(rounds), 0

    def generate(self, prompts, answers, params: SamplingParams, reward_prompts=None) -> Generation:
        batch = self.engine.generate(prompts, params)
        rewards = torch.tensor(self.rounds[self.calls], dtype=torch.float32).reshape(-1)
        self.calls += 1
        return Generation(batch, RewardResult(rewards, {}, int(rewards.isnan().sum())), 0.0, 0.0)


def _run(tiny_model, tokenizer, spec: str, rounds):
    cfg = load_config(None, ["rollout.prompts_per_step=4", f"rollout.n={G}", "rollout.max_new_tokens=6"])
    algo = rldsl.load(spec)
    fn = rldsl.compile(algo, compile=False)
    examples = [Example(id=i, prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(10, 40)]
    warnings: list[str] = []
    s = SimpleNamespace(cfg=cfg, fn=fn, prompts=PromptSource(examples, seed=0), tokenizer=tokenizer,
                        rollouts=ScriptedRollouts(tiny_model, tokenizer, rounds), reward=RewardFn("exact"),
                        source=FILE, warn=warnings.append, multi_turn=False,
                        rollout_prompts=lambda examples: rollout_prompts(examples, False))
    return s, warnings


def test_dynamic_sampling_trains_on_the_informative_groups_only(tiny_model, tokenizer):
    rounds = ROUNDS + [[[0] * G] * 4] * 7  # dapo: max_rounds 10, nothing informative after round 3
    s, warnings = _run(tiny_model, tokenizer, "dapo", rounds)
    assert s.fn.data.dynamic_rounds == 10
    r = run_rollouts.rollout_step(s, step=1)
    batch, rewards, ids, m = r.batch, r.rewards, r.prompt_ids, r.metrics
    assert m["sampling_rounds"] == 10 and m["informative_groups"] == 2
    # round 0's group 1 and round 2's group 2, nothing else
    expected = torch.tensor([0, 1, 0, 0, 1, 0, NAN, 1])
    assert torch.equal(rewards.isnan(), expected.isnan())
    assert torch.equal(rewards.nan_to_num(-1), expected.nan_to_num(-1))
    assert len(batch) == 8 and len(ids) == 2
    assert any("2 informative group(s) of 4" in w for w in warnings)
    # the loss denominator (dapo: token_mean) counts the tokens of those two groups only
    trainer = Trainer(s.fn, tiny_model, optimizer=build_optimizer(tiny_model.parameters(), s.cfg.train))
    tb = trainer.estimate(batch, rewards)
    informative_tokens = batch.response_mask.sum() - batch.response_mask[6].sum()  # NaN row masked
    assert float(s.fn.denominator(tb.mask, G)) == float(informative_tokens)
    assert tb.metrics["zero_variance_groups"] == 0
    assert (tb.advantages * tb.mask).abs().sum(-1).gt(0).sum() == 7  # every scorable row has A != 0


def test_dynamic_sampling_stops_drawing_once_the_batch_is_informative(tiny_model, tokenizer):
    rounds = [[[0, 1, 0, 0]] * 2 + [[1, 1, 1, 1]] * 2, [[1, 0, 1, 1]] * 4, [[0, 1, 1, 1]] * 4]
    s, warnings = _run(tiny_model, tokenizer, "dapo", rounds)
    r = run_rollouts.rollout_step(s, step=1)
    batch, m = r.batch, r.metrics
    assert m["sampling_rounds"] == 2 and m["informative_groups"] == 4 and len(batch) == 4 * G
    assert s.rollouts.calls == 2 and not warnings


def test_no_informative_group_keeps_the_last_round_with_zero_advantages(tiny_model, tokenizer):
    s, warnings = _run(tiny_model, tokenizer, "dapo", [[[1] * G] * 4] * 10)
    r = run_rollouts.rollout_step(s, step=1)
    batch, m = r.batch, r.metrics
    assert m["informative_groups"] == 0 and len(batch) == 4 * G
    assert any("zero advantage" in w for w in warnings)


def test_the_step_warnings_name_the_step_as_metrics_jsonl_logs_it(tiny_model, tokenizer):
    """rollout_step(step=1) is the second step, logged as step 2 in metrics.jsonl: its warnings
    (failed rewards skipped, dynamic sampling short of groups) say "step 2", never "step 1"."""
    s, warnings = _run(tiny_model, tokenizer, "grpo", [[[1, NAN, 0, 0]] + [[0, 1, 0, 0]] * 3])
    run_rollouts.rollout_step(s, step=1)
    assert [w.splitlines()[0] for w in warnings] == ["step 2: 1 sample(s) skipped (reward failed); first:"]
    s, warnings = _run(tiny_model, tokenizer, "dapo", [[[1] * G] * 4] * 10)
    run_rollouts.rollout_step(s, step=1)
    assert warnings and all(w.startswith("step 2: dynamic sampling") for w in warnings)


def test_pass_rate_cap_retires_at_the_cap_and_ignores_failed_rewards():
    """p >= cap retires (ScaleRL's rule); a NaN reward is left out, never counted as 0."""
    fn = rldsl.compile(rldsl.load("grpo"), compile=False)
    from dataclasses import replace
    plan = replace(fn.data, pass_rate_cap=0.75)
    r = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, NAN], [NAN] * 4])
    assert plan.retire(r).tolist() == [True, False, True, False]
    assert plan.informative(r).tolist() == [True, True, False, False]


def test_evaluation_counts_failed_rewards_instead_of_scoring_them_0(tiny_model, tokenizer):
    """Accuracy: reward > 0.5 over every sample, a failure counting as not correct; the mean
    reward leaves failures out; ``eval/failed`` counts them."""
    s, warnings = _run(tiny_model, tokenizer, "grpo", [[[1, NAN, 0.25, 1]], [[NAN] * 4]])
    s.heldout = [Example(id=i, prompt=f"{i}+1=", answer=str(i + 1)) for i in range(4)]
    s.eval_sets = []  # no eval.data sets: the held-out split only
    s.cfg = load_config(None, ["rollout.max_new_tokens=4", "eval.samples=1"])
    from rldsl.runtime.run.eval_step import evaluate
    out = evaluate(s, step=0)
    assert out["eval/greedy_acc"] == 0.5 and out["eval/greedy_reward"] == 0.75
    assert out["eval/sampled_acc"] == 0.0 and math.isnan(out["eval/sampled_reward"])
    assert out["eval/failed"] == 5 and any("5 held-out sample(s)" in w for w in warnings)
