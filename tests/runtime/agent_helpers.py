"""Agent programs for the agent tests (loaded by `module:function`; this folder is on sys.path):
ordinary `openai`-client code, and the bad ones."""
from __future__ import annotations

import asyncio
import json
import time

from rldsl.runtime.rollout.episodes.tools import tool_schema
from rldsl.runtime.toy.calculator import calculator

TOOLS = [tool_schema(calculator)]


async def tool_loop(client, row: dict, tool, max_calls: int):
    """An ordinary openai-client tool loop: the model calls ``tool`` (run here; an error goes back
    to the model as the result) until it answers without a call. Returns the final message, or
    None when the context filled up or ``max_calls`` calls never ended in an answer."""
    import openai

    prompt = row["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    for _ in range(max_calls):
        try:
            r = await client.chat.completions.create(model=row["model"], messages=messages,
                                                     tools=[tool_schema(tool)])
        except openai.BadRequestError:  # the context is full: the episode ends unanswered
            return None
        message = r.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": tool_answer(tool, call.function.arguments)})
    return None


def tool_answer(tool, arguments: str | dict) -> str:
    """What :func:`tool_loop` sends back for a call: ``tool`` run on the call's arguments (JSON
    text, or the parsed object), or the error it raised (the model sees it)."""
    try:
        return str(tool(**(json.loads(arguments) if isinstance(arguments, str) else arguments)))
    except Exception as e:  # noqa: BLE001 - the model sees the error
        return f"error: {e}"


async def calc_agent(client, row: dict) -> float:
    """The calculator tool loop: the model calls the calculator (run here), then answers; reward 1
    when the final answer is the row's."""
    message = await tool_loop(client, row, calculator, max_calls=3)
    return 0.0 if message is None else float((message.content or "").strip() == row["answer"])


async def three_calls(client, row: dict) -> float:
    """Three chat calls with tools, each result answered by a tool message, whatever the model says."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for k in range(3):
        r = await client.chat.completions.create(model=row["model"], messages=messages, tools=TOOLS,
                                                 max_tokens=6, logprobs=True)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": f"call{k}", "content": str(k)})
    return 0.5


async def raises(client, row: dict) -> float:
    await client.chat.completions.create(model=row["model"], messages=[{"role": "user", "content": "1"}])
    raise KeyError("the agent broke")


async def returns_text(client, row: dict) -> str:
    """Returns its reward as text: refused, as a reward function's text is (the value is checked
    before whether the agent called the model)."""
    return "1.0"


async def hangs(client, row: dict) -> float:
    await asyncio.Event().wait()  # never set
    return 1.0


def hangs_sync(base_url: str, row: dict) -> float:
    time.sleep(3600)
    return 1.0


async def never_calls(client, row: dict) -> float:
    return 1.0


async def wrong_model(client, row: dict) -> float:
    await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "1"}])
    return 1.0


async def floods(client, row: dict) -> float:
    """Twelve calls at once; the refused ones (429) are counted, not fatal."""
    async def one():
        try:
            await client.chat.completions.create(model=row["model"], messages=[{"role": "user", "content": "1"}],
                                                 max_tokens=2)
            return "ok"
        except Exception as e:  # noqa: BLE001
            return type(e).__name__
    outcomes = await asyncio.gather(*(one() for _ in range(12)))
    row["outcomes"] = outcomes
    return float(outcomes.count("ok"))


def sync_agent(base_url: str, row: dict) -> float:
    """A synchronous agent: the base URL and plain HTTP (the token-in/token-out route)."""
    import httpx

    ids = [3, 4, 5]
    r = httpx.post(base_url.removesuffix("/v1") + "/inference/v1/generate",
                   json={"model": row["model"], "token_ids": ids, "sampling_params": {"max_tokens": 3, "logprobs": 1}},
                   timeout=60)
    r.raise_for_status()
    return 1.0


def two_arguments_missing(client):
    return None


async def streams(client, row: dict) -> float:
    """A streaming chat call (verifiers' chat program always streams): the text arrives in chunks."""
    stream = await client.chat.completions.create(model=row["model"], messages=[{"role": "user", "content": "1"}],
                                                  stream=True, max_tokens=3)
    text, finish = "", None
    async for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    row["streamed"] = (text, finish)
    return float(finish in ("stop", "length"))


async def weather_agent(client, row: dict) -> None:
    """The real-shaped fixture's tool loop (tests/fixtures/real_tools.py): get_weather, at most
    two calls; the final answer is left to --reward."""
    from real_tools import get_weather

    await tool_loop(client, row, get_weather, max_calls=2)


def opening(row: dict) -> list[dict]:
    """The row's messages as an agent sends them: its system prompt (``row["system"]``) first."""
    prompt = row["prompt"]
    return ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt))


