"""Per-turn rewards of multi-turn episodes (`rewards dense`): each environment step's reward on the
last token of the model's turn it answered, in a 3-turn episode; what a dense spec's estimate()
makes of them; the `env` term sums them; and the bad inputs refused with their reasons."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rldsl
from rldsl.runtime.batch import AgentRow, Episode, RolloutBatch
from rldsl.runtime.errors import ConfigError, RunError
from rldsl.runtime.rewards.functions import RewardFn
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.episodes.runner import run_episodes
from rldsl.runtime.toy.tool_model import build_tool_tokenizer
from rldsl.runtime.train import inputs as producers

SPECS = Path(__file__).resolve().parents[3] / "specs"  # tests/specs

DENSE = """
algorithm reinforce_dense extends reinforce
  "Return-to-go of per-turn rewards."
  rewards   dense
  baseline  return_to_go(gamma=1.0)
"""


@pytest.fixture(scope="module")
def tok():
    return build_tool_tokenizer()


def _side(terms, step=1):
    return producers.RolloutSide(None, terms, 8, lambda m: None, step, multi_turn=True)


def test_turn_rewards_land_on_the_last_token_of_their_turn(tok):
    from episode_helpers import TurnRewards
    from test_episodes import ScriptedEngine

    turns = ["12", "345", "6"]
    batch = run_episodes(ScriptedEngine(tok, turns), tok, [{"prompt": "1+2+3=", "answer": "6"}],
                         [TurnRewards(), TurnRewards()], SamplingParams(n=2, max_new_tokens=8, seed=0), max_turns=5)
    assert batch.finish_reason == ["stop", "stop"]
    mask = batch.response_mask[0].tolist()
    n = int(batch.response_attention[0].sum())
    # the model's turns: the runs of 1s in the mask; the last token of each is its sampled EOS
    ends = [t for t in range(n) if mask[t] == 1 and (t + 1 == n or mask[t + 1] == 0)]
    assert len(ends) == 3 and all(batch.response_ids[0, t] == tok.eos_token_id for t in ends)
    ep = batch.episodes[0]
    assert ep.step_rewards == [[ends[0], 0.5], [ends[2], 2.0]]  # the second turn had none
    assert ep.env_reward == 2.5  # the env term: their sum
    batch.answers = ["6", "6"]
    scored = RewardFn("env=2,exact=0.5").score(batch)
    assert scored.rewards.tolist() == [5.5, 5.5]  # 2 * 2.5 + 0.5 * exact("6" is the answer)
    made, _ = producers.per_turn_rewards(_side([("env", 2.0), ("exact", 0.5)]), batch, scored, [])
    dense = made.inputs["dense_rewards"]
    assert dense.shape == batch.response_ids.shape
    want = torch.zeros_like(dense)
    want[:, ends[0]], want[:, ends[2]] = 1.0, 4.0  # weight 2 x the step rewards
    assert torch.equal(dense, want)
    # a dense spec: the turn rewards where they landed, the rest of the reward (exact's 0.5 here:
    # the completion "6" is the answer) on the last token; return-to-go sums what is ahead
    fn = rldsl.compile(rldsl.loads(DENSE), compile=False)
    est = fn.estimate(scored.rewards, 2, batch.response_mask.float(), dense_rewards=dense)
    m = batch.response_mask[0].float()
    to_go = torch.tensor([5.5 if t <= ends[0] else 4.5 if t <= ends[2] else 0.0 for t in range(dense.shape[1])])
    torch.testing.assert_close(est.advantages[0], to_go * m)


def test_concat_pads_the_dense_rewards_of_shorter_batches():
    def one(T, v):
        b = RolloutBatch(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long),
                         torch.zeros(1, T, dtype=torch.long), torch.ones(1, T, dtype=torch.long), torch.zeros(1, T),
                         ["stop"], ["p"], ["c"], 1)
        b.inputs["dense_rewards"] = torch.full((1, T), v)
        return b
    out = RolloutBatch.concat([one(2, 1.0), one(4, 2.0)], pad_id=0)
    assert out.inputs["dense_rewards"].tolist() == [[1.0, 1.0, 0.0, 0.0], [2.0] * 4]


def test_dense_rewards_without_turns_are_refused():
    algo = rldsl.loads(DENSE)
    with pytest.raises(ConfigError, match="no term of the reward 'math' gives any: the `env` term does"):
        producers.check_rollout_inputs(algo, [("math", 1.0)], multi_turn=True)
    with pytest.raises(ConfigError, match="the rollout is single-turn: a row without turns has no per-turn reward"):
        producers.check_rollout_inputs(algo, [("env", 1.0)], multi_turn=False)
    producers.check_rollout_inputs(algo, [("env", 1.0)], multi_turn=True)
    producers.check_rollout_inputs(rldsl.load("reinforce"), [("math", 1.0)], multi_turn=False)  # outcome: fine
    single = RolloutBatch(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long),
                          torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), torch.zeros(1, 2),
                          ["stop"], ["p"], ["c"], 1)
    scored = RewardFn("exact").score(RolloutBatch(**{**single.__dict__, "answers": ["c"]}))
    with pytest.raises(RunError, match="sample 0 has no turns with rewards of their own \\(a single-turn sample\\)"):
        producers.per_turn_rewards(_side([("env", 1.0)]), single, scored, [])
    agent = RolloutBatch(**{**single.__dict__, "episodes": [Episode([], 1.0, agent=AgentRow())]})
    with pytest.raises(RunError, match="an agent's episode gives one reward"):
        producers.per_turn_rewards(_side([("env", 1.0)]), agent, scored, [])


@pytest.mark.slow
def test_a_three_step_run_of_token_level_gae_on_env_step_rewards(tmp_path):
    """rollout.env=CalcSteps (0.25 for each tool-calling turn, 1 for a right final answer) with
    --reward env and a `rewards dense` PPO spec (GAE with a critic on the token rewards): three
    steps of tests/specs/good/ppo_turns.rl, the per-turn rewards reach the advantage, the loss and value loss are finite."""
    import json
    import math

    from rldsl.runtime.config import load_config
    from rldsl.runtime.records.metrics import read_metrics
    from rldsl.runtime.run import loop
    from rldsl.runtime.toy.calculator import SumTask, TeacherMix
    from rldsl.runtime.toy.tool_model import tool_model_config
    from rldsl.runtime.toy.tool_warmup import ToolWarmStartConfig, tool_warm_start

    torch.set_num_threads(1)
    small = tool_model_config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    model = tool_warm_start(ToolWarmStartConfig(steps=120, batch_size=16, lr=3e-3, mix=TeacherMix(call=1.0),
                                                task=SumTask(num_train=500, num_validation=10)),
                            model_config=small, cache=tmp_path / "cache")
    spec = SPECS / "good" / "ppo_turns.rl"  # rewards dense on ppo
    cfg = load_config(None, [f"model.path={model}", f"out={tmp_path / 'run'}", "data.task=calculator",
                             "rollout.env=episode_helpers:CalcSteps", "reward.name=env",
                             "rollout.prompts_per_step=2", "rollout.n=2", "train.steps=3", "eval.every=0",
                             "eval.samples=0", "data.eval_size=4", "checkpoint.every=0", "log.progress=false",
                             "log.samples_per_step=4"])
    run = loop.train(str(spec), cfg)
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["reward_errors"] == 0 and math.isfinite(r["loss"]) and math.isfinite(r["value_loss"])
               for r in steps)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    stepped = [s for s in samples if any(m["role"] == "tool" for m in s["messages"])]
    assert stepped, "no episode called a tool: the per-turn rewards were never exercised"
    for s in samples:  # the env term is the sum of the step rewards
        assert s["reward"] == pytest.approx(s["env_reward"] if s["env_reward"] is not None else 0.0)
    assert any(s["env_reward"] % 1 != 0 for s in stepped)  # a 0.25 step reward is in a sum


# ------------------------------------------------------------- a process reward model's steps
@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    """A random sequence-classification model on the toy's tokenizer (one character per token)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    from rldsl.runtime import toy
    tok = toy.build_tokenizer()
    path = tmp_path_factory.mktemp("prm")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _single_turn(tok, prompts, completions):
    ids = [tok(c, add_special_tokens=False)["input_ids"] for c in completions]
    T = max(len(x) for x in ids)
    r_ids = torch.full((len(ids), T), tok.pad_token_id)
    r_mask = torch.zeros(len(ids), T, dtype=torch.long)
    for i, x in enumerate(ids):
        r_ids[i, :len(x)], r_mask[i, :len(x)] = torch.tensor(x), 1
    B = len(ids)
    return RolloutBatch(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long), r_ids, r_mask,
                        torch.zeros(B, T), ["stop"] * B, list(prompts), list(completions), 1, answers=[""] * B)


