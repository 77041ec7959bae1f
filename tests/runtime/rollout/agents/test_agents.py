"""rollout.agent: the policy behind an OpenAI-compatible endpoint, called with the official
`openai` client. The records are the engine's exact ids and logprobs; calls that extend each
other make one row, others separate rows (prefix breaks); bad agents end their own episode."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch
from transformers import LlamaForCausalLM

from rldsl.runtime.batch import RolloutBatch, model_inputs
from rldsl.runtime.config import load_config
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.rollout.multi_turn import check_tools
from rldsl.runtime.rewards.functions import RewardFn
from rldsl.runtime.rollout.agents.calls import Call, episode_rows
from rldsl.runtime.rollout.agents.runner import AgentRunner, agent_metrics, load_agent
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.toy.calculator import hermes_call
from rldsl.runtime.toy.tool_model import CHAT_TEMPLATE, build_tool_tokenizer, tool_model_config

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tok():
    return build_tool_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    config = tool_model_config(tok, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64)
    return LlamaForCausalLM(config).eval()


class Recording:
    """An engine that passes generate_ids to another and keeps what it was given and returned."""

    def __init__(self, inner) -> None:
        self.inner, self.tokenizer = inner, inner.tokenizer
        self.seen: list[tuple[list[int], list[int], list[float]]] = []

    def generate_ids(self, prompt_ids, params, prompts=None) -> RolloutBatch:
        out = self.inner.generate_ids(prompt_ids, params, prompts)
        for r in range(len(out)):
            m = out.response_mask[r].bool()
            self.seen.append((list(prompt_ids[r // params.n]), out.response_ids[r][m].tolist(),
                              out.logprobs[r][m].tolist()))
        return out


class Scripted:
    """Answers call k (of every episode) with ``turns[k]`` + EOS, logprob -0.25 per token."""

    def __init__(self, tok, turns: list[str]) -> None:
        self.tokenizer, self.turns, self.prompts = tok, turns, []
        self.count: dict[int, int] = {}

    def generate_ids(self, prompt_ids, params, prompts=None) -> RolloutBatch:
        rows = []
        for p in prompt_ids:
            self.prompts.append(list(p))
            k = sum(1 for q in self.prompts[:-1] if len(q) < len(p))  # the call's place in its episode
            ids = self.tokenizer(self.turns[min(k, len(self.turns) - 1)], add_special_tokens=False)["input_ids"]
            rows += [ids + [self.tokenizer.eos_token_id]] * params.n
        T = max(len(r) for r in rows)
        B = len(rows)
        ids = torch.full((B, T), self.tokenizer.pad_token_id)
        mask = torch.zeros((B, T), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        return RolloutBatch(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long), ids, mask,
                            -0.25 * mask.float(), ["stop"] * B, [""] * B,
                            [self.tokenizer.decode(r, skip_special_tokens=True) for r in rows], params.n)


def _runner(agent, **kw) -> AgentRunner:
    kw.setdefault("context", 128)
    return AgentRunner(load_agent(f"agent_helpers:{agent}") if isinstance(agent, str) else agent,
                       model_name="toy", **kw)


# ------------------------------------------------------------------------ records -> rows
def test_calls_that_extend_each_other_make_one_row_others_break() -> None:
    a = Call([1, 2], [3, 4], [-0.1, -0.2], 0, "stop", "chat")
    b = Call([1, 2, 3, 4, 9, 9], [5], [-0.3], 0, "stop", "chat")  # extends a: 9 9 are the environment's
    c = Call([1, 7], [8], [-0.4], 0, "length", "chat")                # does not: a row of its own
    rows = episode_rows([a, b, c])
    assert len(rows) == 2
    one, two = rows
    assert one.prompt_ids == [1, 2] and one.response_ids == [3, 4, 9, 9, 5]
    assert one.mask == [1, 1, 0, 0, 1] and one.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert two.prompt_ids == [1, 7] and two.response_ids == [8] and two.finish_reason == "length"
    # a later call joins the longest row it extends (n > 1, parallel calls)
    d = Call([1, 2, 3, 4, 9, 9, 5, 6], [0], [-0.5], 0, "stop", "chat")
    assert [r.calls for r in episode_rows([a, b, c, d])] == [[0, 1, 3], [2]]


# ------------------------------------------------------------- the endpoint, exact records
def test_openai_client_three_calls_with_tools_recorded_exactly(tok, model) -> None:
    """Three chat calls with tools through the official client: each call's recorded ids are the
    engine's prompt and sampled ids, the calls join one row (prompt ids = the previous call's ids +
    the template's delta), and the logprobs recomputed over that row equal the recorded ones."""
    engine = Recording(HFEngine(model, tok))
    runner = _runner("three_calls")
    try:
        batch = runner.run(engine, ["12+34+5="], ["51"], SamplingParams(n=2, max_new_tokens=8, seed=3))
    finally:
        runner.close()
    assert batch.group_size == 2 and len(engine.seen) == 6
    for i in range(2):
        info = batch.episodes[i]
        assert len(info.agent.calls) == 3 and info.agent.rows == 1 and info.env_reward == 0.5
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
        n = int(batch.response_attention[i].sum())
        ids, mask = batch.response_ids[i, :n].tolist(), batch.response_mask[i, :n].tolist()
        whole = prompt + ids
        mine = [s for s in engine.seen if s[0] == whole[:len(s[0])] and whole[len(s[0]):len(s[0]) + len(s[1])] == s[1]]
        assert len(mine) == 3  # every call of the episode: its prompt and its sampled ids inside the row
        sampled = [t for s in mine for t in s[1]]
        assert [t for t, m in zip(ids, mask) if m] == sampled  # mask 1 = exactly the sampled ids
        assert batch.logprobs[i, :n][torch.tensor(mask).bool()].tolist() == [x for s in mine for x in s[2]]
        assert "<tool_response>\n0\n</tool_response>" in tok.decode(ids)
    ids, attn, pos = model_inputs(batch)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    Tp = batch.prompt_ids.shape[1]
    lp = torch.log_softmax(logits[:, Tp - 1:-1], -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    m = batch.response_mask.bool()
    assert torch.allclose(lp[m], batch.logprobs[m], atol=1e-5)
    metrics = agent_metrics(batch)
    assert metrics == {"agent/calls": 3.0, "agent/prefix_breaks": 0.0, "agent/rows_per_episode": 1.0,
                       "agent/errors": 0.0}


def test_tool_calls_come_back_as_tool_calls_and_the_next_call_is_bridged(tok) -> None:
    """The model's Hermes call is returned as `tool_calls` (finish_reason tool_calls); the agent's
    next call (its message history + the tool result) continues the sampled ids exactly."""
    call = hermes_call("calculator", {"expression": "12+34"})
    engine = Scripted(tok, [call, "46"])
    runner = _runner("calc_agent")
    try:
        batch = runner.run(engine, ["12+34="], ["46"], SamplingParams(n=1, max_new_tokens=40))
    finally:
        runner.close()
    info = batch.episodes[0]
    assert info.error is None and info.env_reward == 1.0 and len(info.agent.calls) == 2
    assert info.agent.rows == 1
    first, second = engine.prompts
    said = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert second[:len(first) + len(said)] == first + said
    assert tok.decode(second[len(first) + len(said):]) == \
        "\n<|im_start|>user\n<tool_response>\n46\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    roles = [m["role"] for m in info.messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    from rldsl.runtime.rollout.tool_metrics import tool_call_metrics
    assert tool_call_metrics(batch) == {"tool_calls/per_episode": 1.0, "tool_calls/well_formed": 1.0,
                                        "tool_calls/errors": 0.0}
    assert info.messages[1]["tool_calls"][0]["function"] == {"name": "calculator",
                                                               "arguments": {"expression": "12+34"}}


def test_a_real_template_and_bpe_keep_the_sampled_ids_not_their_reencoding(real_model) -> None:
    """Qwen2.5's released tools template over a byte-level BPE: the model's tool call sampled as
    ids that are *not* the tokenizer's encoding of its text (the same text in other pieces) stays
    those ids in the next call's prompt -- re-encoding the history would have changed them."""
    from transformers import AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(real_model("qwen2.5"))
    call = hermes_call("calculator", {"expression": "12+34"})
    odd = [i for k in range(0, len(call), 3) for i in qwen(call[k:k + 3], add_special_tokens=False)["input_ids"]]
    assert qwen.decode(odd) == call and odd != qwen(call, add_special_tokens=False)["input_ids"]

    class OddPieces(Scripted):
        def generate_ids(self, prompt_ids, params, prompts=None):
            out = super().generate_ids(prompt_ids, params, prompts)
            if len(self.prompts) == 1:  # the first call: the call text in odd pieces, then EOS
                ids = odd + [qwen.eos_token_id]
                out.response_ids = torch.tensor([ids])
                out.response_mask = torch.ones(1, len(ids), dtype=torch.long)
                out.logprobs = torch.full((1, len(ids)), -0.25)
                out.completions = [call]
            return out

    engine = OddPieces(qwen, ["", "46"])
    runner = _runner("calc_agent", context=4096)
    try:
        batch = runner.run(engine, ["12+34="], ["46"], SamplingParams(n=1, max_new_tokens=60))
    finally:
        runner.close()
    info = batch.episodes[0]
    assert info.error is None and info.agent.rows == 1 and info.env_reward == 1.0
    first, second = engine.prompts
    assert second[:len(first) + len(odd) + 1] == first + odd + [qwen.eos_token_id]
    assert "<tool_response>\n46\n</tool_response>" in qwen.decode(second[len(first) + len(odd) + 1:])


def test_tool_calls_marked_by_special_tokens_come_back_as_tool_calls() -> None:
    """A tokenizer that declares <tool_call> and </tool_call> special tokens (the real-shaped
    Qwen2.5 fixture, special_tool_markers): the chat route reads the call from the sampled ids
    decoded with the markers kept (and without the stop token), as vLLM's server does with tools,
    and returns it as `tool_calls`; decoded without the special tokens the call was returned as
    plain content, the agent never ran its tool and scored 0."""
    import real_model as fixture

    qwen = fixture.build_tokenizer("qwen2.5", special_tool_markers=True)
    call = hermes_call("calculator", {"expression": "12+34"})
    assert "<tool_call>" not in qwen.decode(qwen(call)["input_ids"], skip_special_tokens=True)
    engine = Scripted(qwen, [call, "46"])
    runner = _runner("calc_agent", context=4096)
    try:
        batch = runner.run(engine, ["12+34="], ["46"], SamplingParams(n=1, max_new_tokens=60))
    finally:
        runner.close()
    info = batch.episodes[0]
    assert info.error is None and info.env_reward == 1.0 and len(info.agent.calls) == 2
    assert [c["finish_reason"] for c in info.agent.calls] == ["tool_calls", "stop"]
    assert [m["role"] for m in info.messages] == ["user", "assistant", "tool", "assistant"]
    assert info.messages[1]["tool_calls"][0]["function"] == {"name": "calculator",
                                                               "arguments": {"expression": "12+34"}}
    assert info.messages[3]["content"] == "46" and batch.completions == ["46"]  # no <|im_end|>

def test_a_template_that_rerenders_history_gives_separate_rows(tok) -> None:
    """A template that drops an earlier turn's reasoning block cannot be extended: the next call
    is rendered whole, becomes a row of its own with the exact prompt the engine saw (never the
    first row's tokens re-encoded), and counts as a prefix break."""
    dropping = build_tool_tokenizer()
    dropping.chat_template = CHAT_TEMPLATE.replace(
        "{{ m.content if m.content else '' }}",
        "{{ (m.content.split('</think>')[-1] if not loop.last else m.content) if m.content else '' }}")
    engine = Scripted(dropping, ["<think>hm</think>" + hermes_call("calculator", {"expression": "1+2"}), "3"])
    runner = _runner("calc_agent")
    try:
        batch = runner.run(engine, ["1+2="], ["3"], SamplingParams(n=1, max_new_tokens=60))
    finally:
        runner.close()
    info = batch.episodes[0]
    assert (len(info.agent.calls), info.agent.prefix_breaks, info.agent.rows, info.error, info.agent.versions) \
        == (2, 1, 2, None, [0])
    assert batch.group_size == 2 and agent_metrics(batch)["agent/prefix_breaks"] == 1.0
    for r, seen in enumerate(engine.prompts):
        assert batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist() == seen
    assert "<think>" not in dropping.decode(engine.prompts[1])
    # both rows carry the episode's reward; the trained tokens are the two sampled answers
    rewards = RewardFn("env").score(batch).rewards
    assert rewards.tolist() == [1.0, 1.0]


# ----------------------------------------------------------------------------- bad agents
@pytest.mark.parametrize("agent, error", [
    ("raises", "the agent raised KeyError: 'the agent broke'"),
    ("hangs", "the agent ran past its time limit of 1 s"),
    ("hangs_sync", "the agent ran past its time limit of 1 s"),
    ("never_calls", "the agent made no call to the model"),
    ("wrong_model", "model 'gpt-4o' is not served here: this endpoint serves 'toy'"),
    ("returns_text", "the agent returned '1.0' (a str), not a number: text is not a score"),
])
def test_a_bad_agent_ends_its_own_episode_with_a_recorded_error(tok, model, agent, error) -> None:
    # the time limit is what the hanging agents must meet (1 s); the others end by themselves and
    # get a limit no loaded machine reaches (their model call alone can take over a second there)
    runner = _runner(agent, timeout_s=1.0 if agent.startswith("hangs") else 120.0)
    try:
        batch = runner.run(HFEngine(model, tok), ["1+2="], ["3"], SamplingParams(n=2, max_new_tokens=4, seed=0))
    finally:
        runner.close()
    assert len(batch) == 2 and all(error in e.error for e in batch.episodes)
    assert batch.finish_reason == ["length", "length"]
    with pytest.raises(Exception, match="reward"):  # reward.on_error=raise names the failure
        RewardFn("env").score(batch)
    skipped = RewardFn("env", on_error="skip").score(batch)
    assert skipped.num_errors == 2 and error in skipped.first_error
    assert agent_metrics(batch)["agent/errors"] == 1.0


def test_limits_are_clamped_or_refused(tok, model) -> None:
    """max_tokens past the run's is clamped; a prompt past the context is a 400; a flood of
    parallel calls gets 429s past rollout.agent_max_parallel_calls / max_turns, the run goes on."""
    engine = HFEngine(model, tok)
    runner = _runner("floods", max_parallel=2, max_calls=5)
    try:
        batch = runner.run(engine, ["1+2="], ["3"], SamplingParams(n=1, max_new_tokens=4, seed=0))
        assert batch.episodes[0].error is None and 1 <= batch.episodes[0].env_reward <= 5
        assert 1 <= len(batch.episodes[0].agent.calls) <= 5

        async def direct(log_url: str) -> None:
            client = openai.AsyncOpenAI(base_url=log_url, api_key="x", max_retries=0)
            r = await client.completions.create(model="toy", prompt="1+2=", max_tokens=10_000)
            assert r.usage.completion_tokens <= 4  # the run's max_new_tokens
            with pytest.raises(openai.BadRequestError, match="context of 128 tokens"):
                await client.completions.create(model="toy", prompt="1" * 200)
            models = await client.models.list()
            assert [m.id for m in models.data] == ["toy"]
            await client.close()

        server = runner.server
        log = server.open_episode(60)
        asyncio.run(direct(server.episode_url(log.id)))
        assert len(log.calls) == 1 and len(log.calls[0].completion_ids) <= 4
    finally:
        runner.close()


def test_the_token_route_answers_as_verifiers_reads_it(tok, model) -> None:
    """POST {base}/inference/v1/generate (verifiers' training client, prime-rl's renderers): token
    ids in; token ids out with exactly one logprob per token keyed "token_id:<id>"."""
    engine = Recording(HFEngine(model, tok))
    runner = _runner("never_calls")
    try:
        runner.run(engine, ["x"], [""], SamplingParams(n=1, max_new_tokens=5, seed=0))  # starts the server
        server = runner.server
        log = server.open_episode(60)

        async def post():
            client = openai.AsyncOpenAI(base_url=server.episode_url(log.id), api_key="x", max_retries=0)
            base = str(client.base_url).rstrip("/").removesuffix("/v1")
            import httpx
            raw = await client.post(f"{base}/inference/v1/generate", cast_to=httpx.Response, body={
                "model": "toy", "token_ids": [5, 6, 7],
                "sampling_params": {"max_tokens": 5, "temperature": 1.0, "logprobs": 1,
                                    "stop_token_ids": [tok.eos_token_id], "skip_special_tokens": False}})
            await client.close()
            return json.loads(raw.content)

        data = asyncio.run(post())
        choice = data["choices"][0]
        ids = choice["token_ids"]
        assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in ids]
        assert (ids, [e["logprob"] for e in choice["logprobs"]["content"]]) == tuple(engine.seen[-1][1:])
        assert data["prompt_token_ids"] == [5, 6, 7] and choice["finish_reason"] in ("stop", "length")
        assert log.calls[0].prompt_ids == [5, 6, 7] and log.calls[0].completion_ids == ids
    finally:
        runner.close()


