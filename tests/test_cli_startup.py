"""The language commands start without the runtime: `rldsl --help`, `list`, `check`, `explain` and
`translate` (without --verify) import neither torch nor transformers nor the runtime's run,
rollout, reward or model modules. The runtime's commands are registered from
rldsl/runtime/cli.py, whose bodies import what they run; the components use torch through
rldsl/lazy_torch.py, which imports it at the first tensor operation.

The check is on ``sys.modules`` in a fresh interpreter (not on timing, which a busy machine
moves): every command above runs in one subprocess and the modules loaded are listed at the end.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: the runtime modules the command registration may load: the CLI module and its errors (the run
#: config is read by the commands that run, not by --help or the language commands)
ALLOWED_RUNTIME = {"rldsl.runtime", "rldsl.runtime.cli", "rldsl.runtime.errors"}

SCRIPT = r"""
import json, sys
from typer.testing import CliRunner
from rldsl.cli import app

runner = CliRunner()
codes = {}
for args in (["--help"], ["list"], ["check", "grpo", "dapo"], ["explain", "dapo"], ["explain", "grpo", "dapo"],
             ["explain", "--code", "dapo"], ["translate", sys.argv[1]], ["run", "--help"], ["eval", "--help"], ["ablate", "--help"],
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


def test_language_commands_import_neither_torch_nor_transformers_nor_the_runtime():
    codes, modules = _loaded_after_language_commands()
    assert set(codes.values()) == {0}, codes
    assert not [m for m in modules if m.split(".")[0] in ("torch", "transformers", "vllm", "ray", "datasets")]
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
    """`rldsl --help` and each command's --help import no torch: the help screens start in a
    fraction of a second."""
    out = subprocess.run([sys.executable, "-c", HELP_SCRIPT], capture_output=True, text=True,
                         cwd=REPO, timeout=300, check=True).stdout
    data = json.loads(out.strip().splitlines()[-1])
    assert set(data["codes"].values()) == {0}, data["codes"]
    assert not [m for m in data["modules"] if m.split(".")[0] == "torch"]


def _printed_by(code: str) -> list[str]:
    """The words ``code`` prints, run in a fresh interpreter."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          timeout=300, check=True).stdout.split()


def test_import_rldsl_still_gives_the_whole_api():
    """The public names of docs/api.md load on first use: a spec loads and compiles after a bare
    ``import rldsl``, with every component registered."""
    code = ("import rldsl, sys; assert 'torch' not in sys.modules; a = rldsl.load('grpo'); "
            "fn = rldsl.compile(a, compile=False); from rldsl import registry; "
            "assert registry.REGISTRY['baseline']; print(type(fn).__name__, rldsl.SlotValue.__name__)")
    assert _printed_by(code) == ["CompiledAlgorithm", "SlotValue"]


def test_torch_is_imported_at_the_first_tensor_operation():
    """Loading a spec reads the registry without torch; compiling it imports torch and puts it in
    place of the stand-in in every rldsl module, so torch.compile traces the components with
    torch itself. A component called before any compile imports torch on its own."""
    code = ("import sys, rldsl\n"
            "from rldsl.components import baseline\n"
            "a = rldsl.load('dapo'); assert 'torch' not in sys.modules\n"
            "rldsl.compile(a, compile=False); import torch\n"
            "stand_ins = [n for n, m in list(sys.modules.items()) if n.startswith('rldsl')\n"
            "             and 'torch' in vars(m) and vars(m)['torch'] is not torch]\n"
            "assert not stand_ins, stand_ins\n"
            "print(baseline.torch is torch)")
    assert _printed_by(code) == ["True"]
    code = ("import sys\n"
            "from rldsl import ops\n"
            "assert 'torch' not in sys.modules\n"
            "import torch\n"
            "x = torch.zeros(3)\n"
            "print(float(ops.masked_sum(x, torch.ones(3))), ops.torch is torch)")
    assert _printed_by(code) == ["0.0", "True"]


TYPO_SCRIPT = r"""
import importlib.util, json, sys
from pathlib import Path
from typer.testing import CliRunner
from rldsl.cli import app

spec = importlib.util.spec_from_file_location("cli_startup", sys.argv[2])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
tmp = Path(sys.argv[1])
bench.write_inputs(tmp)
found = {}
for i, (case, args) in enumerate(bench.TYPOS.items()):
    args = [a.format(tmp=tmp) for a in args]
    out = tmp / f"run{i}"
    r = CliRunner().invoke(app, ["run", *args, *([] if "--out" in args else ["--out", str(out)])])
    found[case] = {"code": r.exit_code, "output": r.output, "folder": out.exists(),
                   "occupied": sorted(p.name for p in (tmp / "occupied").iterdir())}
print(json.dumps({"cases": found, "modules": sorted(sys.modules)}))
"""


def test_run_rejects_a_typo_before_torch_loads(tmp_path):
    """`rldsl run` checks what needs no weights before it imports torch or transformers: each typo
    of bench/cli_startup.py's table (a missing data file, an unknown reasoning-gym task, an agent
    that does not import, a teacher folder that does not exist, the reasoning_gym reward on other
    data; issue 57's config, data, reward, image and --out errors) exits 2 with the reason,
    creates no run folder, leaves an occupied one as it was and loads neither (the bench times
    them: about a second)."""
    import importlib.util

    out = subprocess.run([sys.executable, "-c", TYPO_SCRIPT, str(tmp_path), str(REPO / "bench" / "cli_startup.py")],
                         capture_output=True, text=True, cwd=REPO, timeout=300, check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {
        "rldsl run grpo --data nosuch.jsonl": "nosuch.jsonl: no such file or folder",
        "rldsl run grpo --data reasoning_gym:spel_backward": ("unknown reasoning-gym task 'spel_backward'"
                                                             if importlib.util.find_spec("reasoning_gym")
                                                             else "reasoning-gym"),
        "rldsl run grpo --agent nosuch_agent:agent": "cannot import module 'nosuch_agent'",
        "rldsl run gkd --set teacher.path=nosuch_teacher": "nosuch_teacher: not found",
        "rldsl run grpo --reward reasoning_gym --data rows.jsonl": "reward 'reasoning_gym' scores rows of "
                                                                   "reasoning-gym data",
        "rldsl run grpo --set train.nosuch=1 (config)": "unknown config key 'train.nosuch'",
        "rldsl run grpo --data bad.jsonl (a bad line)": "bad.jsonl: line 2: invalid JSON",
        "rldsl run grpo --reward reward.py:two (signature)": "its signature is (prompt, completion)",
        "rldsl run grpo --data images.jsonl (text model)": "1 of 1 prompts hold images (the first: row 1)",
        "rldsl run grpo --out DIR (holds a run)": "occupied already holds a run",
    }
    assert set(data["cases"]) == set(expected)
    for case, message in expected.items():
        got = data["cases"][case]
        assert (got["code"], got["folder"], got["occupied"]) == (2, False, ["metrics.jsonl"]), (case, got)
        assert message in got["output"], (case, got["output"])
    assert not [m for m in data["modules"] if m.split(".")[0] in ("torch", "transformers")]