def test_a_process_reward_scores_each_step_where_it_ends(prm_dir):
    from rldsl.runtime import toy
    from rldsl.runtime.rewards.model import separator

    assert separator("\\n\\n") == "\n\n"
    tok = toy.build_tokenizer()
    fn = RewardFn(f"rm:{prm_dir}(step_separator=+,batch_size=2)")
    plain = RewardFn(f"rm:{prm_dir}").terms[0].fn
    prompts, completions = ["1+2=", "3+4=", "5+6="], ["12+34+5", "7+", "11+0"]
    batch = _single_turn(tok, prompts, completions)
    scored = fn.score(batch)
    name = fn.terms[0].name
    steps = scored.steps[name]
    assert [[e for e, _ in s] for s in steps] == [[3, 6, 7], [2], [3, 4]]  # after each '+', and the end
    for p, c, s in zip(prompts, completions, steps):
        # step k's score: the model's score of the text up to the step's end (causal attention)
        assert [v for _, v in s] == pytest.approx([plain(p, c[:int(e)], "") for e, _ in s], abs=1e-5)
    assert scored.rewards.tolist() == pytest.approx([sum(v for _, v in s) for s in steps], abs=1e-6)
    made, _ = producers.per_turn_rewards(producers.RolloutSide(
        None, [(name, 0.5)], 8, lambda m: None, 1, tokenizer=tok), batch, scored, [])
    dense = made.inputs["dense_rewards"]
    want = torch.zeros_like(dense)
    for i, s in enumerate(steps):
        for e, v in s:
            want[i, int(e) - 1] += 0.5 * v  # one character per token: step end e is token e - 1
    torch.testing.assert_close(dense, want)
    # a dense spec puts nothing else anywhere: the steps sum to the reward
    rewards = 0.5 * scored.rewards.float()  # as the trainer takes them (Trainer.estimate: float32)
    est = rldsl.compile(rldsl.loads(DENSE), compile=False).estimate(rewards, 1, batch.response_mask.float(),
                                                                     dense_rewards=dense)
    torch.testing.assert_close(est.advantages[:, 0], rewards)


