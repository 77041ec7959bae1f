"""OpenEnv environments for the tests, served by openenv-core 0.3's own server (`create_app`)
in a subprocess of their own: `python openenv_helpers.py KIND` binds 127.0.0.1 on a free port,
prints it, and serves until killed. KIND:

- ``text``: reset asks "12+34="; each reply (the action's ``message``) gets reward 1.0 when it is
  "46", else 0.25; done after the right answer or two replies.
- ``mcp``: an MCP tool environment whose ``calculator`` tool sums integers; every well-formed
  call is rewarded 1.0 (its ``CallToolObservation.reward``).
- ``dies``: as ``text``, but the server process exits on the first reply (an environment that
  dies mid-episode).
- ``hangs``: as ``text``, but the first reply never gets an answer.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class SumAction(Action):
    message: str


class SumObservation(Observation):
    prompt: str = ""


class SumEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> SumObservation:
        self._state = State(step_count=0)
        return SumObservation(prompt="12+34=", done=False, reward=None)

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

        def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
            return Observation(done=False, reward=None)

        def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
            return Observation(done=True, reward=0.0)

        async def _async_handle_call_tool(self, action, timeout_s=None):
            obs = await super()._async_handle_call_tool(action, timeout_s=timeout_s)
            obs.reward = 1.0 if obs.error is None else 0.0
            return obs

        @property
        def state(self) -> State:
            return self._state

    return CalcEnv


KIND = sys.argv[1] if __name__ == "__main__" and len(sys.argv) > 1 else "text"


class Server:
    """An environment server in a subprocess (``with Server("text") as url:``), killed on exit."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __enter__(self) -> str:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), self.kind],
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

    if KIND == "mcp":
        app = create_app(_mcp_env_class(), CallToolAction, CallToolObservation, max_concurrent_envs=64)
    else:
        app = create_app(SumEnv, SumAction, SumObservation, max_concurrent_envs=64)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on"))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
