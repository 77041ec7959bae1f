"""Environments from other libraries, run as agents against the policy's endpoint (server.py):
``rollout.env = "verifiers:<taskset id>"`` (verifiers 0.4) and ``rollout.env = "openenv:<url>"``
/ ``"openenv:mcp@<url>"`` (openenv-core 0.3). Each is an agent function (runner.py) built from
the spec, so its calls are recorded, turned into rows, limited and timed like any agent's, and
its return value -- the environment's own reward -- is the ``env`` reward term. docs/agents.md,
"Environments from other libraries".

verifiers: the run's rows are the taskset's tasks (:func:`verifiers_examples`; a row's
``answer`` is its task's index, which the agent gets as ``row["task"]``); an episode is ``Env.run_episode`` of that task with verifiers'
training client (``TrainClientConfig``: it renders the chat to ids with the model folder's
tokenizer and posts them to the episode's ``/inference/v1/generate``), the harness verifiers'
own chat program run with this Python (vf_harness.py), the reward the trace's rubric total.

OpenEnv: an ``EnvClient`` session per episode over the server's WebSocket. A text environment
(``GenericEnvClient``): the reset observation's text is the user message (the row's prompt when
it has none), each model reply is sent as the action's one text field (read from the server's
``/schema``), the next observation's text is the next user message, until ``done``. An MCP
environment (``MCPToolClient``): its tools (``list_tools``) are offered to the model as
function tools, each tool call is a ``CallToolAction`` step whose result is the tool message;
a reply without tool calls ends the episode. The reward is the sum of the rewards the
environment reported (:func:`_episode_reward`: 0 when the episode ended before the environment
ran a step; an error when steps ran and none was rewarded). The sessions open at once are held
to the server's limit (:class:`SessionGate`).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from ...config import env_library
from ...data.datasets import Example
from ...data.sources import system_prompt as source_system_prompt
from ...errors import ConfigError, EpisodeRefused
from ...rewards.values import reward_value
from . import vf_harness
from .calls import Outcome
from .runner import AGENTS_EXTRA, AgentRunner, load_agent, served_name

#: The module each library needs.
MODULES = {"verifiers": ("verifiers", "renderers"), "openenv": ("openenv",)}
#: The variable verifiers' client reads its API key from: one nobody sets (the endpoint needs no key;
#: verifiers' default, PRIME_API_KEY, would send a user's Prime key to it).
ENDPOINT_KEY_VAR = "RLDSL_ENDPOINT_API_KEY"
#: Seconds to wait for an OpenEnv server to answer ``/health`` before the run starts.
HEALTH_TIMEOUT_S = 5.0
#: The back-off before retrying a refused OpenEnv session: the first pause, doubled after each
#: refusal up to the last (seconds).
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.05, 2.0


def _target(spec: str) -> str:
    target = spec.partition(":")[2].strip()
    if not target:
        raise ConfigError(f"rollout.env {spec!r} names no environment: write verifiers:<taskset id> or "
                          "openenv:<url> (openenv:mcp@<url> for an MCP tool environment)")
    return target


def require(spec: str, library: str) -> None:
    """``library`` (``spec``'s) with its packages importable, else a ConfigError naming the extra
    (checked before any model loads)."""
    for module in (*MODULES[library], "openai", "starlette", "uvicorn"):
        try:
            __import__(module)
        except ImportError:
            package = {"openenv": "openenv-core"}.get(module, module)
            raise ConfigError(f"rollout.env {spec!r} needs the {package!r} package, which is not installed: "
                              f"{AGENTS_EXTRA}") from None


def check(spec: str, library: str) -> None:
    """Everything about ``spec`` that can fail before a model loads: the packages, the taskset
    (verifiers), a reachable server with a usable action (OpenEnv)."""
    require(spec, library)
    if library == "verifiers":
        tasks = verifiers_env(_target(spec)).tasks
        if not tasks:
            raise ConfigError(f"rollout.env {spec!r}: the taskset has no tasks")
    else:
        OpenEnvTarget.parse(_target(spec)).check()


# ------------------------------------------------------------------------------ verifiers
#: Most tasks read from an endless taskset (``Taskset.INFINITE``).
MAX_TASKS = 100_000


@functools.lru_cache(maxsize=8)
def verifiers_env(taskset_id: str) -> "VerifiersEnv":
    """The environment of ``taskset_id``, loaded once per process (the checks, the rows and the
    runner read the same one)."""
    return VerifiersEnv(taskset_id)


class VerifiersEnv:
    """A verifiers 0.4 environment: ``load_environment`` of the taskset ``taskset_id`` with one
    agent seat, run in a local subprocess by :mod:`.vf_harness`."""

    def __init__(self, taskset_id: str) -> None:
        import verifiers.v1 as vf

        self.taskset_id = taskset_id
        config = {"taskset": {"id": taskset_id},
                  "agent": {"runtime": {"type": "subprocess"}, "harness": {"id": vf_harness.register()}}}
        try:
            self.env = vf.load_environment(vf.resolve_env_config(config))
            taskset = self.env.taskset
            self.tasks = list(taskset if taskset.bounded else taskset.take(MAX_TASKS))
        except (ImportError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"rollout.env 'verifiers:{taskset_id}' cannot be loaded: {type(e).__name__}: {e}") from None


def verifiers_examples(spec: str) -> list[Example]:
    """The run's rows for ``rollout.env = verifiers:...``: one per task of the taskset, its prompt
    the task's (a string, or its messages), its answer the task's index."""
    rows = []
    for i, task in enumerate(verifiers_env(_target(spec)).tasks):
        prompt = task.data.prompt
        if isinstance(prompt, str):
            rows.append(Example(i, prompt, str(i)))
        else:
            messages = tuple({"role": m.role, "content": m.content if isinstance(m.content, str) else ""}
                             for m in (prompt or []))
            rows.append(Example(i, "\n\n".join(m["content"] for m in messages), str(i), source=messages))
    return rows


def verifiers_agent(spec: str, *, model_path: str | Path, model_name: str, tool_parser: str,
                    timeout_s: float, chat_template_kwargs: dict | None = None
                    ) -> tuple[Callable, Callable[[], contextlib.AbstractAsyncContextManager]]:
    """(the agent that runs one episode of the row's task, the context each batch runs in: the
    environment's shared tool servers). The training client loads the tokenizer of
    ``model_path`` and renders with its chat template (``chat_template_kwargs`` passed to it); its
    tool parser is ``qwen3`` (Hermes ``<tool_call>`` JSON) for ``rollout.tool_parser = hermes``."""
    import verifiers.v1 as vf
    from renderers import DefaultRendererConfig

    source = verifiers_env(_target(spec))
    env, tasks = source.env, source.tasks
    renderer = DefaultRendererConfig(tool_parser="qwen3" if tool_parser == "hermes" else None,
                                     **dict(chat_template_kwargs or {}))

    async def agent(client: Any, row: dict) -> float:
        task = tasks[int(row["task"])]
        ctx = vf.ModelContext(model=model_name, client=vf.TrainClientConfig(
            base_url=str(client.base_url).rstrip("/"), renderer=renderer, renderer_model_name=str(model_path),
            api_key_var=ENDPOINT_KEY_VAR, timeout={"connect": min(30.0, timeout_s)}))
        episode = await env.run_episode(task, ctx)
        errors = [f"{e.type}: {e.message}" for e in episode.errors]
        errors += [f"{e.type}: {e.message}" for t in episode.traces for e in t.errors]
        if errors or not episode.ok or any(r is None for t in episode.traces for r in t.rewards.values()):
            raise RuntimeError(f"the verifiers episode failed: {'; '.join(errors) or 'its rubric did not run'}")
        return sum(reward_value(t.reward, "the verifiers rubric") for t in episode.traces)

    return agent, env.serving


# ------------------------------------------------------------------------------- OpenEnv
class OpenEnvTarget:
    """``<url>`` (a text environment) or ``mcp@<url>`` (an MCP tool environment)."""

    def __init__(self, url: str, mcp: bool) -> None:
        self.url, self.mcp = url.rstrip("/"), mcp

    @classmethod
    def parse(cls, target: str) -> "OpenEnvTarget":
        mcp = target.startswith("mcp@")
        url = target[4:] if mcp else target
        if not url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ConfigError(f"rollout.env 'openenv:{target}': the environment server's URL must start with "
                              "http:// or ws:// (openenv:http://127.0.0.1:8000, openenv:mcp@http://...)")
        return cls(url, mcp)

    @property
    def http(self) -> str:
        return self.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)

    def check(self) -> str | None:
        """The server answers ``/health``; a text environment's action has one text field
        (returned)."""
        import httpx

        try:
            httpx.get(f"{self.http}/health", timeout=HEALTH_TIMEOUT_S).raise_for_status()
            if self.mcp:
                return None
            schema = httpx.get(f"{self.http}/schema", timeout=HEALTH_TIMEOUT_S).json()
        except (httpx.HTTPError, ValueError) as e:
            raise ConfigError(f"the OpenEnv server at {self.url} is not reachable ({type(e).__name__}: {e}): "
                              "start it first (rollout.env openenv:<url>)") from None
        return action_field(schema.get("action") or {}, self.url)


def action_field(schema: dict, url: str) -> str:
    """The one string field of an OpenEnv action schema (the required one when there are several)."""
    props = schema.get("properties") or {}
    text = [k for k, v in props.items() if v.get("type") == "string" and k != "metadata"]
    required = [k for k in text if k in (schema.get("required") or [])]
    picked = required if len(required) == 1 else text
    if len(picked) != 1:
        raise ConfigError(f"the OpenEnv environment at {url} takes actions {sorted(props)}: rldsl sends the model's "
                          "reply as an action's one text field, and this action has "
                          f"{'none' if not picked else 'several: ' + ', '.join(picked)}")
    return picked[0]


def observation_text(observation: Any) -> str:
    """An observation as the user message: its one string field, else its fields as JSON
    (``done``, ``reward`` and ``metadata`` left out)."""
    data = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation or {})
    data = {k: v for k, v in data.items() if k not in ("done", "reward", "metadata") and v not in (None, "", [], {})}
    strings = [v for v in data.values() if isinstance(v, str)]
    if len(data) == 1 and strings:
        return strings[0]
    return json.dumps(data, sort_keys=True, default=str) if data else ""


def openenv_agent(spec: str, *, timeout_s: float, max_calls: int) -> Callable:
    """The agent that plays one OpenEnv episode through ``EnvClient`` (module docstring)."""
    target = OpenEnvTarget.parse(_target(spec))
    field = target.check()

    async def agent(client: Any, row: dict) -> float:
        import openai
        from openenv.core.generic_client import GenericEnvClient
        from openenv.core.mcp_client import MCPToolClient

        cls = MCPToolClient if target.mcp else GenericEnvClient
        rewards: list[float] = []
        steps = 0  # the environment's steps (reset and list_tools aside): its chances to reward
        async with _session(cls(base_url=target.url, connect_timeout_s=min(HEALTH_TIMEOUT_S, timeout_s),
                                message_timeout_s=timeout_s)) as env:
            result = await _reset(env, target.url)
            _add(rewards, result.reward)
            opening = observation_text(result.observation) or row["prompt"]
            messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + (
                [{"role": "user", "content": opening}] if isinstance(opening, str) else list(opening))
            tools = await _tools(env, target.url) if target.mcp else None
            for _ in range(max_calls):
                if result.done:
                    break
                try:
                    reply = await client.chat.completions.create(model=row["model"], messages=messages,
                                                                 **({"tools": tools} if tools else {}))
                except openai.BadRequestError as e:
                    if getattr(e, "code", None) == "context_length_exceeded":
                        break  # the context is full: the episode ends here, as a cut-off built-in one
                    raise
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if target.mcp:
                    if not message.tool_calls:
                        break
                    for call in message.tool_calls:
                        step, text = await _call_tool(env, call)
                        if step is not None:
                            result, steps = step, steps + 1
                            _add(rewards, step.reward)
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
                else:
                    result = await env.step({field: message.content or ""})
                    steps += 1
                    _add(rewards, result.reward)
                    if not result.done:
                        messages.append({"role": "user", "content": observation_text(result.observation)})
        return _episode_reward(rewards, steps, result.done, target.url)

    return agent


def _episode_reward(rewards: list[float], steps: int, done: bool, url: str) -> float:
    """The episode's reward: the sum of the rewards the environment reported. An episode the
    model ended before the environment ran a step -- its reply had no tool call the MCP
    environment could run, or the context was full at once -- earned nothing: 0, as an episode
    cut off before the environment was done scores 0 (a policy's malformed call is a sample to
    learn from, not a failed run). No reward otherwise (steps that ran and none rewarded, an
    environment ``done`` at reset: ``done``) is an error naming the environment (the episode's
    error, counted and reported to ``reward.on_error``)."""
    if rewards:
        return sum(rewards)
    if steps == 0 and not done:
        return 0.0
    raise RuntimeError(f"the OpenEnv environment at {url} reported no reward in this episode's "
                       f"{steps} step{'' if steps == 1 else 's'} (every StepResult.reward was None)")


@contextlib.asynccontextmanager
async def _session(env: Any) -> AsyncIterator[Any]:
    try:
        await env.connect()
        yield env
    finally:
        await env.close()


#: openenv-core's refusal: ``SessionCapacityError``'s message, sent as a CAPACITY_REACHED error.
CAPACITY = re.compile(r"(\d+)/(\d+) sessions active")


async def _reset(env: Any, url: str) -> Any:
    """``env.reset()``, the session's first message; :class:`EpisodeRefused` when the server refused
    the session. openenv-core's server accepts the WebSocket, answers a full server with a
    CAPACITY_REACHED error (``max_sessions``: its limit) and closes it: the client raises that
    error, or ``ConnectionClosedOK`` when the close came first (the error is then still buffered)."""
    from websockets.exceptions import ConnectionClosed

    try:
        return await env.reset()
    except RuntimeError as e:
        if "CAPACITY_REACHED" not in str(e):
            raise
        m = CAPACITY.search(str(e))
        raise EpisodeRefused(f"the OpenEnv server at {url} refused the session: {e}",
                             int(m.group(2)) if m else None) from None
    except ConnectionClosed as e:
        error = await _buffered_error(env)
        if (error or {}).get("code") != "CAPACITY_REACHED":
            if error:
                raise RuntimeError(f"Server error: {error.get('message')} (code: {error.get('code')})") from e
            raise
        limit = error.get("max_sessions")
        raise EpisodeRefused(f"the OpenEnv server at {url} refused the session: {error.get('message')} "
                             "(code: CAPACITY_REACHED)", limit if isinstance(limit, int) else None) from None


async def _buffered_error(env: Any) -> dict | None:
    """The error message the server sent before closing the session, when it sent one."""
    ws = getattr(env, "_ws", None)  # openenv-core 0.3's EnvClient connection
    try:
        message = json.loads(await asyncio.wait_for(ws.recv(), timeout=1.0))
    except Exception:  # noqa: BLE001 - none buffered (or no connection): the close stands alone
        return None
    return message.get("data") if isinstance(message, dict) and message.get("type") == "error" else None


class SessionGate:
    """The OpenEnv sessions of a runner's episodes: at most ``limit`` open at once. ``limit``:
    ``rollout.env_concurrency``, else ``rollout.agent_concurrency``; lowered to the server's own
    limit once it states it -- openenv-core states it (``max_concurrent_envs``, 1 by default) only
    in refusing a session, no route reports it -- so the first refusal sets it.

    An episode waits for a free session before its time limit starts; a refused one (the server
    full: the limit just learned, a session the server has not yet closed, other clients' sessions)
    gives its place back and starts again, after a back-off from ``BACKOFF_FIRST_S`` doubling to
    ``BACKOFF_MAX_S``, for up to ``wait_s`` of back-off in all; then it ends with an error naming
    both limits."""

    def __init__(self, configured: int | None, fallback: int, wait_s: float) -> None:
        self.configured, self.wait_s = configured, wait_s
        self.limit = configured or fallback
        self.server_limit: int | None = None  # as the server stated it
        self.peak = 0  # the most sessions this gate let open at once

    def refused(self, limit: int | None) -> None:
        if limit is not None and limit >= 1:
            self.server_limit = limit
            self.limit = min(self.limit, limit)

    def room(self) -> "_Room":
        """The gate in one batch's event loop."""
        return _Room(self)

    def gave_up(self, refusal: EpisodeRefused, waited: float) -> str:
        server = (f"it allows {self.server_limit} at once (its max_concurrent_envs)" if self.server_limit
                  else "it did not say how many it allows")
        ours = (f"rollout.env_concurrency = {self.configured}" if self.configured
                else "rollout.env_concurrency is unset: the server's limit")
        return (f"{refusal} -- still refused after {waited:g} s of retries (rollout.agent_timeout_s): {server}; "
                f"this run opens at most {self.limit} ({ours}); other clients' sessions may be keeping it full")


class _Room:
    def __init__(self, gate: SessionGate) -> None:
        self.gate, self.active = gate, 0
        self.changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[None]:
        async with self.changed:
            await self.changed.wait_for(lambda: self.active < self.gate.limit)
            self.active += 1
            self.gate.peak = max(self.gate.peak, self.active)
        try:
            yield
        finally:
            async with self.changed:
                self.active -= 1
                self.changed.notify_all()

    async def run(self, start: Callable[[], Any]) -> Outcome:
        """``start()``'s outcome, started once a session is free, again after each refusal."""
        waited, pause = 0.0, BACKOFF_FIRST_S
        while True:
            async with self._session():
                try:
                    return await start()
                except EpisodeRefused as e:
                    refusal = e
                    self.gate.refused(e.limit)  # before the place is given back
            if waited >= self.gate.wait_s:
                return Outcome(error=self.gate.gave_up(refusal, waited))
            step = min(pause, self.gate.wait_s - waited)
            await asyncio.sleep(step)
            waited, pause = waited + step, min(2 * pause, BACKOFF_MAX_S)


def _add(rewards: list[float], reward: Any) -> None:
    if reward is not None:  # the one check of a reward value: text is refused
        rewards.append(reward_value(reward, "the OpenEnv environment's step"))


async def _tools(env: Any, url: str) -> list[dict]:
    """The MCP environment's tools as OpenAI function tools. None listed is an error: openenv-core
    answers a ``list_tools`` that failed on the server with an empty list (the error stays there),
    and the model asked without tools would never call one."""
    listed = await env.list_tools()
    if not listed:
        raise RuntimeError(f"the MCP environment at {url} listed no tools (list_tools failed on the server, "
                           "or it has none)")
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema or {"type": "object", "properties": {}}}}
            for t in listed]


