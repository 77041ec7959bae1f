"""The harness rldsl runs verifiers environments with: verifiers' own bundled chat program (the
one its ``null`` harness runs: a chat loop with the task's MCP tools), started with this
process's Python instead of a ``uv``-provisioned interpreter -- verifiers' harnesses install
``uv`` and the program's packages from the internet at start-up, which a training machine need
not reach; the packages are already installed here (``rldsl[agents]``).

verifiers loads a harness by an importable id (``--env.agent.harness.id``) whose module exports one
``Harness`` subclass in ``__all__``: :func:`register` builds that module (verifiers is imported
then, by the runs that use it) and returns its id, :data:`HARNESS_ID`."""
from __future__ import annotations

import hashlib
import sys
import types
from typing import Any

#: The harness id verifiers resolves to the module :func:`register` builds.
HARNESS_ID = "rldsl_local_chat"


def register() -> str:
    """Make :data:`HARNESS_ID` an importable module exporting the harness; returns the id."""
    if HARNESS_ID not in sys.modules:
        module = types.ModuleType(HARNESS_ID, __doc__)
        module.LocalChatHarness = _harness_class()
        module.__all__ = ["LocalChatHarness"]
        sys.modules[HARNESS_ID] = module
    return HARNESS_ID


def _harness_class() -> type:
    from verifiers.v1.harnesses.null import NullHarness
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE, launch_chat_program

    class LocalChatHarness(NullHarness):
        """verifiers' chat program (``CHAT_PROGRAM_SOURCE``) run by ``sys.executable``."""

        async def setup(self, runtime: Any) -> None:
            """Nothing to provision: the program's packages are this process's."""

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
            system_prompt, prompt = self.resolve_prompt(data)
            return await launch_chat_program(
                CHAT_PROGRAM_SOURCE, self.config, ctx, trace, LocalPython(runtime), endpoint, secret, mcp_urls,
                system_prompt, prompt,
                extra_args=[f"--tool-interception-url={tool_interception_url}"] if tool_interception_url else ())

    LocalChatHarness.__module__ = HARNESS_ID
    return LocalChatHarness


class LocalPython:
    """A verifiers runtime whose PEP 723 scripts run with this process's Python (the rest is the
    runtime's own)."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    async def prepare_uv_script(self, script: str | bytes, env: dict | None = None, *, activate: bool = True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = f"vf-chat-{hashlib.sha256(data).hexdigest()[:16]}.py"
        await self._runtime.write(path, data)
        return [sys.executable, path]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)
