"""rollout.env = verifiers:... / openenv:...: environments of other libraries run against the
policy's endpoint. verifiers' own training client renders the chat to ids and calls the token
route; its rubric gives the reward. OpenEnv servers (started here from openenv-core's own server
classes) are driven through EnvClient. Bad input: a missing library, a server down at start or
dying mid-episode -- a clear error before the model loads, or a recorded failed episode."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rldsl.runtime.config import load_config
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.rollout.multi_turn import check_tools

pytest.importorskip("openai")


def _train(tool_model: Path, out: Path, env: str, *extra: str) -> Path:
    from rldsl.runtime.run import loop

    cfg = load_config(None, [f"model.path={tool_model}", f"out={out}", f"rollout.env={env}",
                             "rollout.prompts_per_step=2", "rollout.n=2", "train.steps=1", "eval.every=0",
                             "checkpoint.every=0", "log.progress=false", "log.samples_per_step=4",
                             "data.eval_size=0", "rollout.agent_timeout_s=120", "rollout.max_new_tokens=24", *extra])
    return loop.train("grpo", cfg)


def _records(run: Path) -> tuple[list[dict], list[dict]]:
    from rldsl.runtime.records.metrics import read_metrics

    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    return steps, samples


#: the episodes on a Ray rollout worker (the endpoint there), a LoRA policy, micro-batches
RAY_LORA_MICRO = ("distributed.rollout_workers=1", "model.lora.rank=4", "train.max_tokens_per_microbatch=64")
#: one episode at a time: concurrent episodes' requests are batched as they arrive, each engine
#: call its own seed, so which episode draws which sample changes with the machine's load; a test
#: that needs a tool call among its few episodes plays them one at a time, the same on every run
ONE_AT_A_TIME = ("rollout.agent_concurrency=1",)


# ------------------------------------------------------------------------------ verifiers
@pytest.mark.slow
@pytest.mark.parametrize("taskset, rewards, extra", [
    ("vf_sum_single", {0.25, 1.0}, ()),
    ("vf_sum_single", {0.25, 1.0}, ("rollout.max_staleness=1",)),  # rollouts in the producer's thread
    ("vf_sum_tools", {0.125, 0.5, 1.0}, ONE_AT_A_TIME),
    ("vf_sum_tools", {0.125, 0.5, 1.0}, RAY_LORA_MICRO + ONE_AT_A_TIME)],
    ids=["single-turn", "single-turn async", "tools", "tools on a ray rollout worker, lora, micro-batches"])
def test_a_verifiers_environment_trains_with_its_own_rubric(tool_model, tmp_path, taskset, rewards,
                                                            extra) -> None:
    """--env verifiers:<taskset>: the taskset's tasks are the rows, verifiers' training client
    sends token ids to the endpoint (route "generate"), the rubric's reward (values no rldsl reward
    gives) reaches metrics and samples; the tool env's calls are bridged by verifiers' renderer
    into one row per episode."""
    pytest.importorskip("verifiers")
    run = _train(tool_model, tmp_path / "run", f"verifiers:{taskset}", *extra)
    steps, samples = _records(run)
    assert len(steps) == 1 and steps[0]["reward_errors"] == 0 and steps[0]["agent/errors"] == 0
    assert len(samples) == 4
    assert {s["reward"] for s in samples} <= rewards
    for s in samples:
        assert s["env_reward"] == s["reward"] and s["agent"]["error"] is None
        assert {c["route"] for c in s["agent"]["calls"]} == {"generate"}  # token ids in, token ids out
        assert s["prompt"].startswith("<|im_start|>")  # what the engine saw: the renderer's ids
    if taskset == "vf_sum_tools":
        assert "<tools>calculator</tools>" in samples[0]["prompt"]
        assert steps[0]["agent/rows_per_episode"] == 1 and steps[0]["agent/prefix_breaks"] == 0
        assert any(len(s["agent"]["calls"]) == 2 for s in samples)  # the call, then the answer


@pytest.mark.slow  # a server held for seconds (docs/testing.md, the slow marker)
def test_verifiers_rows_are_the_tasksets_tasks() -> None:
    pytest.importorskip("verifiers")
    from rldsl.runtime.rollout.agents.environments import verifiers_examples

    rows = verifiers_examples("verifiers:vf_sum_single")
    assert [(r.prompt, r.answer) for r in rows[:2]] == [("1+2=", "0"), ("2+3=", "1")]
    # the episode gets the row's task, by its index, under that name (an agent's row has answer)
    from rldsl.runtime.rollout.agents.environments import environment_runner

    runner = environment_runner(load_config(None, ["rollout.env=verifiers:vf_sum_single"]), "models/tiny", None)
    assert runner.row(rows[1].prompt, rows[1].answer) == {"prompt": "2+3=", "task": "1", "model": "tiny"}
    with pytest.raises(ConfigError, match="takes its rows from the taskset"):
        check_tools(load_config(None, ["rollout.env=verifiers:vf_sum_single", "data.path=x.jsonl"]))
    with pytest.raises(ConfigError, match="cannot be loaded.*no_such_taskset"):
        check_tools(load_config(None, ["rollout.env=verifiers:no_such_taskset"]))


@pytest.mark.parametrize("library, module, package", [("verifiers", "verifiers", "verifiers"),
                                                      ("openenv", "openenv", "openenv-core")])
def test_a_missing_library_names_the_extra_before_the_model_loads(monkeypatch, library, module, package) -> None:
    monkeypatch.setitem(__import__("sys").modules, module, None)  # import -> ImportError
    target = "vf_sum_single" if library == "verifiers" else "http://127.0.0.1:9"
    with pytest.raises(ConfigError, match=rf"needs the '{package}' package.*pip install 'rldsl\[agents\]'"):
        check_tools(load_config(None, [f"rollout.env={library}:{target}"]))


# -------------------------------------------------------------------------------- OpenEnv
@pytest.fixture()
def openenv_server():
    """``openenv_server(kind, sessions=64)`` -> the URL of a server of openenv_helpers.py (``sessions``:
    its max_concurrent_envs, "default" for openenv-core's own), killed after the test."""
    pytest.importorskip("openenv")
    from contextlib import ExitStack

    from openenv_helpers import Server

    with ExitStack() as stack:
        yield lambda kind, sessions=64: stack.enter_context(Server(kind, sessions))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), RAY_LORA_MICRO], ids=["one process", "ray rollout worker, lora, micro-batches"])