def test_verifiers_training_client_path_reads_the_token_route(tok, model) -> None:
    """prime-rl's `renderers.client.generate` -- what verifiers 0.4's training client
    (`verifiers/v1/clients/train.py`) calls -- renders the chat client-side, checks the prompt
    against GET /v1/models' max_model_len, posts to /inference/v1/generate and validates the
    answer (one "token_id:<id>" logprob per token); what it gets back is what was recorded."""
    renderers = pytest.importorskip("renderers")
    from renderers.client import generate

    runner = _runner("never_calls")
    try:
        runner.run(HFEngine(model, tok), ["x"], [""], SamplingParams(n=1, max_new_tokens=6, seed=0))
        server = runner.server
        log = server.open_episode(60)

        async def call():
            client = openai.AsyncOpenAI(base_url=server.episode_url(log.id), api_key="x", max_retries=0)
            out = await generate(client=client, renderer=renderers.DefaultRenderer(tok),
                                 messages=[{"role": "user", "content": "1+2="}], model="toy",
                                 sampling_params={"max_tokens": 5, "temperature": 1.0})
            await client.close()
            return out

        out = asyncio.run(call())
    finally:
        runner.close()
    (rec,) = log.calls
    assert out["prompt_ids"] == rec.prompt_ids == tok.apply_chat_template(
        [{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out["completion_ids"] == rec.completion_ids and out["completion_logprobs"] == rec.logprobs
    assert len(rec.completion_ids) == 5 and out["finish_reason"] == "length"


def test_a_sync_agent_gets_the_base_url(tok, model) -> None:
    runner = _runner("sync_agent")
    try:
        batch = runner.run(HFEngine(model, tok), ["x"], [""], SamplingParams(n=2, max_new_tokens=3, seed=0))
    finally:
        runner.close()
    assert [e.error for e in batch.episodes] == [None, None]
    assert all(len(e.agent.calls) == 1 and e.env_reward == 1.0 for e in batch.episodes)


@pytest.mark.parametrize("agent", ["text_completions", "token_route", "sync_agent"])
def test_text_and_token_calls_keep_what_the_model_wrote_in_samples(tok, agent, tmp_path) -> None:
    """samples.jsonl of an agent whose calls go through /v1/completions or the token route
    (verifiers' training client): the completion is the sampled text; the messages are the row's
    (its system prompt first) when the template renders them to the ids sent, else the prompt text
    the engine saw, then each call's sampled text (assistant) and the ids put between two calls
    (environment), decoded."""
    from agent_helpers import USER_TURN

    from rldsl.runtime.records.samples import append_samples, read_samples, sample_rows

    if agent == "token_route":
        pytest.importorskip("renderers")
    runner = _runner(agent, system_prompt="You add.")
    try:
        batch = runner.run(Scripted(tok, ["12", "345"]), ["1+2="], ["3"], SamplingParams(n=1, max_new_tokens=8, seed=0))
    finally:
        runner.close()
    append_samples(tmp_path, sample_rows(1, batch, torch.ones(len(batch)), None, None, 1))
    _, (rec,) = read_samples(tmp_path)
    assert rec["agent"]["error"] is None and {c["route"] for c in rec["agent"]["calls"]} == {
        "text_completions": {"completions"}, "token_route": {"generate"}, "sync_agent": {"generate"}}[agent]
    opening = [{"role": "system", "content": "You add.", "trained": False},
               {"role": "user", "content": "1+2=", "trained": False}]
    said = [{"role": "assistant", "content": "12", "trained": True}]
    if agent == "text_completions":  # two calls, one row: the second continues the first's ids exactly
        assert rec["agent"]["rows"] == 1 and len(rec["agent"]["calls"]) == 2
        assert rec["completion"] == "345"
        assert rec["messages"] == opening + said + [{"role": "environment", "content": USER_TURN, "trained": False},
                                                    {"role": "assistant", "content": "345", "trained": True}]
    elif agent == "token_route":
        assert rec["completion"] == "12" and rec["messages"] == opening + said
    else:  # token ids of its own, not the row's messages: the prompt as the engine saw it
        assert rec["completion"] == "12"
        assert rec["messages"] == [{"role": "prompt", "content": tok.decode([3, 4, 5]), "trained": False}] + said


@pytest.mark.slow
def test_an_idle_connection_stays_open_for_the_episodes_next_call(tok) -> None:
    """The endpoint keeps an episode's idle connection open for longer than the episode may last:
    a client that sends its next call on the same connection after idling past uvicorn's own
    keep-alive (5 s) is answered, both calls recorded. Closing idle connections raced the next
    request on them (reset unanswered: APIConnectionError "Connection error." on a loaded
    machine). The race itself is not reproducible on demand -- httpx skips a pooled connection
    the server has visibly closed -- so this agent waits (select) until the server hangs up or the
    wait is over, then calls again on the same socket, as http.client does; before the fix the
    server hung up at 5 s and the second call was reset."""
    import http.client
    import select
    from urllib.parse import urlsplit

    import uvicorn

    idle = uvicorn.Config(app=None).timeout_keep_alive + 2.0  # past uvicorn's default keep-alive
    seen: dict = {}

    def agent(base_url: str, row: dict) -> float:
        url = urlsplit(base_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        body = json.dumps({"model": row["model"], "messages": [{"role": "user", "content": row["prompt"]}]})
        try:
            for k in range(2):
                if k:
                    seen["hung_up"] = bool(select.select([conn.sock], [], [], idle)[0])  # EOF: closed
                conn.request("POST", url.path + "/chat/completions", body, {"Content-Type": "application/json"})
                reply = conn.getresponse()
                assert reply.status == 200, reply.read()
                reply.read()
        finally:
            conn.close()
        return 1.0

    runner = _runner(agent, timeout_s=30.0)
    try:
        batch = runner.run(Scripted(tok, ["hi", "ho"]), ["x"], [""], SamplingParams(n=1, max_new_tokens=4))
        keep_alive = runner.server._server.config.timeout_keep_alive
    finally:
        runner.close()
    info = batch.episodes[0]
    assert info.error is None and info.env_reward == 1.0 and len(info.agent.calls) == 2
    assert seen == {"hung_up": False}
    assert keep_alive > runner.timeout_s  # the server never closes a live episode's connection


def test_a_streaming_chat_call_is_answered_and_recorded(tok, model) -> None:
    runner = _runner("streams")
    try:
        batch = runner.run(HFEngine(model, tok), ["x"], [""], SamplingParams(n=1, max_new_tokens=3, seed=0))
    finally:
        runner.close()
    info = batch.episodes[0]
    assert info.error is None and info.env_reward == 1.0 and len(info.agent.calls) == 1
    assert info.messages[-1]["content"] == batch.completions[0]


def test_stop_strings_n_and_stop_token_ids_cut_the_record_too(tok) -> None:
    """`stop` ends the text before the stop string and the record after the token completing it;
    `n` = 2 gives two choices, two records; `stop_token_ids` cuts the token route's ids."""
    engine = Scripted(tok, ["12+34=46"])
    runner = _runner("never_calls")
    try:
        runner.run(engine, ["x"], [""], SamplingParams(n=1, max_new_tokens=20))  # starts the server
        server = runner.server
        log = server.open_episode(60)

        async def calls():
            client = openai.AsyncOpenAI(base_url=server.episode_url(log.id), api_key="x", max_retries=0)
            r = await client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "q"}],
                                                     stop=["="], n=2)
            import httpx
            base = str(client.base_url).rstrip("/").removesuffix("/v1")
            plus = tok.convert_tokens_to_ids("+")
            raw = await client.post(f"{base}/inference/v1/generate", cast_to=httpx.Response, body={
                "model": "toy", "token_ids": [5, 6], "sampling_params": {"stop_token_ids": [plus]}})
            await client.close()
            return r, json.loads(raw.content)

        r, gen = asyncio.run(calls())
        assert [c.message.content for c in r.choices] == ["12+34", "12+34"]
        assert [c.finish_reason for c in r.choices] == ["stop", "stop"]
        chat = [c for c in log.calls if c.route == "chat"]
        assert len(chat) == 2 and all(tok.decode(c.completion_ids) == "12+34=" for c in chat)
        assert gen["choices"][0]["token_ids"] == tok("12+", add_special_tokens=False)["input_ids"]
        assert gen["choices"][0]["finish_reason"] == "stop"
    finally:
        runner.close()


# ------------------------------------------------------------------------------ config
def test_the_agent_is_checked_before_the_model_loads() -> None:
    check_tools(load_config(None, ["rollout.agent=agent_helpers:calc_agent"]))
    with pytest.raises(ConfigError, match="rollout.agent excludes rollout.tools and rollout.env"):
        check_tools(load_config(None, ["rollout.agent=agent_helpers:calc_agent", "rollout.env=episode_helpers:Nudge"]))
    with pytest.raises(ConfigError, match=r"must take two arguments: \(client, row\)"):
        load_agent("agent_helpers:two_arguments_missing")
    with pytest.raises(ConfigError, match="is not a function"):
        load_agent("agent_helpers:TOOLS")
    with pytest.raises(ConfigError, match="agent 'agent_helpers:nope'"):
        load_agent("agent_helpers:nope")


def test_an_agent_starts_from_the_rows_own_prompts() -> None:
    """Like an environment, an agent gets the row's prompt untemplated (a data file's chat
    template is the endpoint's to apply, with the agent's tools), not the rendered text."""
    from rldsl.runtime.data.datasets import Example
    from rldsl.runtime.run.state import Run

    run = object.__new__(Run)
    run.cfg = load_config(None, ["rollout.agent=agent_helpers:calc_agent"])
    example = Example(id=0, prompt="<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n", answer="3",
                      source="1+2=")
    assert run.multi_turn and run.rollout_prompts([example]) == ["1+2="]


def test_a_missing_openai_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "openai", None)  # import openai -> ImportError
    with pytest.raises(ConfigError, match=r"needs the 'openai' package.*pip install 'rldsl\[agents\]'"):
        check_tools(load_config(None, ["rollout.agent=agent_helpers:calc_agent"]))


