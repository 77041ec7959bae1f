"""One loader of user code (runtime/plugins.py) for rewards, tools and environments: the same
references work for each kind (a module beside the command, a file by path), and every error
names the kind of thing that failed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rldsl.runtime import plugins
from rldsl.runtime.errors import ConfigError, RewardSpecError
from rldsl.runtime.rewards.functions import RewardFn
from rldsl.runtime.rollout.agents.runner import load_agent
from rldsl.runtime.rollout.episodes.env import load_env
from rldsl.runtime.rollout.episodes.tools import ToolPool, load_tools

TOOL = '''
def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b
'''
ENV = '''
class Echo:
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message):
        return [], 1.0, True
'''


@pytest.fixture
def beside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh current folder that is not on the import path (as for a user's command); the
    import path put back and the modules loaded from it forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if str(tmp_path) in (getattr(sys.modules[name], "__file__", None) or ""):
            del sys.modules[name]


def test_a_tools_module_beside_the_command_loads_without_a_reward_module_first(beside: Path) -> None:
    """`--tools mytools:add` from the folder that holds mytools.py (the rule --reward and --env follow)."""
    (beside / "plugin_tools_beside.py").write_text(TOOL)
    assert [f.__name__ for f in load_tools("plugin_tools_beside:add")] == ["add"]


def test_every_kind_loads_a_module_beside_the_command_and_a_file_by_path(beside: Path) -> None:
    (beside / "plugin_env_beside.py").write_text(ENV)
    (beside / "lib").mkdir()
    (beside / "lib" / "envs.py").write_text(ENV)
    (beside / "lib" / "tools.py").write_text(TOOL)
    assert load_env("plugin_env_beside:Echo").__name__ == "Echo"
    assert load_env("lib/envs.py:Echo").__name__ == "Echo"
    assert load_tools("lib/tools.py:add")[0](a=1, b=2) == 3


def test_a_tool_loaded_from_a_file_runs_in_the_tool_process(beside: Path) -> None:
    """Tools run in spawned processes, where a module loaded by path is loaded again by name."""
    (beside / "my_tools.py").write_text(TOOL)
    add = load_tools(f"{beside / 'my_tools.py'}:add")[0]
    runner = ToolPool()
    try:
        assert runner.run_many([(add, {"a": 2, "b": 3})], timeout_s=60, max_output_chars=100) == ["5"]
    finally:
        runner.close()


@pytest.mark.parametrize("kind, load", [
    (plugins.REWARD, lambda ref: RewardFn(ref)),
    (plugins.TOOL, load_tools),
    (plugins.ENVIRONMENT, load_env),
])
def test_errors_name_the_kind_that_failed(beside: Path, kind: plugins.Kind, load) -> None:
    """A broken environment is an environment error, not a reward error (and so for tools)."""
    wrong = (RewardSpecError,) if kind is plugins.REWARD else (ConfigError,)
    (beside / "broken_plugin.py").write_text("def f(:\n")
    cases = {
        "no_such_plugin_module:f": f"cannot import module 'no_such_plugin_module': no no_such_plugin_module.py "
                                   f"(or package no_such_plugin_module/) in the current folder {beside}",
        "missing/file.py:f": f"file not found: {beside / 'missing' / 'file.py'}",
        "broken_plugin:f": "importing module 'broken_plugin' failed: SyntaxError",
        "broken_plugin.py:f": "broken_plugin.py failed: SyntaxError",
    }
    for ref, message in cases.items():
        with pytest.raises(wrong) as err:
            load(ref)
        assert str(err.value).startswith(f"{kind.name} {ref!r}: "), str(err.value)
        assert message in str(err.value)
        assert (type(err.value) is RewardSpecError) == (kind is plugins.REWARD)
    with pytest.raises(wrong) as err:
        load("no_such_plugin_module:f")
    assert f"{kind.flag} path/to/no_such_plugin_module.py:f" in str(err.value)


@pytest.mark.parametrize("kind, load", [
    (plugins.REWARD, lambda ref: RewardFn(ref)),
    (plugins.TOOL, load_tools),
    (plugins.ENVIRONMENT, load_env),
    (plugins.AGENT, load_agent),
])
def test_a_missing_name_is_refused_with_what_the_module_has(beside: Path, kind: plugins.Kind, load) -> None:
    """Every kind says what the module holds of what it looks for (one message, plugins.missing)."""
    (beside / "plugin_has.py").write_text(TOOL + ENV + "\nasync def solve(client, row):\n    return 1.0\n")
    with pytest.raises(ConfigError) as err:
        load("plugin_has:nosuch")
    has = ("class 'nosuch'; its classes: Echo" if kind is plugins.ENVIRONMENT else
           "function 'nosuch'; its functions: add, solve")
    assert str(err.value) == (f"{kind.name} 'plugin_has:nosuch': module 'plugin_has' ({beside / 'plugin_has.py'}) "
                              f"has no {has}")