async def _call_tool(env: Any, call: Any) -> tuple[Any, str]:
    """One tool call as a ``CallToolAction`` step: (the step's result, the tool message's text);
    (None, the error) when its arguments are not a JSON object (no step ran)."""
    from openenv.core.env_server.mcp_types import CallToolAction

    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as e:
        arguments = None
        text = f"error: the arguments are not JSON ({e})"
    if not isinstance(arguments, dict):
        return None, text if arguments is None else "error: arguments must be an object"
    result = await env.step(CallToolAction(tool_name=call.function.name, arguments=arguments))
    obs = result.observation
    if getattr(obs, "error", None) is not None:
        return result, f"error: {obs.error.message}"
    value = getattr(obs, "result", None)
    if isinstance(value, dict) and "data" in value:
        value = value["data"]
    elif hasattr(value, "data"):
        value = value.data
    return result, value if isinstance(value, str) else json.dumps(value, default=str)


# --------------------------------------------------------------------------------- runner
def check_agent(agent: str | None, env: str | None, library: str | None) -> None:
    """``agent`` (``rollout.agent``) loads as an agent function, and ``env`` (``rollout.env``), an
    environment of ``library`` (verifiers, OpenEnv), passes :func:`check` (before any model loads)."""
    if agent is not None:
        load_agent(agent)
    if env is not None and library is not None:
        check(env, library)