def test_an_openenv_text_environment_trains_with_its_own_reward(tool_model, tmp_path,
                                                                openenv_server, extra) -> None:
    """--env openenv:<url>: the reset observation is the user message (after data.system_prompt),
    each reply is sent as the action's one text field (`message`, from /schema), the environment's
    rewards (1.0 / 0.25 a reply, summed) are the episode's reward; replies until `done` (two here)."""
    url = openenv_server("text")
    run = _train(tool_model, tmp_path / "run", f"openenv:{url}", "data.task=calculator", "data.system_prompt=Sum.",
                 *extra)
    steps, samples = _records(run)
    assert steps[0]["reward_errors"] == 0 and steps[0]["agent/errors"] == 0
    for s in samples:
        assert s["messages"][:2] == [{"role": "system", "content": "Sum.", "trained": False},
                                     {"role": "user", "content": "12+34=", "trained": False}]
        assert s["reward"] in (0.5, 1.0, 1.25) and s["env_reward"] == s["reward"]
        assert [m["role"] for m in s["messages"]][1:3] == ["user", "assistant"]
        assert {c["route"] for c in s["agent"]["calls"]} == {"chat"}


@pytest.mark.slow
def test_an_openenv_mcp_environment_calls_its_tools_through_mcp(tool_model, tmp_path,
                                                               openenv_server) -> None:
    """--env openenv:mcp@<url>: the environment's MCP tools are the model's tools (rendered by the
    chat template), each call runs as a CallToolAction step, its result is the tool message and
    its reward counts; the row's prompt opens the episode (the reset observation has no text).
    One episode at a time: the endpoint batches concurrent requests as they arrive, each engine
    call its own seed, so concurrent episodes' samples change with the machine's load (a malformed
    call here, a good one there); one at a time, every run samples the same."""
    url = openenv_server("mcp")
    run = _train(tool_model, tmp_path / "run", f"openenv:mcp@{url}", "data.task=calculator", *ONE_AT_A_TIME)
    steps, samples = _records(run)
    assert steps[0]["reward_errors"] == 0 and steps[0]["agent/errors"] == 0
    assert steps[0]["tool_calls/per_episode"] >= 1 and steps[0]["agent/prefix_breaks"] == 0
    assert all("<tools>calculator</tools>" in s["prompt"] for s in samples)
    for s in samples:  # an episode without a call the environment ran scores 0 (not an error)
        ran = any(m.get("tool_calls") for m in s["messages"])
        assert s["env_reward"] == s["reward"] and (ran or s["reward"] == 0.0)
    called = [s for s in samples if any(m["role"] == "tool" for m in s["messages"])]
    assert called and all(s["reward"] >= 1.0 for s in called)
    tool = next(m for m in called[0]["messages"] if m["role"] == "tool")
    call = next(m for m in called[0]["messages"] if m.get("tool_calls"))["tool_calls"][0]["function"]
    expression = call["arguments"]["expression"]
    if all(t.isdigit() for t in expression.split("+")):  # the MCP tool's own answer
        assert tool["content"] == str(sum(int(t) for t in expression.split("+")))


