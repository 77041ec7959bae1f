"""OpenEnv environments for the tests, served by openenv-core 0.3's own server (`create_app`)
in a subprocess of their own: `python openenv_helpers.py KIND [SESSIONS]` binds 127.0.0.1 on a free
port, prints it, and serves until killed. SESSIONS: the server's ``max_concurrent_envs`` (64 unless
given; ``default``: none passed, openenv-core's own default of one session at once). KIND:

- ``text``: reset asks "12+34="; each reply (the action's ``message``) gets reward 1.0 when it is
  "46", else 0.25; done after the right answer or two replies.
- ``mcp``: an MCP tool environment whose ``calculator`` tool sums integers; every well-formed
  call is rewarded 1.0 (its ``CallToolObservation.reward``).
- ``mcp_unrewarded``: as ``mcp``, but no step reports a reward.
- ``mcp_no_tools``: as ``mcp``, but ``list_tools`` fails on the server (openenv-core then
  answers an empty list).
- ``dies``: as ``text``, but the server process exits on the first reply (an environment that
  dies mid-episode).
- ``hangs``: as ``text``, but the first reply never gets an answer.

The text environments count their sessions (those reset and not yet closed: now and at most at
once) and the WebSocket connections the server was asked for (refused ones included); ``GET
/test/sessions`` answers the counts, ``DELETE /test/sessions`` starts them again from the sessions
live now.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class SumAction(Action):
    message: str


class SumObservation(Observation):
    prompt: str = ""


#: sessions reset and not closed ("live"), the most at once ("peak"), all reset ("opened"), and the
#: WebSocket connections asked for ("connections"; the refused ones included)
COUNTS = {"live": 0, "peak": 0, "opened": 0, "connections": 0}
_counts_lock = threading.Lock()


class SumEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self._live = False

    def reset(self, seed=None, episode_id=None, **kwargs) -> SumObservation:
        self._state = State(step_count=0)
        with _counts_lock:
            if not self._live:
                self._live = True
                COUNTS["live"] += 1
                COUNTS["opened"] += 1
                COUNTS["peak"] = max(COUNTS["peak"], COUNTS["live"])
        return SumObservation(prompt="12+34=", done=False, reward=None)

    def close(self) -> None:
        with _counts_lock:
            if self._live:
                self._live = False
                COUNTS["live"] -= 1

    def step(self, action: SumAction, timeout_s=None, **kwargs) -> SumObservation:
        if KIND == "dies":
            os._exit(3)
        if KIND == "hangs":
            time.sleep(3600)
        self._state.step_count += 1
        right = action.message.strip() == "46"
        done = right or self._state.step_count >= 2
        return SumObservation(prompt="" if done else "12+34=", done=done, reward=1.0 if right else 0.25)

    @property
    def state(self) -> State:
        return self._state


def _mcp_env_class():
    from fastmcp import FastMCP
    from openenv.core.env_server.mcp_environment import MCPEnvironment

    class CalcEnv(MCPEnvironment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            mcp = FastMCP("calc")

            @mcp.tool()
            def calculator(expression: str) -> str:
                """Evaluate a sum of integers such as 12+34."""
                return str(sum(int(t) for t in expression.split("+")))

            super().__init__(mcp)
            self._state = State(step_count=0)

        async def _async_list_tools(self) -> list:
            if KIND == "mcp_no_tools":
                raise RuntimeError("the tool server is down")
            return await super()._async_list_tools()

        def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
            return Observation(done=False, reward=None)

        def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
            return Observation(done=True, reward=0.0)

        async def _async_handle_call_tool(self, action, timeout_s=None):
            obs = await super()._async_handle_call_tool(action, timeout_s=timeout_s)
            obs.reward = None if KIND == "mcp_unrewarded" else 1.0 if obs.error is None else 0.0
            return obs

        @property
        def state(self) -> State:
            return self._state

    return CalcEnv


KIND = sys.argv[1] if __name__ == "__main__" and len(sys.argv) > 1 else "text"
SESSIONS = sys.argv[2] if __name__ == "__main__" and len(sys.argv) > 2 else "64"


class Server:
    """An environment server in a subprocess (``with Server("text") as url:``), killed on exit;
    ``sessions``: its ``max_concurrent_envs`` ("default": openenv-core's own)."""

    def __init__(self, kind: str, sessions: int | str = 64) -> None:
        self.kind, self.sessions = kind, str(sessions)

    def __enter__(self) -> str:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), self.kind, self.sessions],
                                     stdout=subprocess.PIPE, text=True)
        port = self.proc.stdout.readline().strip()  # printed once the socket is bound and listening
        if not port.isdigit():
            self.proc.kill()
            raise RuntimeError(f"the {self.kind} environment server did not start")
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def main() -> None:
    import uvicorn
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    limit = {} if SESSIONS == "default" else {"max_concurrent_envs": int(SESSIONS)}
    if KIND.startswith("mcp"):
        app = create_app(_mcp_env_class(), CallToolAction, CallToolObservation, **limit)
    else:
        app = create_app(SumEnv, SumAction, SumObservation, **limit)

    @app.get("/test/sessions")
    def sessions() -> dict:
        with _counts_lock:
            return dict(COUNTS)

    @app.delete("/test/sessions")
    def zero_sessions() -> dict:
        with _counts_lock:
            COUNTS.update(peak=COUNTS["live"], opened=0, connections=0)
            return dict(COUNTS)

    app = _counting_connections(app)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on"))
    server.run(sockets=[sock])


def _counting_connections(app):
    """``app`` counting the WebSocket sessions it is asked for (``COUNTS["connections"]``)."""
    async def counted(scope, receive, send):
        if scope["type"] == "websocket" and scope["path"] == "/ws":
            with _counts_lock:
                COUNTS["connections"] += 1
        await app(scope, receive, send)

    return counted


if __name__ == "__main__":
    main()