def test_a_step_separator_never_found_is_an_error(prm_dir):
    from rldsl.runtime import toy
    from rldsl.runtime.errors import RewardError

    tok = toy.build_tokenizer()
    batch = _single_turn(tok, ["1+2=", "3+4="], ["3", "7+1"])
    with pytest.raises(RewardError, match=r"failed on sample 0: ValueError: no step separator '\+' in the completion"):
        RewardFn(f"rm:{prm_dir}(step_separator=+)").score(batch)
    skipped = RewardFn(f"rm:{prm_dir}(step_separator=+)", on_error="skip").score(batch)
    assert skipped.num_errors == 1 and torch.isnan(skipped.rewards[0]) and torch.isfinite(skipped.rewards[1])
    name = f"rm:{prm_dir}(step_separator=+)"
    made, _ = producers.per_turn_rewards(producers.RolloutSide(None, [(name, 1.0)], 8, lambda m: None, 1,
                                                               tokenizer=tok), batch, skipped, [])
    assert made.inputs["dense_rewards"][0].abs().sum() == 0  # the failed row gets none, and leaves the loss
    with pytest.raises(ValueError, match="option 'step_separator=' is not key=value"):
        RewardFn(f"rm:{prm_dir}(step_separator=)")  # an empty separator is no option at all
    algo = rldsl.loads(DENSE)
    producers.check_rollout_inputs(algo, [(name, 1.0)], multi_turn=False)
    with pytest.raises(ConfigError, match="step scores are placed on single-turn completions only"):
        producers.check_rollout_inputs(algo, [(name, 1.0)], multi_turn=True)


def test_a_dense_run_without_per_turn_rewards_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from rldsl.runtime.config import load_config
    from rldsl.runtime.run import loop

    spec = str(SPECS / "good" / "ppo_turns.rl")
    loaded = []
    monkeypatch.setattr(loop, "build", lambda *a, **k: loaded.append(1))  # never reached
    base = [f"out={tmp_path / 'run'}", "train.steps=1", "log.progress=false"]
    with pytest.raises(ConfigError, match="no term of the reward 'addition' gives any") as e:
        loop.train(spec, load_config(None, base))
    assert e.value.exit_code == 2
    with pytest.raises(ConfigError, match="the rollout is single-turn"):
        loop.train(spec, load_config(None, base + ["reward.name=env"]))
    assert not loaded and not (tmp_path / "run").exists()


def test_step_ends_map_to_the_token_that_holds_their_last_character(real_model):
    """With a byte-level BPE tokenizer (tokens of several characters; the real-shaped fixture's):
    each step's end lands on the token whose text holds the step's last character (the fast
    tokenizer's offsets say which)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(real_model("qwen2.5")))
    text = "First add 12 and 3.\n\nThen 15 times 2 is 30.\n\nSo the answer is 30"
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert len(enc["input_ids"]) < len(text)  # multi-character tokens
    batch = _single_turn(tok, ["q"], [text])
    assert tok.decode(enc["input_ids"]) == text
    ends = [text.index("\n\n") + 2, text.rindex("\n\n") + 2, len(text)]
    got = producers.step_tokens(tok, batch, 0, ends)
    want = [next(k for k, (a, b) in enumerate(enc["offset_mapping"]) if a < e <= b) for e in ends]
    assert got == want and got == sorted(got) and got[-1] == len(enc["input_ids"]) - 1