def _reply(content: str, *calls: tuple[str, str]):
    """A chat completion: an assistant message of ``content`` and the tool calls ``(name,
    arguments)`` (ids ``call0``, ``call1``...), as the endpoint answers."""
    from openai.types.chat import ChatCompletion

    tool_calls = [{"id": f"call{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
                  for i, (name, arguments) in enumerate(calls)]
    return ChatCompletion.model_validate({
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop",
                     "message": {"role": "assistant", "content": content, "tool_calls": tool_calls or None}}]})


class _Replies:
    """An OpenAI client whose chat calls answer ``replies`` in order; ``sent``: each call's
    (messages, tools)."""

    def __init__(self, *replies) -> None:
        from types import SimpleNamespace

        self.replies, self.sent = list(replies), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))

    async def _create(self, *, model: str, messages: list[dict], **kw):
        self.sent.append(([dict(m) for m in messages], kw.get("tools")))
        return self.replies.pop(0)


@pytest.mark.slow  # servers held for seconds
def test_an_mcp_episode_has_a_reward_or_an_error_whatever_the_model_replies(openenv_server) -> None:
    """The MCP episode of every reply a sampling policy gives: a call the parser could not read
    (no tool call: the episode ends) or arguments that are not JSON run no step and score 0, not
    None (which stopped the run: "the agent returned None"); a call that runs scores its reward;
    steps that ran unrewarded, or tools that could not be listed, are the episode's error."""
    import asyncio

    from rldsl.runtime.rollout.agents.environments import openenv_agent

    def play(url: str, *replies):
        model = _Replies(*replies)
        agent = openenv_agent(f"openenv:mcp@{url}", timeout_s=30, max_calls=4)
        return asyncio.run(agent(model, {"prompt": "12+34=", "model": "m"})), model.sent

    url = openenv_server("mcp")
    reward, sent = play(url, _reply('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+'))
    assert reward == 0.0 and [t["function"]["name"] for t in sent[0][1]] == ["calculator"]
    reward, sent = play(url, _reply("", ("calculator", "{12+34")), _reply("46"))
    assert reward == 0.0 and sent[1][0][-1]["content"].startswith("error: the arguments are not JSON")
    reward, sent = play(url, _reply("", ("calculator", '{"expression": "12+34"}')), _reply("46"))
    assert reward == 1.0 and sent[1][0][-1] == {"role": "tool", "tool_call_id": "call0", "content": "46"}
    with pytest.raises(RuntimeError, match=r"reported no reward in this episode's 1 step \(every"):
        play(openenv_server("mcp_unrewarded"), _reply("", ("calculator", '{"expression": "1+2"}')), _reply("3"))
    with pytest.raises(RuntimeError, match="listed no tools"):
        play(openenv_server("mcp_no_tools"), _reply("46"))


def test_an_openenv_server_down_at_start_is_refused_before_the_model_loads() -> None:
    pytest.importorskip("openenv")
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"OpenEnv server at http://127.0.0.1:{port} is not reachable"):
        check_tools(load_config(None, [f"rollout.env=openenv:http://127.0.0.1:{port}"]))
    with pytest.raises(ConfigError, match="must start with http://"):
        check_tools(load_config(None, ["rollout.env=openenv:localhost:8000"]))


@pytest.mark.slow
@pytest.mark.parametrize("kind, error", [("dies", "the environment's episode raised ConnectionClosedError"),
                                         ("hangs", "the environment's episode ran past its time limit of 3 s")])