def agent_runner(cfg: Any, model_path: str | Path, model_context: int | None) -> AgentRunner | None:
    """The episodes of a run that talk to the policy's endpoint: an ``AgentRunner`` with
    ``rollout.agent``, an :class:`EnvironmentRunner` with a library ``rollout.env``, else None."""
    r = cfg.rollout
    if r.agent is not None:
        return AgentRunner(load_agent(r.agent), model_name=served_name(model_path), max_calls=r.max_turns,
                           max_parallel=r.agent_max_parallel_calls, timeout_s=r.agent_timeout_s,
                           concurrency=r.agent_concurrency, context=model_context,
                           tool_parser=r.tool_parser,
                           system_prompt=source_system_prompt(cfg),
                           chat_template_kwargs=cfg.data.chat_template_kwargs)
    if env_library(r.env) is not None:
        return environment_runner(cfg, model_path, model_context)
    return None


def environment_runner(cfg: Any, model_path: str | Path, model_context: int | None) -> "EnvironmentRunner":
    """The ``AgentRunner`` of ``rollout.env = verifiers:... | openenv:...`` (recipe.py);
    ``model_context``: the model's context length."""
    r = cfg.rollout
    name = served_name(model_path)
    context = None
    if env_library(r.env) == "verifiers":
        agent, context = verifiers_agent(r.env, model_path=model_path, model_name=name, tool_parser=r.tool_parser,
                                         timeout_s=r.agent_timeout_s,
                                         chat_template_kwargs=cfg.data.chat_template_kwargs)
    sessions = None
    if env_library(r.env) != "verifiers":
        agent = openenv_agent(r.env, timeout_s=r.agent_timeout_s, max_calls=r.max_turns)
        sessions = SessionGate(r.env_concurrency, r.agent_concurrency, wait_s=r.agent_timeout_s)
    return EnvironmentRunner(agent, context, sessions=sessions, tasks=env_library(r.env) == "verifiers",
                             model_name=name, max_calls=r.max_turns,
                             max_parallel=r.agent_max_parallel_calls, timeout_s=r.agent_timeout_s,
                             concurrency=r.agent_concurrency, context=model_context,
                             tool_parser=r.tool_parser,
                             system_prompt=source_system_prompt(cfg),
                             chat_template_kwargs=cfg.data.chat_template_kwargs)


