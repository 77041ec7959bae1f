"""rldsl reward NAME --completion TEXT --answer TEXT [--prompt] [--finish-reason]: output and exit codes."""
from __future__ import annotations

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from rldsl.runtime.cli import register

runner = CliRunner()


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)  # the same hook that adds `run` and `plot`
    return app


def invoke(app, *args):
    return runner.invoke(app, ["reward", *args])


def test_math_prints_reward_answer_and_why(app):
    r = invoke(app, "math", "--completion", "The answer is 2/3.", "--answer", r"\frac{2}{3}")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines() == [
        "reward: 1",
        "math: 1",
        "  answer found: \"2/3\"  (anchored ('answer is'))",
        "  gold answer:  \"\\frac{2}{3}\"",
        "  why:          equal numbers",
    ]


def test_cut_off_completion_gets_nothing_unless_allowed(app):
    args = ["--completion", "Step 1: 3*4 = 12. Answer: 17, and", "--answer", "17", "--finish-reason", "length"]
    r = invoke(app, "math", *args)
    assert r.exit_code == 0 and r.output.startswith("reward: 0\n")
    assert "why:          cut off at the length limit (finish_reason=length): no credit" in r.output
    assert "answer found: \"17\"" in r.output  # found, but not credited
    r = invoke(app, "math(allow_truncated=true)", *args)
    assert r.exit_code == 0 and r.output.startswith("reward: 1\n"), r.output


def test_free_text_number_is_no_answer(app):
    r = invoke(app, "math", "--completion", "The roots are x = 1,2", "--answer", "12")
    assert r.exit_code == 0 and r.output.startswith("reward: 0\n")
    assert "answer found: none  (no \\boxed{}" in r.output and "why:          no final answer" in r.output


def test_gsm8k_takes_the_gold_after_hashes(app):
    r = invoke(app, "gsm8k", "--completion", "24 + 48 = 72\n#### 72", "--answer", "48/2 = 24 in May.\n#### 72")
    assert r.exit_code == 0
    assert r.output.splitlines()[:4] == ["reward: 1", "gsm8k: 1", "  answer found: \"72\"  ('####')",
                                         "  gold answer:  \"72\""]


def test_weighted_sum_with_a_user_function(app):
    r = invoke(app, "math=0.5,reward_helpers:answer_prefix=2", "--completion", "The answer is 42",
               "--answer", "4", "--prompt", "what is 2+2?")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    # math: 42 != 4 -> 0; answer_prefix: "4" is a prefix of "The..."? no -> 0
    assert lines[0] == "reward: 0"
    assert lines[1] == "math: 0 (weight 0.5)" and lines[-1] == "reward_helpers:answer_prefix: 0 (weight 2)"
    r = invoke(app, "math=0.5,reward_helpers:answer_prefix=2", "--completion", "4", "--answer", "4")
    assert r.output.splitlines()[0] == "reward: 2.5"  # 0.5 * 1 + 2 * 1


def test_plain_reward_prints_one_line(app):
    r = invoke(app, "exact", "--completion", " 42\n", "--answer", "42")
    assert (r.exit_code, r.output) == (0, "reward: 1\n")


@pytest.mark.parametrize(("args", "message"), [
    (["maht", "--completion", "1", "--answer", "1"], "error: unknown reward 'maht'"),
    (["math(strict=true)", "--completion", "1", "--answer", "1"], "has no option 'strict'"),
    (["math", "--completion", "1", "--answer", "1", "--finish-reason", "eos"],
     "error: --finish-reason must be 'stop' or 'length', got 'eos'"),
    (["math", "--completion", "1"], "Missing option '--answer'"),
])
def test_bad_input_exits_2(app, args, message):
    r = invoke(app, *args)
    assert r.exit_code == 2
    assert message in r.output


def test_a_failing_reward_exits_1(app):
    r = invoke(app, "reward_helpers:explode", "--completion", "1 boom", "--answer", "1")
    assert r.exit_code == 1
    assert "error: reward 'reward_helpers:explode' failed: ZeroDivisionError: boom" in r.output


def test_installed_command(tmp_path):
    """The real `rldsl` entry point has the command (registered with run and plot)."""
    res = subprocess.run([sys.executable, "-m", "rldsl.cli", "reward", "gsm8k", "--completion", "#### 1,000",
                          "--answer", "#### 1000"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == "reward: 1"
    assert "why:          equal numbers" in res.stdout


def test_reasoning_gym_scores_a_row_of_the_task_named(app):
    """`rldsl reward reasoning_gym --task NAME` scores offline with the task's own verifier: the
    value reasoning-gym's score_answer gives the generated row (partial credit kept); a task whose
    verifier reads the row's metadata is refused by name, as is a reasoning_gym reward without
    --task (exit 2, issue 45)."""
    pytest.importorskip("reasoning_gym")
    from reasoning_gym.factory import create_dataset
    from reasoning_gym.utils import extract_answer

    ds = create_dataset("spell_backward", size=3, seed=5)
    for entry in ds:
        completion = f"<answer>{entry['answer'][:-1]}x</answer>"  # the last letter wrong
        expected = ds.score_answer(extract_answer(completion), entry)
        r = invoke(app, "reasoning_gym", "--task", "spell_backward", "--prompt", entry["question"],
                   "--completion", completion, "--answer", entry["answer"])
        assert r.exit_code == 0, r.output
        assert 0 < expected < 1 and r.output.strip() == f"reward: {expected:g}"
    r = invoke(app, "reasoning_gym", "--task", "number_sorting", "--completion", "<answer>[1]</answer>",
               "--answer", "['1']")
    assert r.exit_code == 2 and "reads the generated row's metadata (keys direction)" in r.output
    r = invoke(app, "reasoning_gym", "--completion", "x", "--answer", "y")
    assert r.exit_code == 2 and "--task NAME" in r.output
    r = invoke(app, "reasoning_gym", "--task", "spel_backward", "--completion", "x", "--answer", "y")
    assert r.exit_code == 2 and "unknown reasoning-gym task 'spel_backward'" in r.output


def test_reasoning_gym_scores_one_task_without_importing_every_task(app):
    """`rldsl reward reasoning_gym --task spell_backward` imports that task's module, not
    reasoning-gym's package, whose __init__ imports every task (sympy, matplotlib: ~6 s of the
    command's ~8.5 s on a loaded 2-core machine; ~2.5 s after); the process's later import of
    reasoning-gym is the whole package, as usual."""
    pytest.importorskip("reasoning_gym")
    from rldsl.runtime.data import reasoning_gym as rg

    rg.task_names()  # the task -> module table cached, as any earlier command leaves it
    script = ("import sys\n"
              "from rldsl.runtime.rewards.cli import show_reward\n"
              "show_reward('reasoning_gym', '<answer>tac</answer>', 'tac', "
              "prompt='Spell this word backward (example: sun -> nus): cat', task='spell_backward')\n"
              "print(sorted(m for m in ('sympy', 'matplotlib', 'reasoning_gym') if m in sys.modules))\n"
              "from rldsl.runtime.data import reasoning_gym as rg\n"
              "print(len(rg.task_names()))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    reward, loaded, count = out.stdout.splitlines()
    assert reward == "reward: 1" and loaded == "[]"
    assert int(count) == len(rg.task_names()) > 50  # then the whole package, every task registered