def test_a_server_that_dies_or_hangs_mid_episode_gives_failed_episodes(tool_model, openenv_server, kind,
                                                                        error) -> None:
    """The server exits (or never answers) on the first step: every episode ends with its error
    recorded, within the episode's time limit; the batch is still made."""
    import time

    from transformers import AutoTokenizer, LlamaForCausalLM

    from rldsl.runtime.rollout.agents.environments import environment_runner
    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.rollout.engines.hf import HFEngine

    url = openenv_server(kind)
    # the hanging server must meet the 3 s limit; the dying one ends the episode by itself, so its
    # limit is one a loaded machine's model call cannot reach (else the error would be the limit's)
    cfg = load_config(None, [f"rollout.env=openenv:{url}", f"rollout.agent_timeout_s={3 if kind == 'hangs' else 60}"])
    runner = environment_runner(cfg, tool_model, 256)
    engine = HFEngine(LlamaForCausalLM.from_pretrained(tool_model).eval(), AutoTokenizer.from_pretrained(tool_model))
    start = time.monotonic()
    try:
        batch = runner.run(engine, ["12+34="], ["46"], SamplingParams(n=2, max_new_tokens=8, seed=0))
    finally:
        runner.close()
    assert time.monotonic() - start < 30
    assert len(batch) == 2 and all(error in e.error for e in batch.episodes), [e.error for e in batch.episodes]


@pytest.fixture(scope="module")
def limited_server():
    """``limited_server(sessions)`` -> the URL of a text environment server whose session limit is
    ``sessions`` ("default": openenv-core's own, one), started once for the module (a server takes
    seconds to start), its session counts zeroed for each test."""
    pytest.importorskip("openenv")
    from contextlib import ExitStack

    import httpx

    with ExitStack() as stack:
        urls: dict = {}

        def get(sessions: int | str) -> str:
            from openenv_helpers import Server

            if sessions not in urls:
                urls[sessions] = stack.enter_context(Server("text", sessions))
            httpx.delete(f"{urls[sessions]}/test/sessions", timeout=5).raise_for_status()
            return urls[sessions]

        yield get


def _stand_in_runner(url: str, *extra: str):
    """The environment runner of ``openenv:<url>`` and a stand-in policy that answers "46" (the
    text environment's answer: reward 1.0, done after one reply)."""
    from test_agents import Scripted

    from rldsl.runtime.rollout.agents.environments import environment_runner
    from rldsl.runtime.toy.tool_model import build_tool_tokenizer

    cfg = load_config(None, [f"rollout.env=openenv:{url}", *extra])
    return environment_runner(cfg, "toy", 128), Scripted(build_tool_tokenizer(), ["46"])


def _episodes(runner, policy, n: int = 8) -> list:
    from rldsl.runtime.rollout.engines.base import SamplingParams

    return runner.run(policy, ["12+34="], ["46"], SamplingParams(n=n, max_new_tokens=8, seed=0)).episodes


def _sessions(url: str) -> dict:
    """The test server's session counts (openenv_helpers.py)."""
    import httpx

    return httpx.get(f"{url}/test/sessions", timeout=5).json()


@pytest.mark.slow
@pytest.mark.parametrize("sessions, limit", [("default", 1), (4, 4)], ids=["openenv-core's default", "4 sessions"])
def test_an_openenv_server_with_a_session_limit_plays_every_episode(limited_server, sessions, limit) -> None:
    """openenv-core's server with its own default session limit (one; max_concurrent_envs not
    passed), and one allowing 4: 8 episodes at once (rollout.agent_concurrency 64) all complete.
    The sessions past the limit are refused (CAPACITY_REACHED) and retried; the first refusal
    tells the runner the server's limit, which it keeps to from then on: a second batch asks for
    no more sessions at once than the server allows."""
    url = limited_server(sessions)
    runner, policy = _stand_in_runner(url, "rollout.agent_timeout_s=30")
    try:
        first = _episodes(runner, policy)
        counts = _sessions(url)
        assert [e.error for e in first] == [None] * 8
        assert [e.env_reward for e in first] == [1.0] * 8
        assert counts["opened"] == 8 and counts["peak"] == limit
        assert counts["connections"] > 8  # refused ones, retried
        assert runner.sessions.limit == runner.sessions.server_limit == limit

        runner.sessions.peak = 0
        second = _episodes(runner, policy)
    finally:
        runner.close()
    assert [e.error for e in second] == [None] * 8
    assert runner.sessions.peak == limit  # sessions asked for at once: the server's limit, no more
    assert _sessions(url)["opened"] == 16


@pytest.mark.slow  # a server held for seconds (docs/testing.md, the slow marker)
def test_rollout_env_concurrency_caps_the_sessions_asked_for(limited_server) -> None:
    """rollout.env_concurrency = 2 against a server allowing 4: never more than 2 sessions at once,
    none refused."""
    url = limited_server(4)
    runner, policy = _stand_in_runner(url, "rollout.env_concurrency=2")
    try:
        episodes = _episodes(runner, policy)
    finally:
        runner.close()
    assert [e.error for e in episodes] == [None] * 8
    assert _sessions(url) == {"live": 0, "peak": 2, "opened": 8, "connections": 8}
    assert runner.sessions.peak == 2