# ------------------------------------------------------------------------- a training run
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one process", "async K=1", "ray rollout worker", "lora + micro-batches",
                                  "ray + async K=1 + lora + micro-batches"])
def test_an_agent_trains_on_its_own_reward(tool_model, tmp_path, mode) -> None:
    """--agent agent_helpers:calc_agent (an openai-client tool loop) on the calculator task: the
    agent's return value is the reward (the default with an agent), the calls are the rows, the
    metrics count them, samples.jsonl shows each episode's messages."""
    from rldsl.runtime.records.metrics import read_metrics
    from rldsl.runtime.run import loop

    extra = {"one process": (), "async K=1": ("rollout.max_staleness=1",),
             "ray rollout worker": ("distributed.rollout_workers=1",),
             "lora + micro-batches": ("model.lora.rank=4", "train.max_tokens_per_microbatch=64"),
             "ray + async K=1 + lora + micro-batches": ("distributed.rollout_workers=1", "rollout.max_staleness=1",
                                                        "model.lora.rank=4",
                                                        "train.max_tokens_per_microbatch=64")}[mode]
    cfg = load_config(None, [f"model.path={tool_model}", f"out={tmp_path / 'run'}", "data.task=calculator",
                             "rollout.agent=agent_helpers:calc_agent", "rollout.prompts_per_step=2",
                             "rollout.n=4", "train.steps=2", "eval.every=2", "eval.samples=0",
                             "data.eval_size=4", "checkpoint.every=0", "log.progress=false",
                             "log.samples_per_step=2", *extra])
    run = loop.train("grpo_tis", cfg)
    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["reward_errors"] == 0 and 0 <= r["reward_mean"] <= 1 for r in steps)
    assert all(r["agent/calls"] >= 1 and r["agent/rows_per_episode"] == 1 and r["agent/prefix_breaks"] == 0
               and r["agent/errors"] == 0 for r in steps)
    assert any("eval/agent/calls" in r for r in records)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["env_reward"] == s["reward"] for s in samples)
    # the agent got the row's own prompt, untemplated; the sample's prompt is what the engine saw
    assert all(s["messages"][0]["content"].endswith("=") and "<|im_start|>" not in s["messages"][0]["content"]
               and s["prompt"].startswith("<|im_start|>") for s in samples)
    assert any(m["role"] == "tool" for s in samples for m in s["messages"])
    for s in samples:
        assert all(m["trained"] == (m["role"] == "assistant") for m in s["messages"])
        agent = s["agent"]
        assert agent["rows"] == 1 and agent["error"] is None and agent["calls"]
        # the trained tokens are exactly the sampled ids of the calls
        assert s["trained_tokens"] == sum(len(c["completion_ids"]) for c in agent["calls"])
        assert len(agent["ids"]) == len(agent["trained"]) and sum(agent["trained"]) == s["trained_tokens"]
        trained = [i for i, m in zip(agent["ids"], agent["trained"]) if m]
        assert trained == [i for c in agent["calls"] for i in c["completion_ids"]]
        K = 1 if "async" in mode else 0
        assert {c["version"] for c in agent["calls"]} == {max(0, s["step"] - 1 - K)}
    if mode == "one process":
        from typer.testing import CliRunner

        from rldsl.cli import app

        shown = CliRunner().invoke(app, ["samples", str(run), "--width", "0"], env={"COLUMNS": "400"})  # no folding
        assert shown.exit_code == 0, shown.output
        assert "calculator(" in shown.output and "prefix breaks" in shown.output
        assert "policy version 1" in shown.output  # step 2 (the last shown) sampled by version 1


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1], ids=["one process", "ray rollout worker"])
def test_each_call_records_the_policy_version_that_sampled_it(tool_model, tmp_path, workers) -> None:
    """An asynchronous run (max_staleness=1) evaluating after every step: the batch of step s is
    sampled by policy version max(0, s - 1) (the weights after that many optimizer steps), and
    every call of it records that version -- not the number of weight loads, which the held-out
    evaluations (trainer weights in, the producer's back) and a Ray actor's syncs inflate."""
    from rldsl.runtime.rollout.producer import version_for
    from rldsl.runtime.run import loop

    cfg = load_config(None, [f"model.path={tool_model}", f"out={tmp_path / 'run'}", "data.task=calculator",
                             "rollout.agent=agent_helpers:calc_agent", "rollout.prompts_per_step=2",
                             "rollout.n=2", "train.steps=4", "eval.every=1", "eval.samples=0",
                             "data.eval_size=2", "checkpoint.every=0", "log.progress=false",
                             "log.samples_per_step=1", "rollout.max_staleness=1",
                             f"distributed.rollout_workers={workers}"])
    run = loop.train("grpo_tis", cfg)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [1, 2, 3, 4]
    for s in samples:
        versions = {c["version"] for c in s["agent"]["calls"]}
        assert versions == {version_for(s["step"] - 1, 1)}, (s["step"], versions)


