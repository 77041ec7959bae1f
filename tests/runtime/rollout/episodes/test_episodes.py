"""Multi-turn episodes: tool schemas, the token layout of a 3-turn episode (checked position by
position against a scripted engine), environments (loading, failures, their reward), and the tool
sandbox (no network, an empty working folder)."""
from __future__ import annotations

import os
import socket

import pytest
import torch

from rldsl.runtime.batch import RolloutBatch, model_inputs
from rldsl.runtime.config import load_config
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.episodes.env import StepResult, load_env
from rldsl.runtime.rollout.episodes.runner import EpisodeRunner, run_episodes
from rldsl.runtime.rollout.episodes.tools import ToolPool, tool_schema
from rldsl.runtime.errors import ConfigError, EnvironmentFailed
from rldsl.runtime.rollout.multi_turn import check_tools
from rldsl.runtime.rewards.functions import RewardFn
from rldsl.runtime.toy.tool_model import build_tool_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tool_tokenizer()


# ----------------------------------------------------------------------------- tool schemas
def test_schemas_of_three_signatures() -> None:
    from tool_helpers import typed, where
    from rldsl.runtime.toy.calculator import calculator

    assert tool_schema(typed) == {"type": "function", "function": {
        "name": "typed", "description": "A tool with several argument types.",
        "parameters": {"type": "object", "properties": {
            "count": {"type": "integer", "description": "how many"},
            "label": {"type": "string", "description": "a name"},
            "values": {"type": "array", "items": {"type": "number"}, "description": "the numbers"},
            "scale": {"type": "number", "nullable": True, "description": "an optional factor"}},
            "required": ["count", "label", "values"]},
        "return": {"type": "string"}}}
    assert tool_schema(where)["function"]["parameters"] == {"type": "object", "properties": {}}
    calc = tool_schema(calculator)["function"]
    assert calc["name"] == "calculator" and calc["parameters"]["required"] == ["expression"]
    assert calc["parameters"]["properties"]["expression"]["type"] == "string"

    def undocumented(x):
        return x

    with pytest.raises(ConfigError, match="'undocumented' cannot be described"):
        tool_schema(undocumented)


# --------------------------------------------------------------- a 3-turn episode's layout
class ScriptedEngine:
    """Answers turn k of every episode with the ids of ``turns[k]`` followed by EOS, logprob -0.5
    each; records the prompt ids it was given."""

    def __init__(self, tok, turns: list[str]) -> None:
        self.tokenizer, self.turns, self.calls = tok, turns, []

    def generate_ids(self, prompt_ids, params, prompts=None) -> RolloutBatch:
        k = len(self.calls)
        self.calls.append([list(p) for p in prompt_ids])
        B = len(prompt_ids) * params.n
        ids = self.tokenizer(self.turns[k], add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        T = len(ids)
        return RolloutBatch(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long),
                            torch.tensor([ids] * B), torch.ones(B, T, dtype=torch.long), torch.full((B, T), -0.5),
                            ["stop"] * B, [""] * B, [self.turns[k]] * B, params.n)


def test_a_three_turn_episode_token_by_token(tok) -> None:
    """Model tokens: exactly the sampled ids of each turn (mask 1, the engine's logprobs);
    environment tokens: the template's rendering of its messages (mask 0, logprob 0, attended);
    prompt + response decode to the template's rendering of the whole conversation."""
    from episode_helpers import Nudge

    turns = ["12", "345", "6"]
    engine = ScriptedEngine(tok, turns)
    batch = run_episodes(engine, tok, [{"prompt": "1+2+3=", "answer": "6"}], [Nudge(), Nudge()],
                         SamplingParams(n=2, max_new_tokens=8, seed=0), max_turns=5)
    assert batch.finish_reason == ["stop", "stop"] and len(engine.calls) == 3
    eos = tok.eos_token_id
    conv = [{"role": "user", "content": "1+2+3="}, {"role": "assistant", "content": "12"},
            {"role": "user", "content": "again 1"}, {"role": "assistant", "content": "345"},
            {"role": "user", "content": "again 2"}, {"role": "assistant", "content": "6"}]
    prompt = tok(tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]

    def env_part(upto: int) -> list[int]:
        """By hand: the text of the conversation with the next generation prompt, after the model's
        turn ``conv[upto]`` and its sampled EOS: the rest of the template's turn closing, the
        environment's message, the next generation prompt."""
        head = tok.apply_chat_template(conv[:upto], tokenize=False, add_generation_prompt=True)
        head += conv[upto]["content"] + tok.eos_token
        after = tok.apply_chat_template(conv[:upto + 2], tokenize=False, add_generation_prompt=True)
        assert after.startswith(head)
        return tok(after[len(head):], add_special_tokens=False)["input_ids"]

    said = [tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in turns]
    gap1, gap2 = env_part(1), env_part(3)
    assert tok.decode(gap1).startswith("\n<|im_start|>user\nagain 1")
    expected_ids = said[0] + gap1 + said[1] + gap2 + said[2]
    expected_mask = [1] * len(said[0]) + [0] * len(gap1) + [1] * len(said[1]) + [0] * len(gap2) + [1] * len(said[2])
    for i in range(2):
        n = int(batch.response_attention[i].sum())
        assert batch.response_ids[i, :n].tolist() == expected_ids
        assert batch.response_mask[i, :n].tolist() == expected_mask
        assert batch.logprobs[i, :n].tolist() == [-0.5 if m else 0.0 for m in expected_mask]
        assert batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist() == prompt
        whole = tok.decode(prompt + expected_ids, skip_special_tokens=False)
        assert whole + "\n" == tok.apply_chat_template(conv, tokenize=False)
        assert batch.episodes[i].env_reward == 1.0
        assert [m["role"] for m in batch.episodes[i].messages] == [m["role"] for m in conv]
    # turn k is sampled from exactly the ids so far: prompt + the previous turns' ids, no re-encoding
    assert engine.calls[1] == [prompt + said[0] + gap1] * 2
    assert engine.calls[2] == [prompt + expected_ids[:-len(said[2])]] * 2
    # the trainer attends to every real token, trains on the model's only
    ids, attn, _ = model_inputs(batch)
    assert attn[:, batch.prompt_ids.shape[1]:].sum().item() == 2 * len(expected_ids)
    assert batch.response_mask.sum().item() == 2 * sum(len(s) for s in said)


