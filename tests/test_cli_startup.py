"""The language commands start without the runtime: `rldsl --help`, `list`, `check`, `explain` and
`translate` (without --verify) import neither transformers nor the runtime's run, rollout, reward
or model modules. The runtime's commands are registered from rldsl/runtime/cli.py, whose bodies
import what they run.

The check is on ``sys.modules`` in a fresh interpreter (not on timing, which a busy machine
moves): every command above runs in one subprocess and the modules loaded are listed at the end.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: the runtime modules the command registration may load: the CLI module, its config and errors
#: (pydantic, no torch) and the run folder's file names
ALLOWED_RUNTIME = {"rldsl.runtime", "rldsl.runtime.cli", "rldsl.runtime.config", "rldsl.runtime.errors",
                   "rldsl.runtime.run_dir", "rldsl.runtime.records", "rldsl.runtime.records.run_dir"}

SCRIPT = r"""
import json, sys
from typer.testing import CliRunner
from rldsl.cli import app

runner = CliRunner()
codes = {}
for args in (["--help"], ["list"], ["check", "grpo", "dapo"], ["explain", "dapo"], ["explain", "grpo", "dapo"],
             ["translate", sys.argv[1]], ["run", "--help"], ["eval", "--help"], ["ablate", "--help"],
             ["reward", "--help"], ["serve-reward", "--help"], ["export", "--help"]):
    codes[" ".join(args)] = runner.invoke(app, args).exit_code
print(json.dumps({"codes": codes, "modules": sorted(sys.modules)}))
"""


def _loaded_after_language_commands() -> tuple[dict, list[str]]:
    trl = REPO / "tests" / "translate" / "trl_grpo.yaml"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(trl)], capture_output=True, text=True,
                         cwd=REPO, timeout=300, check=True).stdout
    data = json.loads(out.strip().splitlines()[-1])
    return data["codes"], data["modules"]


def test_language_commands_import_neither_transformers_nor_the_runtime():
    codes, modules = _loaded_after_language_commands()
    assert set(codes.values()) == {0}, codes
    assert not [m for m in modules if m.split(".")[0] in ("transformers", "vllm", "ray", "datasets")]
    runtime = {m for m in modules if m.startswith("rldsl.runtime")}
    assert runtime <= ALLOWED_RUNTIME, sorted(runtime - ALLOWED_RUNTIME)


HELP_SCRIPT = r"""
import json, sys
from typer.testing import CliRunner
from rldsl.cli import app

runner = CliRunner()
codes = {" ".join(a): runner.invoke(app, a).exit_code
         for a in (["--help"], ["check", "--help"], ["run", "--help"], ["eval", "--help"], ["ablate", "--help"])}
print(json.dumps({"codes": codes, "modules": sorted(sys.modules)}))
"""


def test_help_screens_do_not_import_torch():
    """`rldsl --help` and each command's --help import no torch (the language's components do,
    when a spec is first loaded): the help screens start in a fraction of a second."""
    out = subprocess.run([sys.executable, "-c", HELP_SCRIPT], capture_output=True, text=True,
                         cwd=REPO, timeout=300, check=True).stdout
    data = json.loads(out.strip().splitlines()[-1])
    assert set(data["codes"].values()) == {0}, data["codes"]
    assert not [m for m in data["modules"] if m.split(".")[0] == "torch"]


def test_import_rldsl_still_gives_the_whole_api():
    """The public names of docs/api.md load on first use: a spec loads and compiles after a bare
    ``import rldsl``, with every component registered."""
    code = ("import rldsl, sys; assert 'torch' not in sys.modules; a = rldsl.load('grpo'); "
            "fn = rldsl.compile(a, compile=False); from rldsl import registry; "
            "assert registry.REGISTRY['baseline']; print(type(fn).__name__, rldsl.SlotValue.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=300, check=True).stdout
    assert out.split() == ["CompiledAlgorithm", "SlotValue"]