# ------------------------------------------------------------- group_by an agent's role
def test_an_agents_calls_tagged_with_a_role_group_the_rows_by_it(tok) -> None:
    """``group_by=role`` on an agent run: each row's key comes from its calls' request metadata
    (two roles, two rows an episode), the same role in every episode and prompt one key; a row
    whose calls disagree, and metadata that is not strings, are refused with a clear message."""
    from rldsl.runtime.data.datasets import Example
    from rldsl.runtime.errors import RunError
    from rldsl.runtime.train import inputs as producers

    side = producers.RolloutSide(None, [], 4, print, 1, group_by="role")
    prompts = [Example(0, "1+1=", "2"), Example(1, "2+2=", "4")]
    runner = _runner("two_roles")
    try:
        batch = runner.run(Scripted(tok, ["7"]), [p.prompt for p in prompts], ["2", "4"], SamplingParams(n=2))
    finally:
        runner.close()
    assert batch.group_size == 4  # 2 episodes x 2 rows per prompt
    roles = [c["metadata"]["role"] for c in batch.episodes[0].agent.calls]
    assert roles == ["proposer", "solver"]  # recorded with the calls (samples.jsonl keeps them)
    keys = producers.field_keys(side, batch, None, prompts)[0].inputs["group_keys"].tolist()
    want = [producers.field_key("proposer"), producers.field_key("solver")] * 4
    assert keys == want
    runner = _runner("one_row_two_roles")
    try:
        batch = runner.run(Scripted(tok, ["7"]), ["1+1="], ["2"], SamplingParams(n=1))
    finally:
        runner.close()
    assert batch.episodes[0].agent.rows == 1
    with pytest.raises(RunError, match="tagged role='proposer' and 'solver'"):
        producers.field_keys(side, batch, None, prompts[:1])
    runner = _runner("bad_metadata")
    try:
        batch = runner.run(Scripted(tok, ["7"]), ["1+1="], ["2"], SamplingParams(n=1))
    finally:
        runner.close()
    assert "metadata must be an object" in batch.episodes[0].error