def test_max_turns_ends_an_episode_that_is_not_done(tok) -> None:
    from episode_helpers import Nudge

    engine = ScriptedEngine(tok, ["1", "2", "3"])
    batch = run_episodes(engine, tok, [{"prompt": "x", "answer": ""}], [Nudge()], SamplingParams(n=1),
                         max_turns=2)
    assert batch.finish_reason == ["length"] and len(engine.calls) == 2
    assert batch.episodes[0].env_reward is None


# ------------------------------------------------------------------------------ environments
def test_load_env_checks_the_class() -> None:
    from episode_helpers import Nudge

    assert load_env("episode_helpers:Nudge") is Nudge
    with pytest.raises(ConfigError, match="no step method"):
        load_env("episode_helpers:NoStep")
    with pytest.raises(ConfigError, match="constructible without arguments"):
        load_env("episode_helpers:NeedsArguments")
    with pytest.raises(ConfigError, match="not a class"):
        load_env("episode_helpers:not_a_class")
    with pytest.raises(ConfigError, match="environment 'no_such_module:Env': cannot import"):
        load_env("no_such_module:Env")
    with pytest.raises(ConfigError, match="has no class 'Missing'; its classes: "):
        load_env("episode_helpers:Missing")
    with pytest.raises(ConfigError, match="exclusive"):
        check_tools(load_config(None, ["rollout.env=episode_helpers:Nudge", "rollout.tools=tool_helpers:where"]))
    check_tools(load_config(None, ["rollout.env=episode_helpers:Nudge"]))


@pytest.mark.parametrize("name, message", [("StepRaises", "StepRaises.step raised KeyError: 'the world broke'"),
                                           ("StepAnswersNonsense", "must return \\(messages, reward, done\\)"),
                                           ("StepRewardsText", "environment StepRewardsText.step returned '1.0' "
                                                               "\\(a str\\), not a number: text is not a score")])
def test_a_broken_environment_is_a_clear_run_error(tok, name, message) -> None:
    runner = EpisodeRunner([], env_class=load_env(f"episode_helpers:{name}"), max_turns=3)
    engine = ScriptedEngine(tok, ["1", "2", "3"])
    with pytest.raises(EnvironmentFailed, match=message) as e:
        runner.run(engine, ["x"], [""], SamplingParams(n=1))
    assert e.value.exit_code == 1


def test_env_reward_term_reads_the_episodes_weighted(tok) -> None:
    from episode_helpers import Nudge

    batch = run_episodes(ScriptedEngine(tok, ["6", "6", "6"]), tok, [{"prompt": "x", "answer": "6"}],
                         [Nudge(), Nudge()], SamplingParams(n=2), max_turns=3)
    batch.answers = ["6", "6"]
    out = RewardFn("env=1,exact=0.5").score(batch)
    assert out.rewards.tolist() == [1.5, 1.5]  # env 1.0 + 0.5 * exact("6" == "6")
    assert out.components["env"].tolist() == [1.0, 1.0]
    single = RewardFn("env", on_error="skip").score(RolloutBatch(
        torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
        torch.ones(1, 1, dtype=torch.long), torch.zeros(1, 1), ["stop"], ["x"], ["y"], 1, answers=[""]))
    assert single.num_errors == 1 and "needs multi-turn episodes" in single.first_error
    assert StepResult().done is False


# ---------------------------------------------------------------------------- the sandbox
@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="a network namespace of its own needs the privilege (root)")
def test_a_tool_has_no_network_no_run_folder_and_an_empty_working_folder(tmp_path) -> None:
    from tool_helpers import dial, peek, where

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from the test itself
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.bin").write_text("the run's files")
    runner = ToolPool()
    runner.hide(run_dir)
    try:
        out = runner.run_many([(dial, {"port": port}), (where, {}), (peek, {"folder": str(run_dir)}),
                               (peek, {"folder": str(tmp_path)})], timeout_s=60, max_output_chars=500)
    finally:
        runner.close()
        server.close()
    assert out[0].startswith("error: OSError") and "unreachable" in out[0]
    folder, listing = out[1].split(" ", 1)
    assert "rldsl-tool-" in folder and listing == "[]" and folder != os.getcwd()
    assert out[2] == "[]" and out[3] == "['run']"  # the run folder is there, empty; its files are not
    assert (run_dir / "checkpoint.bin").read_text() == "the run's files"  # hidden, not touched


def test_episodes_need_a_chat_template_and_say_so_before_the_model_loads(model_dir, tmp_path, monkeypatch) -> None:
    """The toy tokenizer has no chat template: a --tools run is refused while planning (exit 2)."""
    from rldsl.runtime.run.plan import load_spec, plan_run

    monkeypatch.setattr("rldsl.runtime.models.loading.load_policy",
                        lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = load_config(None, [f"model.path={model_dir}", f"out={tmp_path / 'run'}", "rollout.tools=tool_helpers:echo"])
    with pytest.raises(ConfigError, match="need a tokenizer with a chat template") as e:
        plan_run(load_spec("grpo"), cfg)
    assert e.value.exit_code == 2
