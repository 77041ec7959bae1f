"""Evaluation sets and ``rldsl eval``: pass@k against a brute-force count, metrics recomputed from
the very samples generated, and the command on a model folder and on a run folder."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rldsl.cli import app
from rldsl.runtime.run import loop
from rldsl.runtime.config import load_config
from rldsl.runtime.data.sources import source_of
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.run.eval_sets import evaluate_set, load_sets, set_name
from rldsl.runtime.run.evaluation import k_values, pass_at_k
from rldsl.runtime.rewards.functions import RewardFn

runner = CliRunner()


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The fraction of all k-subsets of the samples that hold a correct one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_counting_subsets(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)
    assert k_values(8) == [1, 2, 4, 8] and k_values(5) == [1, 2, 4, 5] and k_values(1) == [1]
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_set_metrics_recomputed_from_the_generated_samples(tiny_model, tokenizer, tmp_path):
    data = write_rows(tmp_path / "sums_test.jsonl", [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(10, 16)])
    reward = RewardFn("reward_helpers:parity")
    [s] = load_sets(data, load_config(None, []), reward, tokenizer)
    assert s.name == "sums_test" and len(s.examples) == 6
    engine = HFEngine(tiny_model, tokenizer)
    seen = []

    def generate(prompts, answers, params):
        batch = engine.generate(prompts, params)
        seen.append(batch)
        return batch

    cfg = load_config(None, ["rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.max_new_tokens=5"])
    m = evaluate_set(generate, s, cfg, n=4, seed=3)
    greedy, sampled = seen
    parity = lambda c: float(len(c) % 2)  # noqa: E731 - the reward, independently
    assert m["eval/sums_test/greedy_acc"] == pytest.approx(sum(parity(c) for c in greedy.completions) / 6)
    outcomes = [[parity(c) > 0.5 for c in sampled.completions[4 * i:4 * i + 4]] for i in range(6)]
    for k in (1, 2, 4):
        want = sum(brute_pass_at_k(o, k) for o in outcomes) / 6
        assert m[f"eval/sums_test/pass@{k}"] == pytest.approx(want)
    assert m["eval/sums_test/pass@1"] <= m["eval/sums_test/pass@2"] <= m["eval/sums_test/pass@4"]
    assert m["eval/sums_test/reward"] == pytest.approx(sum(map(parity, sampled.completions)) / 24)
    assert m["eval/sums_test/length"] == pytest.approx(float(sampled.response_mask.sum(-1).float().mean()))
    assert m["eval/sums_test/truncated"] == pytest.approx(float(sampled.truncated.float().mean()))
    assert m["eval/sums_test/failed"] == 0.0
    assert set_name("a/b/gsm8k test.jsonl", ["x"]) == "gsm8k_test" and set_name("t.jsonl", ["t"]) == "t_2"


def test_eval_command_on_a_model_folder(model_dir, tmp_path):
    a = write_rows(tmp_path / "a.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)])
    b = write_rows(tmp_path / "b.jsonl", [{"prompt": f"{i}+2=", "answer": str(i + 2)} for i in range(3)])
    out = tmp_path / "m.json"
    res = runner.invoke(app, ["eval", str(model_dir), "--data", str(a), "--data", str(b), "--n", "2",
                              "--max-new-tokens", "4", "--reward", "reward_helpers:parity", "--out", str(out)])
    assert res.exit_code == 0, res.output
    metrics = json.loads(out.read_text())
    for name in ("a", "b"):
        assert {f"eval/{name}/{k}" for k in ("greedy_acc", "pass@1", "pass@2", "reward", "length",
                                            "truncated", "failed")} <= metrics.keys()
        assert f"{name} (" in res.output and "pass@2" in res.output


@pytest.mark.slow
def test_eval_command_on_a_run_uses_its_checkpoint_and_reward(model_dir, tmp_path):
    cfg = load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'run'}", "rollout.prompts_per_step=2",
                             "rollout.n=2", "train.steps=1", "eval.every=0", "checkpoint.every=1",
                             "log.progress=false", "reward.name=reward_helpers:parity", "rollout.max_new_tokens=3"])
    run = loop.train("grpo", cfg)
    data = write_rows(tmp_path / "t.jsonl", [{"prompt": f"{i}+3=", "answer": str(i + 3)} for i in range(4)])
    out = tmp_path / "m.json"
    res = runner.invoke(app, ["eval", str(run), "--data", str(data), "--n", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    metrics = json.loads(out.read_text())
    assert metrics["eval/t/length"] <= 3.0  # the run's max_new_tokens
    assert 0.0 <= metrics["eval/t/pass@2"] <= 1.0


@pytest.mark.slow
def test_eval_and_export_show_no_transformers_progress_bars(model_dir, tmp_path, capfd):
    """`rldsl eval` and `rldsl export` load and write models without transformers' "Loading
    weights" / "Writing model shards" bars (with transformers' bars switched on, its default)."""
    from transformers.utils import logging as hf_logging
    cfg = load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'run'}", "rollout.prompts_per_step=2",
                             "rollout.n=2", "train.steps=1", "eval.every=0", "checkpoint.every=1",
                             "log.progress=false", "reward.name=reward_helpers:parity", "rollout.max_new_tokens=3"])
    run = loop.train("grpo", cfg)
    data = write_rows(tmp_path / "t.jsonl", [{"prompt": f"{i}+3=", "answer": str(i + 3)} for i in range(2)])
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # the run above switched them off for this process
    try:
        capfd.readouterr()
        res = runner.invoke(app, ["eval", str(run), "--data", str(data), "--n", "1"])
        res2 = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "plain")])
        res3 = runner.invoke(app, ["eval", str(tmp_path / "plain"), "--data", str(data), "--n", "1"])
        assert hf_logging.is_progress_bar_enabled()  # transformers' setting is left as it was
    finally:
        if not was:
            hf_logging.disable_progress_bar()
    assert res.exit_code == res2.exit_code == res3.exit_code == 0, res.output + res2.output + res3.output
    seen = capfd.readouterr()
    text = res.output + res2.output + res3.output + seen.out + seen.err
    assert "Loading weights" not in text and "Writing model shards" not in text, text