def test_self_play_roles_rewarded_apart_each_against_its_own_baseline(tok) -> None:
    """An agent returning a reward per role ({"proposer": a/10, "solver": 1 - a/10}): each row gets
    its role's reward, and group_by=role compares each role with its own rows only -- the
    advantages computed by hand. A row tagged with no rewarded role is the episode's error."""
    import rldsl
    from rldsl.runtime.data.datasets import Example
    from rldsl.runtime.train import inputs as producers

    prompts = [Example(0, "1+1=", "2"), Example(1, "2+2=", "4")]
    runner = _runner("rewarded_roles")
    try:
        batch = runner.run(Scripted(tok, ["7"]), [p.prompt for p in prompts], ["2", "4"], SamplingParams(n=2))
    finally:
        runner.close()
    assert batch.group_size == 4  # 2 episodes x (a proposer row, a solver row) per prompt
    rewards = RewardFn("env").score(batch, [p.prompt for p in prompts for _ in range(4)]).rewards
    assert rewards.tolist() == pytest.approx([0.2, 0.8] * 2 + [0.4, 0.6] * 2)  # proposer, solver, ...
    side = producers.RolloutSide(None, [], 4, print, 1, group_by="role")
    keys = producers.field_keys(side, batch, None, prompts)[0].inputs["group_keys"]
    fn = rldsl.compile(rldsl.loads('algorithm roles\n  "self-play"\n  baseline group_mean(group_by=role)\n'
                                   '  objective reinforce\n', filename="roles.rl"), compile=False)
    adv = fn.advantages(rewards.float(), batch.group_size, torch.ones(len(rewards), 1), group_keys=keys)
    # proposer rows 0.2, 0.2, 0.4, 0.4: mean 0.3; solver rows 0.8, 0.8, 0.6, 0.6: mean 0.7
    want = [-0.1, 0.1, -0.1, 0.1, 0.1, -0.1, 0.1, -0.1]
    assert adv[:, 0].tolist() == pytest.approx(want, abs=1e-6)
    runner = _runner("rewarded_unknown_role")
    try:
        batch = runner.run(Scripted(tok, ["7"]), ["1+1="], ["2"], SamplingParams(n=1))
    finally:
        runner.close()
    assert batch.episodes[0].env_reward is None
    assert "returned a reward per role ('proposer', 'solver') but the episode's row 0 is tagged 'judge'" \
        in batch.episodes[0].error


