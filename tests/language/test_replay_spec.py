"""``sampling replay(...)``: the spec's replay policy, its checks (exit 2 at file:line:col) and explain."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rldsl
from rldsl import priority
from rldsl.priority import GroupFormula, ReplayPolicy

GOOD = '''algorithm grpo_replay extends grpo
  "GRPO with a replay buffer."
  sampling  replay(capacity=32, priority="std * sum(abs(adv))", max_age=4, per_step=2)
'''


def _check(tmp_path: Path, line: str) -> subprocess.CompletedProcess[str]:
    spec = tmp_path / "bad.rl"
    spec.write_text(f"algorithm b extends grpo\n  sampling  {line}\n", encoding="utf-8")
    return subprocess.run([sys.executable, "-m", "rldsl.cli", "check", str(spec)], capture_output=True,
                          text=True, timeout=120)


def test_the_spec_compiles_to_a_replay_policy() -> None:
    algo = rldsl.loads(GOOD, "r.rl")
    fn = rldsl.compile(algo, compile=False)
    p = fn.data.replay_policy
    assert isinstance(p, ReplayPolicy)
    assert (p.capacity, p.enter, p.use, p.per_step, p.max_age) == (32, "nonzero_std", "substitute", 2, 4)
    assert isinstance(p.priority, GroupFormula) and p.priority.text == "std * sum(abs(adv))"
    assert fn.data.dynamic_rounds == 1
    assert rldsl.compile(rldsl.load("grpo"), compile=False).data.replay_policy is None


def test_advantage_keep_is_part_of_the_policy() -> None:
    p = rldsl.compile(rldsl.loads(GOOD.replace("per_step=2)", "per_step=2, advantage=keep)"), "r.rl"),
                      compile=False).data.replay_policy
    assert p.advantage == "keep" and p.describe().endswith(", advantage kept")
    assert rldsl.compile(rldsl.loads(GOOD, "r.rl"), compile=False).data.replay_policy.advantage == "recompute"


def test_a_group_formula_is_evaluated_from_the_group_rewards() -> None:
    f = priority.parse("std * sum(abs(adv))")
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    std = float(r.std())
    assert f(r) == pytest.approx(std * 4 * 0.5, abs=1e-12)
    assert f(torch.tensor([1.0, float("nan"), 0.0])) == pytest.approx(0.5 ** 0.5, abs=1e-12)
    assert priority.parse("max(r) - min(r) + n")(r) == 5.0


def test_the_priority_is_a_formula_of_the_language() -> None:
    """Its inputs are the inputs table's (rldsl/inputs.py, read by the slot `priority`), its functions
    the language's table: where, clamp, sqrt, max of two, the plain and the batch_ reductions of the
    group's rows; evaluated by the code the emitter writes, against a hand computation."""
    from rldsl import inputs
    from rldsl.formula import emit, lang
    from rldsl.formula.argument import formula

    assert lang.ARGUMENTS["priority"].inputs == ("r",) + tuple(i.formula for i in inputs.readable("priority"))
    text = "where(mean > 0.4, max(r), 0.5) * clamp(std, 0, 0.5) + sqrt(n) * batch_std(adv) - min(max(adv, 0))"
    r = [1.0, 0.0, 0.0, 1.0, 1.0]
    mean = sum(r) / 5
    std = (sum((x - mean) ** 2 for x in r) / 4) ** 0.5
    want = 1.0 * min(std, 0.5) + 5 ** 0.5 * std - min(max(x - mean, 0.0) for x in r)
    assert priority.parse(text)(torch.tensor(r)) == pytest.approx(want, abs=1e-12)
    assert "fx.batch_std(" in emit.group_function_source(formula("priority", text))  # the language's own code
    # the compiled policy is plain data: it pickles (to Ray actors, FSDP ranks) and computes the same
    import pickle

    policy = rldsl.compile(rldsl.loads(GOOD, "r.rl"), compile=False).data.replay_policy
    again = pickle.loads(pickle.dumps(policy))
    assert again == policy and again.priority(torch.tensor(r)) == policy.priority(torch.tensor(r))


def test_explain_shows_the_replay_policy(tmp_path: Path) -> None:
    spec = tmp_path / "r.rl"
    spec.write_text(GOOD, encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "rldsl.cli", "explain", str(spec)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 'replay(capacity=32, enter=nonzero_std, priority="std * sum(abs(adv))", use=substitute, ' \
           'per_step=2, max_age=4, advantage=recompute)' in out.stdout
    assert ('replay: buffer of 32 groups, enter nonzero_std, priority "std * sum(abs(adv))", substitute '
            'non-informative groups, at most 2 per step, dropped after 4 versions') in out.stdout


@pytest.mark.parametrize("line, where, words", [
    ("replay(capacity=0)", ":2:29:", "argument 'capacity' of sampling replay must be >= 1, got 0"),
    ("replay(max_age=-1)", ":2:28:", "argument 'max_age' of sampling replay must be >= 0, got -1"),
    ('replay(priority="abs(adv) * std")', ":2:30:", "'priority' must be one number per group [], got [B]"),
    ('replay(priority="std * seq_sum(r)")', ":2:36:", "seq_sum is not available in a priority formula"),
    ('replay(priority="std * sum(abs(foo))")', ":2:44:", "unknown name 'foo'"),
    ('replay(priority="std *")', ":2:35:", "unexpected end of line, expected"),
    ('replay(priority="std * sum(abs(adv)")', ":2:48:", "unexpected end of line, expected ')'"),
    ('replay(priority="std * summ(r)")', ":2:36:", "unknown function 'summ'"),
    ("replay(priority=newset)", ":2:29:", "did you mean"),
    ("replay(use=mix, mix=1.5)", ":2:33:", "must be < 1"),
    ("replay(advantage=kept)", ":2:", "did you mean"),
])
def test_bad_replay_parameters_exit_2_at_file_line_col(tmp_path: Path, line: str, where: str, words: str) -> None:
    out = _check(tmp_path, line)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"bad.rl{where}" in out.stderr and words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