def test_eval_command_bad_input(model_dir, tmp_path):
    res = runner.invoke(app, ["eval", str(tmp_path / "nope"), "--data", "x.jsonl"])
    assert res.exit_code == 2 and "does not exist" in res.output
    bad = write_rows(tmp_path / "bad.jsonl", [{"question": "1+1="}])
    res = runner.invoke(app, ["eval", str(model_dir), "--data", str(bad)])
    assert res.exit_code == 2 and "bad.jsonl" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["eval", str(tmp_path), "--data", str(bad)])
    assert res.exit_code == 2 and "no config.json" in res.output


def test_eval_command_reads_the_data_and_the_reward_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    """A missing or bad data file and a reward function of the wrong signature exit 2 before
    `rldsl eval` loads the model (issue 57: errors that need no weights come first)."""
    from rldsl.runtime.run import eval_target

    def refuse(path, dtype):
        raise AssertionError(f"the model at {path} was loaded before the check")

    monkeypatch.setattr(eval_target, "load_policy", refuse)
    good = write_rows(tmp_path / "good.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    bad = write_rows(tmp_path / "bad.jsonl", [{"question": "1+1="}])
    (tmp_path / "two.py").write_text("def two(prompt, completion):\n    return 1.0\n")
    for flags, message in ((["--data", str(tmp_path / "nosuch.jsonl")], "nosuch.jsonl: no such file"),
                           (["--data", str(good), "--data", str(bad)], "bad.jsonl: line 1: missing field"),
                           (["--data", str(good), "--reward", f"{tmp_path / 'two.py'}:two"],
                            "its signature is (prompt, completion)")):
        res = runner.invoke(app, ["eval", str(model_dir), *flags])
        assert res.exit_code == 2 and message in res.output, res.output


@pytest.mark.slow
def test_a_run_evaluates_its_eval_sets_with_their_own_rewards(model_dir, tmp_path):
    from rldsl.runtime.records.metrics import read_metrics
    a = write_rows(tmp_path / "a.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)])
    b = write_rows(tmp_path / "b.jsonl", [{"prompt": f"{i}+2=", "answer": str(i + 2)} for i in range(3)])
    toml = tmp_path / "run.toml"
    toml.write_text(f'[[eval.data]]\npath = "{a}"\n\n[[eval.data]]\npath = "{b}"\nreward = "reward_helpers:quarter"\nname = "plus2"\n')
    cfg = load_config(toml, [f"model.path={model_dir}", f"out={tmp_path / 'run'}", "rollout.prompts_per_step=2",
                             "rollout.n=2", "train.steps=2", "eval.every=1", "eval.n=3", "checkpoint.every=0",
                             "log.progress=false", "reward.name=reward_helpers:parity", "rollout.max_new_tokens=3"])
    run = loop.train("grpo", cfg)
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval/a/greedy_acc" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    for r in evals:
        for name in ("a", "plus2"):
            assert {f"eval/{name}/pass@{k}" for k in (1, 2, 3)} <= r.keys()
            assert r[f"eval/{name}/pass@1"] <= r[f"eval/{name}/pass@3"] and r[f"eval/{name}/length"] <= 3
    # 'plus2' is scored by its own reward (0.25 for anything), 'a' by the run's (parity: 0 or 1)
    assert all(r["eval/plus2/greedy_acc"] == 0.0 and r["eval/plus2/reward"] == 0.25 for r in evals)
    assert all(abs(r["eval/a/reward"] * 12 - round(r["eval/a/reward"] * 12)) < 1e-5 for r in evals)  # 12 samples of 0/1


def test_eval_set_errors_come_before_the_model_loads(model_dir, tmp_path):
    from rldsl.runtime.errors import DataError
    bad = write_rows(tmp_path / "bad.jsonl", [{"question": "1+1="}])
    cfg = load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'run'}", f"eval.data=[{bad}]"])
    with pytest.raises(DataError, match="bad.jsonl"):
        loop.train("grpo", cfg)
    assert not (tmp_path / "run").exists()


def test_held_out_and_eval_sets_are_one_evaluator_and_one_rule_of_correctness():
    """answer_set answers a set greedily then sampled; set_metrics and heldout_metrics name the
    same answers' figures; "correct" is RewardFn.correct (reward > 0.5, a failed reward never)."""
    from rldsl.runtime.rewards.functions import CORRECT_ABOVE, correct
    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.run.evaluation import Answers, answer_set, heldout_metrics, set_metrics
    from types import SimpleNamespace

    nan = float("nan")
    assert CORRECT_ABOVE == 0.5
    assert correct(torch.tensor([1.0, 0.5, 0.75, nan])).tolist() == [True, False, True, False]
    calls = []
    rewards = {1: torch.tensor([1.0, nan]), 2: torch.tensor([1.0, 0.0, nan, 0.25])}

    def answer(examples, params):
        calls.append(params)
        B = len(rewards[params.n])
        batch = SimpleNamespace(response_mask=torch.ones(B, 2), truncated=torch.zeros(B, dtype=torch.bool),
                                episodes=[], completions=[""] * B)
        return batch, rewards[params.n]

    a = answer_set(answer, ["p0", "p1"], max_new_tokens=5, sampled=SamplingParams(n=2, temperature=1.0, max_new_tokens=5))
    assert calls[0] == SamplingParams.greedy(5) and calls[1].n == 2
    assert isinstance(a, Answers) and a.failed == 2
    reward = RewardFn("exact")
    sets = set_metrics("s", a, reward)
    held = heldout_metrics(a, reward, "hermes")
    assert sets["eval/s/greedy_acc"] == held["eval/greedy_acc"] == 0.5
    assert sets["eval/s/pass@1"] == 0.25 and held["eval/sampled_acc"] == 0.25
    assert held["eval/greedy_reward"] == 1.0
    assert sets["eval/s/reward"] == held["eval/sampled_reward"] == pytest.approx(1.25 / 3)
    assert sets["eval/s/failed"] == held["eval/failed"] == 2.0


def test_the_held_out_split_of_generated_data_is_also_split_by_task():
    """A reasoning-gym mix's held-out rows: eval/heldout/<task>/... per task, from the very answers
    of eval/greedy_acc and eval/sampled_acc (run/eval_step.py asks each row's task)."""
    from types import SimpleNamespace

    pytest.importorskip("reasoning_gym")
    from rldsl.runtime.data import reasoning_gym as rg
    from rldsl.runtime.data.sources import source_of
    from rldsl.runtime.run import eval_step

    held = rg.generate("reasoning_gym:basic_arithmetic=1,spell_backward=1", {"size": 4, "seed": 0},
                       run_seed=0, heldout=6).heldout
    tasks = [rg.task_of(e.reward_prompt) for e in held]
    assert set(tasks) == {"basic_arithmetic", "spell_backward"}
    # greedy: right on basic_arithmetic, wrong on spell_backward; sampled (n=2): one of two right
    greedy = torch.tensor([1.0 if t == "basic_arithmetic" else 0.0 for t in tasks])
    sampled = torch.tensor([[1.0, 0.0] for _ in tasks]).view(-1)

    def generate(prompts, answers, params, reward_prompts):
        B = len(prompts) * params.n
        batch = SimpleNamespace(response_mask=torch.ones(B, 2), truncated=torch.zeros(B, dtype=torch.bool),
                                episodes=[], completions=[""] * B)
        return SimpleNamespace(batch=batch, scored=SimpleNamespace(rewards=greedy if params.n == 1 else sampled))

    cfg = load_config(None, ["data.path=reasoning_gym:basic_arithmetic=1,spell_backward=1", "eval.samples=2",
                             "rollout.max_new_tokens=8"])  # a run's config is resolved (resolve.py fills it in)
    s = SimpleNamespace(cfg=cfg, heldout=held, rollouts=SimpleNamespace(generate=generate), multi_turn=False,
                        reward=RewardFn("exact"), source=source_of(cfg), warn=lambda m: None)
    m = eval_step.evaluate_heldout(s, 1)
    assert m["eval/greedy_acc"] == pytest.approx(float(greedy.mean())) and m["eval/sampled_acc"] == 0.5
    assert m["eval/heldout/basic_arithmetic/greedy_acc"] == 1.0 == m["eval/heldout/basic_arithmetic/greedy_reward"]
    assert m["eval/heldout/spell_backward/greedy_acc"] == 0.0
    for t in ("basic_arithmetic", "spell_backward"):
        assert m[f"eval/heldout/{t}/sampled_acc"] == 0.5 == m[f"eval/heldout/{t}/sampled_reward"]
    # data without tasks (a data file): no per-task metrics
    from rldsl.runtime.run.evaluation import Answers, heldout_task_metrics
    assert heldout_task_metrics(Answers(None, torch.tensor([1.0, 0.0])), RewardFn("exact"), [None, None]) == {}


def test_an_agent_making_two_rows_per_episode_is_evaluated_per_episode():
    """The docs' self-play agent (a proposer and a solver call, a row each): 3 held-out prompts give
    6 greedy rows, which map back to their 3 episodes and prompts (it was "3 tasks for 6 held-out
    prompts" at the step-0 evaluation); each figure counts episodes; an eval.data set alike."""
    from types import SimpleNamespace

    from rldsl.runtime.data.datasets import Example
    from rldsl.runtime.run import eval_step
    from rldsl.runtime.run.evaluation import answer_set, scored_here, set_metrics
    from rldsl.runtime.rollout.engines.base import SamplingParams

    held = [Example(i, f"{i}+1=", str(i + 1)) for i in range(3)]
    # greedy: episodes right, wrong, right (both rows of an episode carry its reward); sampled
    # (n=2): episode 0 of each prompt right, episode 1 wrong, but the last, whose roles were rewarded
    # apart (1 and 0): its mean 0.5, not correct
    greedy = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    sampled = torch.tensor([1.0, 1.0, 0.0, 0.0] * 2 + [1.0, 1.0, 1.0, 0.0])
    lengths = []

    def batch_of(B):
        mask = torch.zeros(B, 4)
        mask[0::2, :3] = 1.0  # the proposer rows: 3 tokens, the solver rows 1
        mask[1::2, :1] = 1.0
        return SimpleNamespace(response_mask=mask, truncated=torch.tensor([False, True] * (B // 2)),
                               episodes=[], completions=[""] * B, group_size=2 * (B // 6))

    def generate(prompts, answers, params, reward_prompts):
        B = len(prompts) * params.n * 2
        lengths.append(B)
        return SimpleNamespace(batch=batch_of(B), scored=SimpleNamespace(rewards=greedy if params.n == 1 else sampled))

    cfg = load_config(None, ["eval.samples=2", "rollout.max_new_tokens=8"])
    s = SimpleNamespace(cfg=cfg, heldout=held, rollouts=SimpleNamespace(generate=generate), multi_turn=True,
                        reward=RewardFn("exact"), source=source_of(cfg), warn=lambda m: None)
    m = eval_step.evaluate_heldout(s, 0)
    assert lengths == [6, 12]
    assert m["eval/greedy_acc"] == pytest.approx(2 / 3) and m["eval/greedy_reward"] == pytest.approx(2 / 3)
    assert m["eval/sampled_acc"] == 0.5 and m["eval/sampled_reward"] == pytest.approx(3.5 / 6)
    # an eval.data set scored here: each row scored with its prompt's answer, figures per episode
    scored = []

    class Reward(RewardFn):
        def score(self, batch, reward_prompts):
            scored.append(list(batch.answers))
            return SimpleNamespace(rewards=greedy if len(batch.answers) == 6 else sampled)

    answer = scored_here(lambda prompts, answers, params: batch_of(len(prompts) * params.n * 2), Reward("exact"), True)
    a = answer_set(answer, held, max_new_tokens=8, sampled=SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
    assert scored[0] == ["1", "1", "2", "2", "3", "3"] and scored[1] == ["1"] * 4 + ["2"] * 4 + ["3"] * 4
    out = set_metrics("s", a, RewardFn("exact"))
    assert out["eval/s/greedy_acc"] == pytest.approx(2 / 3)
    assert out["eval/s/pass@2"] == 1.0 and out["eval/s/pass@1"] == pytest.approx(0.5)
    assert out["eval/s/length"] == 4.0 and out["eval/s/truncated"] == 1.0  # an episode: its rows' tokens