@pytest.mark.slow
def test_a_self_play_run_trains_each_role_against_its_own_baseline(tool_model, tmp_path) -> None:
    """The self-play agent rewarding its roles apart trains with group_by=role: in samples.jsonl
    (every row of the step), each row's reward is its role's, and its advantage is its reward less
    the mean reward of its role's rows in the batch (group_mean(group_by=role), REINFORCE)."""
    from rldsl.runtime.records.metrics import read_metrics
    from rldsl.runtime.run import loop

    spec = tmp_path / "roles.rl"
    spec.write_text('algorithm roles\n  "self-play"\n  baseline group_mean(group_by=role)\n  objective reinforce\n')
    cfg = load_config(None, [f"model.path={tool_model}", f"out={tmp_path / 'run'}", "data.task=calculator",
                             "rollout.agent=agent_helpers:rewarded_roles", "rollout.prompts_per_step=2",
                             "rollout.n=2", "train.steps=1", "eval.every=0", "eval.samples=0", "data.eval_size=0",
                             "checkpoint.every=0", "log.progress=false", "log.samples_per_step=2",
                             "train.skip_zero_advantage=false"])
    run = loop.train(str(spec), cfg)
    [step] = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert step["reward_errors"] == 0 and step["optimizer_steps"] == 1.0
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8  # 2 prompts x 2 episodes x 2 rows (a proposer, a solver)
    by_role: dict[str, list[dict]] = {}
    for s in samples:
        [role] = {c["metadata"]["role"] for c in s["agent"]["calls"] if c["row"] == s["agent"]["row"]}
        by_role.setdefault(role, []).append(s)
    assert sorted(by_role) == ["proposer", "solver"]
    for s in by_role["proposer"]:
        assert s["reward"] + next(t["reward"] for t in by_role["solver"] if t["group"] == s["group"]) \
            == pytest.approx(1.0)
    for rows in by_role.values():
        mean = sum(s["reward"] for s in rows) / len(rows)
        for s in rows:
            assert s["advantage"] == pytest.approx(s["reward"] - mean, abs=1e-6)
