"""``rollout.agent``: a user's program run once per sample against the policy's endpoint, its
calls turned into training rows (calls.py) and its return value into the episode's reward.

    async def agent(client: openai.AsyncOpenAI, row: dict) -> float | dict[str, float] | None   # or
    def agent(base_url: str, row: dict) -> float | dict[str, float] | None

``client`` is bound to the episode's base URL (server.py); ``row`` holds ``prompt`` (the row's
own, untemplated: a string or messages), ``answer``, ``model`` (the served model's name) and
``system``, the row's system prompt, when it has one (``data.system_prompt``; unset,
the source's own, reasoning-gym's on reasoning-gym data: data/sources.py ``system_prompt``). An
agent that raises, runs past ``rollout.agent_timeout_s`` or never calls the model ends its
episode with the error recorded; the ``env`` reward term then reports it to ``reward.on_error``.
"""
from __future__ import annotations

import asyncio
import inspect
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from ... import plugins
from ...batch import AgentRow, Episode, RolloutBatch, TokenRow
from ...errors import ConfigError, EpisodeRefused
from ...models.kinds import ModelKind, text_kind
from ...records.metrics import AGENT_CALLS, AGENT_ERRORS, AGENT_PREFIX_BREAKS, AGENT_ROWS_PER_EPISODE
from ...rewards.values import reward_value
from ..engines.base import SamplingParams
from .calls import Call, Outcome, Row, episode_rows, prefix_breaks

#: How much longer than an episode's time limit the endpoint keeps an idle connection open: no
#: live episode's connection is ever closed under it (server.py, PolicyServer.start).
KEEP_ALIVE_MARGIN_S = 60.0

#: The extra that installs what agents need.
AGENTS_EXTRA = "pip install 'rldsl[agents]'"


def load_agent(spec: str) -> Callable:
    """``module:function`` (or ``path/to/file.py:function``) -> the agent: a function of two
    arguments (``client, row`` when async, ``base_url, row`` when not). Checks that ``openai`` is
    installed when it is async (its client is what it gets)."""
    fn = plugins.load_object(spec, plugins.AGENT)
    if not callable(fn) or inspect.isclass(fn):
        raise ConfigError(f"agent {spec!r} is not a function (got {type(fn).__name__})")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ConfigError(f"agent {spec!r} must take two arguments: (client, row) when async, "
                          f"(base_url, row) when not; it takes {inspect.signature(fn)}") from None
    except ValueError:
        pass  # no signature to read (a builtin): called as is
    for module in ("openai", "starlette", "uvicorn"):
        try:
            __import__(module)
        except ImportError:
            raise ConfigError(f"rollout.agent needs the {module!r} package, which is not installed: "
                              f"{AGENTS_EXTRA}") from None
    return fn