@pytest.mark.slow  # a server held for seconds (docs/testing.md, the slow marker)
@pytest.mark.parametrize("held_s", [0.5, None], ids=["released after 0.5 s", "never released"])
def test_a_session_refused_while_another_client_holds_the_server_is_retried(limited_server, held_s) -> None:
    """Another client holds the only session of a server with openenv-core's default limit: the
    episodes' sessions are refused and retried with back-off; once it lets go they play. Held
    past rollout.agent_timeout_s (2 s) of retries, each episode ends with an error naming the
    server's limit and rollout.env_concurrency, in bounded time."""
    import threading
    import time
    from contextlib import ExitStack

    from websockets.sync.client import connect

    url = limited_server("default")
    with ExitStack() as connections:
        for _ in range(20):  # the previous test's last session may still be closing
            holder = connections.enter_context(connect(url.replace("http://", "ws://") + "/ws", open_timeout=5))
            holder.send(json.dumps({"type": "reset", "data": {}}))
            if json.loads(holder.recv(timeout=5))["type"] == "observation":
                break
            holder.close()
            time.sleep(0.1)
        assert _sessions(url)["live"] == 1  # the server's one session, taken
        if held_s is not None:
            threading.Timer(held_s, holder.close).start()
        runner, policy = _stand_in_runner(url, "rollout.agent_timeout_s=2")
        start = time.monotonic()
        try:
            episodes = _episodes(runner, policy, n=2)
        finally:
            runner.close()
    assert time.monotonic() - start < 20
    counts = _sessions(url)
    if held_s is not None:
        assert [e.error for e in episodes] == [None, None]
        assert counts["opened"] == 3 and counts["connections"] > 3  # refused, then retried
    else:
        assert counts["opened"] == 1
        for e in episodes:
            assert "refused the session" in e.error and "CAPACITY_REACHED" in e.error, e.error
            assert "still refused after 2 s of retries" in e.error
            assert "it allows 1 at once (its max_concurrent_envs)" in e.error
            assert "rollout.env_concurrency" in e.error


@pytest.mark.slow
def test_a_verifiers_episode_that_fails_or_hangs_is_recorded(tool_model) -> None:
    """A rubric that raises (task 0) ends its episode with verifiers' error recorded; one that never
    returns (task 1) is cut at rollout.agent_timeout_s; the batch is still made."""
    pytest.importorskip("verifiers")
    import time

    from transformers import AutoTokenizer, LlamaForCausalLM

    from rldsl.runtime.rollout.agents.environments import environment_runner
    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.rollout.engines.hf import HFEngine

    cfg = load_config(None, ["rollout.env=verifiers:vf_sum_broken", "rollout.agent_timeout_s=20"])
    runner = environment_runner(cfg, tool_model, 256)
    engine = HFEngine(LlamaForCausalLM.from_pretrained(tool_model).eval(), AutoTokenizer.from_pretrained(tool_model))
    start = time.monotonic()
    try:
        batch = runner.run(engine, ["1+2=", "2+3="], ["0", "1"], SamplingParams(n=1, max_new_tokens=8, seed=0))
    finally:
        runner.close()
    assert time.monotonic() - start < 60
    first, second = (e.error for e in batch.episodes)
    assert "the verifiers episode failed" in first and "the rubric broke" in first
    assert "ran past its time limit of 20 s" in second


def test_verifiers_renders_a_released_template_to_the_ids_the_engine_saw(real_model) -> None:
    """Qwen2.5's released template over a byte-level BPE: the prompt ids verifiers' renderer sent
    are the template's own rendering of the task (add_generation_prompt), and are recorded as the
    row's prompt; the rubric's reward comes back."""
    pytest.importorskip("verifiers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rldsl.runtime.rollout.agents.environments import environment_runner
    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.rollout.engines.hf import HFEngine

    folder = real_model("qwen2.5")
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = load_config(None, ["rollout.env=verifiers:vf_sum_single", "rollout.agent_timeout_s=60"])
    runner = environment_runner(cfg, folder, 4096)
    try:
        batch = runner.run(HFEngine(AutoModelForCausalLM.from_pretrained(folder).eval(), tok), ["1+2="], ["0"],
                           SamplingParams(n=1, max_new_tokens=6, seed=0))
    finally:
        runner.close()
    (episode,) = batch.episodes
    assert episode.error is None and episode.env_reward in (0.25, 1.0)
    prompt = batch.prompt_ids[0][batch.prompt_mask[0].bool()].tolist()
    assert prompt == tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