async def system_chat(client, row: dict) -> float:
    """One chat call on the row's messages, its system prompt first (docs/agents.md)."""
    await client.chat.completions.create(model=row["model"], messages=opening(row), max_tokens=4)
    return 1.0


#: What text_completions puts between its two calls: a user turn of the tool template.
USER_TURN = "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


async def text_completions(client, row: dict) -> float:
    """A text-completions agent on the tool model: renders the row's messages with the chat
    template itself and sends the text to /v1/completions; then continues exactly (docs/agents.md):
    the prompt's ids + the sampled ids (the logprobs' tokens, as ids) + a user turn's ids, as ids."""
    from rldsl.runtime.toy.tool_model import build_tool_tokenizer

    tok = build_tool_tokenizer()
    text = tok.apply_chat_template(opening(row), tokenize=False, add_generation_prompt=True)
    r = await client.completions.create(model=row["model"], prompt=text, max_tokens=8, logprobs=1)
    sampled = tok.convert_tokens_to_ids(r.choices[0].logprobs.tokens)
    ids = tok(text, add_special_tokens=False)["input_ids"] + sampled + tok(USER_TURN, add_special_tokens=False)["input_ids"]
    await client.completions.create(model=row["model"], prompt=ids, max_tokens=8)
    return 1.0


async def token_route(client, row: dict) -> float:
    """A verifiers-style agent: prime-rl's renderers (verifiers 0.4's training client) render the
    row's messages client-side and post the ids to /inference/v1/generate."""
    import renderers
    from renderers.client import generate

    from rldsl.runtime.toy.tool_model import build_tool_tokenizer

    await generate(client=client, renderer=renderers.DefaultRenderer(build_tool_tokenizer()), messages=opening(row),
                   model=row["model"], sampling_params={"max_tokens": 8, "temperature": 1.0})
    return 1.0


async def two_roles(client, row: dict) -> float:
    """Self-play in one episode: a proposer call and a solver call on a prompt of its own (two
    rows), each tagged with its role in the request's metadata."""
    for role in ("proposer", "solver"):
        await client.chat.completions.create(
            model=row["model"], messages=[{"role": "user", "content": f"{role}: {row['prompt']}"}],
            max_tokens=4, metadata={"role": role})
    return 1.0


async def one_row_two_roles(client, row: dict) -> float:
    """Two calls of one sequence (the second continues the first) tagged with different roles."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for role in ("proposer", "solver"):
        r = await client.chat.completions.create(model=row["model"], messages=messages, max_tokens=4,
                                                 metadata={"role": role})
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    return 1.0


async def bad_metadata(client, row: dict) -> float:
    await client.chat.completions.create(model=row["model"], messages=[{"role": "user", "content": "x"}],
                                         max_tokens=2, extra_body={"metadata": {"role": 3}})
    return 1.0


async def rewarded_roles(client, row: dict) -> dict:
    """Self-play whose roles are rewarded apart: a proposer and a solver call (a row each, tagged
    with their role), a reward per role -- the proposer's a tenth of the answer's last digit,
    the solver's its complement."""
    for role in ("proposer", "solver"):
        await client.chat.completions.create(
            model=row["model"], messages=[{"role": "user", "content": f"{role}: {row['prompt']}"}],
            max_tokens=4, metadata={"role": role})
    a = int(float(row["answer"])) % 10 / 10
    return {"proposer": a, "solver": 1.0 - a}


async def rewarded_unknown_role(client, row: dict) -> dict:
    """A reward per role, but its call is tagged with a role the rewards do not name."""
    await client.chat.completions.create(model=row["model"], messages=[{"role": "user", "content": "x"}],
                                         max_tokens=2, metadata={"role": "judge"})
    return {"proposer": 1.0, "solver": 0.0}


async def odd_answers_break(client, row: dict) -> float:
    """A text-completions call on the row's prompt and, when the row's answer is an odd number, a
    second on a prompt of its own (a prefix break): one row per episode, or two. Reward: 1 when
    the first reply's text has an odd length (a random model's: groups both equal and not)."""
    r = await client.completions.create(model=row["model"], prompt=row["prompt"], max_tokens=3)
    if int(row["answer"]) % 2:
        await client.completions.create(model=row["model"], prompt="=" + row["prompt"], max_tokens=3)
    return float(len(r.choices[0].text) % 2)