class AgentRunner:
    """Runs ``agent`` once per sample (``params.n`` per prompt) against a :class:`PolicyServer`
    started on first use, and turns the recorded calls into a :class:`RolloutBatch`.

    The batch: each episode gives its rows (one when every call continued the previous one);
    every episode of the batch is padded to the same number K of rows with empty ones (loss mask
    0, the episode's reward), so prompt groups stay contiguous with ``group_size`` G*K."""

    #: What runs an episode, as its errors name it.
    subject = "the agent"

    def __init__(self, agent: Callable, *, model_name: str, max_calls: int = 4, max_parallel: int = 4,
                 timeout_s: float = 120.0, concurrency: int = 64, context: int | None = None,
                 tool_parser: str = "hermes", system_prompt: str | None = None,
                 chat_template_kwargs: dict | None = None) -> None:
        self.agent = agent
        self.is_async = inspect.iscoroutinefunction(agent)
        self.model_name = model_name
        self.max_calls, self.max_parallel = max_calls, max_parallel
        self.timeout_s, self.concurrency = timeout_s, concurrency
        self.context, self.tool_parser = context, tool_parser
        self.system_prompt = system_prompt  # row["system"] (data/sources.py system_prompt)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.version = 0  # the policy version the engine holds (optimizer steps): the next calls'
        # (0: the model folder's weights; a resumed run loads its checkpoint's first)
        self.server: Any = None
        self.kind: ModelKind = text_kind()  # the policy's (models/kinds/): the engine's, once it is known
        self._lock = threading.Lock()

    def weights_loaded(self, version: int) -> None:
        """The engine now holds policy ``version`` (the weights after that many optimizer steps)."""
        self.version = version

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def _server(self, engine: Any) -> Any:
        with self._lock:
            if self.server is None:
                from .server import PolicyServer

                self.kind = getattr(engine, "kind", None) or text_kind(engine.tokenizer)
                self.server = PolicyServer(engine.tokenizer, model_name=self.model_name, context=self.context,
                                           max_calls=self.max_calls, max_parallel=self.max_parallel,
                                           tool_parser=self.tool_parser,
                                           chat_template_kwargs=self.chat_template_kwargs,
                                           keep_alive_s=self.timeout_s + KEEP_ALIVE_MARGIN_S,
                                           kind=self.kind)
                self.server.start()
            return self.server

    # ------------------------------------------------------------------ one batch
    def run(self, engine: Any, prompts: Sequence[str | Sequence[dict]], answers: list[str],
            params: SamplingParams) -> RolloutBatch:
        """``params.n`` episodes per prompt; ``prompts``: the rows' own prompts, untemplated (a
        string or messages, ``data.rollout_prompts``), handed to the agent as ``row["prompt"]``."""
        server = self._server(engine)
        server.use(engine, params, self.version)
        G = params.n
        rows = [self.row(p, a) for p, a in zip(prompts, answers)]
        outcomes = asyncio.run(self._episodes([rows[i // G] for i in range(len(rows) * G)], server))
        batch = self.batch(engine.tokenizer, rows, outcomes, G)
        batch.answers = [answers[i // batch.group_size] for i in range(len(batch))]
        return batch

    def row(self, prompt: str | Sequence[dict], answer: str) -> dict:
        """What the agent gets of one data row (the module's docstring)."""
        return {"prompt": prompt if isinstance(prompt, str) else [dict(m) for m in prompt], "answer": answer,
                "model": self.model_name, **({"system": self.system_prompt} if self.system_prompt else {})}

    async def _episodes(self, rows: list[dict], server: Any) -> list[Outcome]:
        limit = asyncio.Semaphore(self.concurrency)
        return await asyncio.gather(*(self._episode(row, server, limit) for row in rows))

    async def _episode(self, row: dict, server: Any, limit: asyncio.Semaphore) -> Outcome:
        async with limit:
            log = server.open_episode(self.timeout_s)
            url = server.episode_url(log.id)
            client = None
            reward: Any = None
            error: str | None = None
            try:
                if self.is_async:
                    import openai

                    client = openai.AsyncOpenAI(base_url=url, api_key="rldsl", max_retries=0,
                                                timeout=self.timeout_s)
                    work = self.agent(client, dict(row))
                else:
                    work = _in_thread(self.agent, url, dict(row))
                reward = await asyncio.wait_for(work, timeout=self.timeout_s)
            except asyncio.TimeoutError:
                error = f"{self.subject} ran past its time limit of {self.timeout_s:g} s (rollout.agent_timeout_s)"
            except EpisodeRefused:
                raise  # not begun: its runner starts it again
            except Exception as e:  # noqa: BLE001 - the agent's own failure ends its episode only
                error = f"{self.subject} raised {type(e).__name__}: {e}"
            finally:
                server.close_episode(log, "the agent returned" if error is None else error)
                if client is not None:
                    await client.close()
            if error is None and reward is not None:
                try:
                    reward = _checked_reward(reward, self.subject)
                except ValueError as e:
                    error = f"{e} (return a number, a {{role: number}} dict, or None for no reward)"
            if error is None and not log.calls:
                error = f"{self.subject} made no call to the model" + (
                    f" that was answered (refused: {', '.join(sorted(set(log.refused)))})" if log.refused else "")
            return Outcome(log.calls, None if error else reward, error)

    # ------------------------------------------------------------------ rows
    def batch(self, tokenizer: Any, rows_in: list[dict], outcomes: list[Outcome], G: int) -> RolloutBatch:
        """The rows of every episode (``rows_in``: each prompt's row as the agent got it)."""
        per_episode = [episode_rows(o.calls) for o in outcomes]
        K = max(1, max(len(r) for r in per_episode))
        pad = tokenizer.pad_token_id
        # a MoE policy's routing: each row's calls' records (a row without calls: -1); none when a
        # call came back without one
        recorded = all(r.routed_experts is not None for rows in per_episode for r in rows if r.calls)
        out: list[TokenRow] = []
        for e, (o, rows) in enumerate(zip(outcomes, per_episode)):
            row_in = rows_in[e // G]
            opening = ([{"role": "system", "content": row_in["system"]}] if row_in.get("system") else []) + (
                [{"role": "user", "content": row_in["prompt"]}] if isinstance(row_in["prompt"], str)
                else list(row_in["prompt"]))
            row_of = {k: j for j, r in enumerate(rows) for k in r.calls}
            # the episode's final answer (what a reward on the answer reads, the same on every row):
            # its last call's reply (a chat call's message, a text or token call's text)
            final = _reply_text(o.calls[-1]) if o.calls else ""
            calls = [{"route": c.route, "row": row_of.get(k), "prompt_tokens": len(c.prompt_ids),
                      "completion_ids": c.completion_ids, "finish_reason": c.finish_reason,
                      "version": c.version, "bridged": c.bridged, **({"metadata": c.metadata} if c.metadata else {})}
                     for k, c in enumerate(o.calls)]
            made, breaks = len(rows), prefix_breaks(rows)
            rewards, error = o.row_rewards(rows, K, self.subject)
            if not rows:  # no call answered: an empty row, the opening messages rendered as its prompt
                text = tokenizer.apply_chat_template(opening, tokenize=False, add_generation_prompt=True,
                                                     **self.chat_template_kwargs)
                refs = self.kind.message_images(opening)  # its images expanded (a vision-language policy's)
                rows = [Row(self.kind.prompt_ids(text, refs) or [pad], images=refs)]
            for k in range(K):
                # padding: nothing trained; its prompt is the first row's first call's, with its images
                row = rows[k] if k < len(rows) else Row(rows[0].prompt_ids, images=_prompt_images(o.calls, rows[0]))
                text = tokenizer.decode(row.prompt_ids, skip_special_tokens=False)  # what the engine saw
                messages = row_messages(tokenizer, o.calls, row, opening, self.chat_template_kwargs) \
                    if row.calls else opening
                out.append(TokenRow(
                    row.prompt_ids, row.response_ids, row.logprobs,
                    row.finish_reason if row.response_ids and not error else "length",
                    self.kind.prompt(text, row.images), final, mask=row.mask,
                    routed_experts=row.routed_experts if recorded and row.calls else None,
                    episode=Episode(messages, rewards[k], error=error,
                                    agent=AgentRow(k, made, k >= len(rows), breaks, calls)), images=row.images))
        return RolloutBatch.from_rows(out, G * K, pad)


def _checked_reward(value: Any, subject: str) -> float | dict[str, float]:
    """An agent's return value as a reward: a number (the episode's), or a dict of a number per
    role -- per value its calls' ``metadata`` tags rows with (``{"proposer": 0.0, "solver": 1.0}``):
    self-play whose roles are rewarded apart. Each number is checked as every reward is."""
    if not isinstance(value, dict):
        return reward_value(value, subject)  # the one check: text is refused
    if not value or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{subject} returned {value!r:.100}: a reward per role is a non-empty dict of strings "
                         "(the values its calls' metadata tags rows with) to numbers")
    return {k: reward_value(v, f"{subject}'s reward for role {k!r}") for k, v in value.items()}


def _prompt_images(calls: list[Call], row: Row) -> list[str]:
    """The images of a row's prompt ids: its first call's (none for a row made of no call)."""
    return list(calls[row.calls[0]].images) if row.calls else list(row.images)


def _reply_text(call: Call) -> str:
    """What a call answered: a chat call's assistant message content, else the completion's text."""
    if call.messages is not None:
        return call.messages[-1].get("content") or ""
    return call.text


def row_messages(tokenizer: Any, calls: list[Call], row: Row, opening: list[dict],
                 chat_template_kwargs: dict | None = None) -> list[dict]:
    """A training row's conversation, as samples.jsonl keeps it: that of its last chat call (the
    request's messages and the reply; a prefix break's own), then the calls after it. A text or
    token call (``/v1/completions``, ``/inference/v1/generate``) has no messages: the row starts
    with its ``opening`` messages (the row's system prompt and prompt, as the agent got them) when
    the chat template renders them to exactly the ids its first call sent, else with one
    ``prompt`` message, the text the engine saw; each call then adds the text the environment put
    between it and the call before (an ``environment`` message: those ids decoded, special tokens
    kept) and its completion's text (an ``assistant`` message)."""
    chat = [k for k in row.calls if calls[k].messages is not None]
    if chat:
        messages, rest = list(calls[chat[-1]].messages), [k for k in row.calls if k > chat[-1]]
        end = len(calls[chat[-1]].prompt_ids) + len(calls[chat[-1]].completion_ids)
    else:
        first = calls[row.calls[0]]
        try:
            rendered = tokenizer.apply_chat_template(opening, tokenize=False, add_generation_prompt=True,
                                                     **dict(chat_template_kwargs or {}))
            same = tokenizer(rendered, add_special_tokens=False)["input_ids"] == first.prompt_ids
        except Exception:  # noqa: BLE001 - no chat template (a base model's text agent): not the opening
            same = False
        messages = list(opening) if same else [
            {"role": "prompt", "content": tokenizer.decode(first.prompt_ids, skip_special_tokens=False)}]
        rest, end = row.calls, len(first.prompt_ids)
    for k in rest:
        c = calls[k]
        if len(c.prompt_ids) > end:
            messages.append({"role": "environment",
                             "content": tokenizer.decode(c.prompt_ids[end:], skip_special_tokens=False)})
        messages.append({"role": "assistant", "content": c.text})
        end = len(c.prompt_ids) + len(c.completion_ids)
    return messages


def _in_thread(fn: Callable, *args: Any) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread, as a future of the running loop: a sync agent that hangs
    past its time limit is left behind without holding the run (or the interpreter's exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def target() -> None:
        try:
            out, err = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the episode
            out, err = None, e
        try:
            loop.call_soon_threadsafe(settle, out, err)
        except RuntimeError:
            pass  # the batch is over (its loop closed): nobody waits for this agent

    threading.Thread(target=target, name="agent", daemon=True).start()
    return future


def agent_metrics(batch: RolloutBatch, prefix: str = "") -> dict[str, float]:
    """``agent/calls`` (model calls per episode), ``agent/prefix_breaks`` (calls of the batch that
    could not continue an earlier call's ids), ``agent/rows_per_episode``, ``agent/errors`` (the
    fraction of episodes that ended with an error). Empty unless the batch is an agent's."""
    heads = [e for e in batch.episodes if e.agent is not None and e.agent.row == 0]
    if not heads:
        return {}
    n = len(heads)
    return {prefix + AGENT_CALLS: sum(len(h.agent.calls) for h in heads) / n,
            prefix + AGENT_PREFIX_BREAKS: float(sum(h.agent.prefix_breaks for h in heads)),
            prefix + AGENT_ROWS_PER_EPISODE: sum(max(1, h.agent.rows) for h in heads) / n,
            prefix + AGENT_ERRORS: sum(h.error is not None for h in heads) / n}


def served_name(model_path: str | Path) -> str:
    """The model name the endpoint serves: the model folder's name."""
    return Path(model_path).name or str(model_path)