class EnvironmentRunner(AgentRunner):
    """An ``AgentRunner`` whose batches run inside the environment's own context (verifiers'
    shared tool servers); when that context fails to start, every episode of the batch ends
    with its error (the run goes on). With ``sessions`` (OpenEnv), each episode waits for a free
    session first, and a refused one starts again (:class:`SessionGate`). With ``tasks``
    (verifiers), a row points at a task: the agent's row has ``task``, the task's index (the
    data row's ``answer``: :func:`verifiers_examples`), where an agent's has ``answer``."""

    subject = "the environment's episode"

    def __init__(self, agent: Callable, batch_context: Callable | None, sessions: SessionGate | None = None,
                 tasks: bool = False, **kw: Any) -> None:
        super().__init__(agent, **kw)
        self.batch_context = batch_context
        self.sessions = sessions
        self.tasks = tasks

    def row(self, prompt: str | Sequence[dict], answer: str) -> dict:
        row = super().row(prompt, answer)
        if self.tasks:
            row["task"] = row.pop("answer")
        return row

    async def _episodes(self, rows: list[dict], server: Any) -> list[Outcome]:
        if self.batch_context is None:
            return await self._gated(rows, server)
        try:
            async with self.batch_context():
                return await self._gated(rows, server)
        except Exception as e:  # noqa: BLE001 - the environment's own start-up failed
            error = f"the environment failed to start: {type(e).__name__}: {e}"
            return [Outcome(error=error) for _ in rows]

    async def _gated(self, rows: list[dict], server: Any) -> list[Outcome]:
        if self.sessions is None:
            return await super()._episodes(rows, server)
        limit, room = asyncio.Semaphore(self.concurrency), self.sessions.room()

        async def episode(row: dict) -> Outcome:
            async with limit:  # rollout.agent_concurrency, then a free session, then the timed episode
                return await room.run(lambda: self._episode(row, server, contextlib.nullcontext()))

        return await asyncio.gather(*(episode(row) for row in rows))
