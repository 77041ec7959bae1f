"""The front end's contract under hostile input: every failure is a located spec error.

Property-based (hypothesis) beside ``test_fuzz.py``: mutants of every library spec, formulas
nested past any stack, ``extends`` cycles through files named otherwise than their algorithms,
long parent chains, unicode and huge files. Any exception that is not a :class:`SpecError` with
``file:line:col`` inside the file and a caret fails the test. Reporting N errors must stay linear
in N: checked by counting the work done (characters split into lines) and by a generous ratio of
best-of-3 times, never by an absolute time.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import rldsl
from rldsl import SpecError, SpecErrors, codegen, errors, explain, parser
from rldsl.cli import app
from rldsl.errors import source_lines
from rldsl.formula import hooks
from test_fuzz import mutated_spec  # noqa: E402,I001 - the character-level mutator

LIBRARY = sorted(rldsl.library().items())
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.function_scoped_fixture])


def _located(e: SpecError) -> None:
    """Each error names a file, a line and a column inside the file's text, and renders a caret."""
    for err in e.errors if isinstance(e, SpecErrors) else [e]:
        assert err.message and "\n" not in err.message
        assert err.line >= 1 and err.column >= 1, err.render()
        lines = source_lines(err.source or "") or [""]
        assert err.line <= len(lines), (err.line, len(lines))
        assert err.column <= len(lines[err.line - 1]) + 1
        rendered = err.render()
        assert rendered.startswith(f"{err.file}:{err.line}:{err.column}: error: ")
        assert "^" in rendered


def _loads_or_located(text: str, file: str = "fuzz.rl") -> rldsl.Algorithm | None:
    try:
        algo = rldsl.loads(text, filename=file)
    except SpecError as e:
        _located(e)
        return None
    compile(codegen.generate(algo).source, "fuzz-generated.py", "exec")
    return algo


# ---------------------------------------------------------------------------------------
# Deep formulas: refused at the place that passes the limit, or loaded, generated and explained

NESTINGS = {
    "negation": lambda d: "-" * d + "rho",
    "calls": lambda d: "exp(" * d + "rho" + ")" * d,
    "sum": lambda d: " + ".join(["rho"] * d),
    "power": lambda d: "^".join(["rho"] * d),
    "parentheses": lambda d: "(rho + " * d + "rho" + ")" * d,
    "min": lambda d: "min(" * d + "rho" + ", 2)" * d,
}


def _deep(kind: str, depth: int) -> str:
    return f"algorithm deep\n  define g\n    w = {NESTINGS[kind](depth)}\n  end\n  trust_region  g\n"


@SETTINGS
@given(st.sampled_from(sorted(NESTINGS)), st.integers(1, 3000))
def test_deep_formulas_load_or_fail_located(kind: str, depth: int) -> None:
    _loads_or_located(_deep(kind, depth))


@pytest.mark.parametrize("kind", sorted(NESTINGS))
def test_the_deepest_formula_allowed_goes_through_every_stage(kind: str) -> None:
    """At the limit, the checker, code generation and explain (all recursive) still work."""
    deepest = next(d for d in range(parser.MAX_DEPTH, 0, -1)
                   if _nesting(kind, d) <= parser.MAX_DEPTH)
    algo = rldsl.loads(_deep(kind, deepest))
    compile(codegen.generate(algo).source, "deep.py", "exec")
    assert explain.explain_lines(algo)
    assert callable(hooks.function(algo["trust_region"]))  # the emitted code builds
    with pytest.raises(SpecError) as e:
        rldsl.loads(_deep(kind, deepest + 2), "deep.rl")
    _located(e.value)
    assert "nested more than" in e.value.message


def _nesting(kind: str, depth: int) -> int:
    """How many formula levels ``NESTINGS[kind](depth)`` makes: each operator or call is one,
    and the name at the bottom is one (a sum or power of ``depth`` names has depth - 1 operators)."""
    return depth if kind in ("sum", "power") else depth + 1


def test_a_deep_formula_is_exit_2_with_a_caret_from_the_command_line(tmp_path: Path) -> None:
    f = tmp_path / "deep.rl"
    f.write_text(_deep("sum", 700), encoding="utf-8")
    r = CliRunner().invoke(app, ["check", str(f)])
    assert r.exit_code == 2, r.output
    assert f"{f}:3:" in r.output and "^" in r.output and "Traceback" not in r.output


# ---------------------------------------------------------------------------------------
# extends: cycles whatever the files are called, and chains too long to resolve


def test_an_extends_cycle_through_files_named_otherwise_is_located(tmp_path: Path) -> None:
    (tmp_path / "a.rl").write_text("algorithm x extends b\n", encoding="utf-8")
    (tmp_path / "b.rl").write_text("algorithm y extends a\n", encoding="utf-8")
    with pytest.raises(SpecError) as e:
        rldsl.load(tmp_path / "a.rl")
    _located(e.value)
    cycle = [err for err in e.value.errors if "cycle" in err.message]
    assert len(cycle) == 1 and cycle[0].file == str(tmp_path / "b.rl")
    assert cycle[0].message == "'extends' makes a cycle: x (a.rl) -> y (b.rl) -> x (a.rl)"
    assert (cycle[0].line, cycle[0].column) == (1, 21)
    r = CliRunner().invoke(app, ["check", str(tmp_path / "a.rl")])
    assert r.exit_code == 2 and "makes a cycle" in r.output and "RecursionError" not in r.output


def test_a_file_extending_itself_under_another_name(tmp_path: Path) -> None:
    (tmp_path / "self.rl").write_text("algorithm other extends self\n", encoding="utf-8")
    with pytest.raises(SpecError) as e:
        rldsl.load(tmp_path / "self.rl")
    _located(e.value)
    assert e.value.message == "'extends' makes a cycle: other (self.rl) -> other (self.rl)"


@SETTINGS
@given(st.integers(2, 6), st.data())
def test_random_extends_cycles_are_located(tmp_path_factory: pytest.TempPathFactory, n: int,
                                            data: st.DataObject) -> None:
    """n files in a ring, algorithm names drawn independently of the file names."""
    folder = tmp_path_factory.mktemp("ring")
    names = data.draw(st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True), min_size=n, max_size=n))
    for i, name in enumerate(names):
        (folder / f"f{i}.rl").write_text(f"algorithm {name} extends f{(i + 1) % n}\n", encoding="utf-8")
    with pytest.raises(SpecError) as e:
        rldsl.load(folder / "f0.rl")
    _located(e.value)
    assert any("cycle" in err.message for err in (e.value.errors if isinstance(e.value, SpecErrors)
                                                   else [e.value]))


def test_a_parent_chain_past_the_limit_is_located(tmp_path: Path) -> None:
    n = rldsl.spec.MAX_PARENTS + 30
    for i in range(n):
        (tmp_path / f"c{i}.rl").write_text(f"algorithm c{i} extends c{i + 1}\n", encoding="utf-8")
    (tmp_path / f"c{n}.rl").write_text(f"algorithm c{n} extends grpo\n", encoding="utf-8")
    with pytest.raises(SpecError) as e:
        rldsl.load(tmp_path / "c0.rl")
    _located(e.value)
    assert any("chain longer than" in err.message for err in e.value.errors)
    # the longest chain allowed loads: every ancestor resolved
    algo = rldsl.load(tmp_path / f"c{n - rldsl.spec.MAX_PARENTS + 1}.rl")
    assert algo.extends[-2:] == [f"c{n}", "grpo"] and len(algo.extends) == rldsl.spec.MAX_PARENTS


# ---------------------------------------------------------------------------------------
# Mutants of every library spec, unicode, huge files


@st.composite
def library_mutant(draw: st.DrawFn) -> str:
    """A library spec with whole lines duplicated, moved, dropped or given unicode and long runs."""
    _, path = draw(st.sampled_from(LIBRARY))
    lines = path.read_text(encoding="utf-8").split("\n")
    for _ in range(draw(st.integers(1, 6))):
        k = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["dup", "drop", "move", "unicode", "repeat", "nest"]))
        if op == "dup":
            lines.insert(k, lines[k])
        elif op == "drop" and len(lines) > 1:
            del lines[k]
        elif op == "move":
            lines.insert(draw(st.integers(0, len(lines) - 1)), lines.pop(k))
        elif op == "unicode":
            i = draw(st.integers(0, len(lines[k])))
            lines[k] = lines[k][:i] + draw(st.text(st.characters(codec="utf-8"), min_size=1, max_size=3)) \
                + lines[k][i:]
        elif op == "repeat":
            lines[k] = lines[k] * draw(st.integers(2, 50))
        elif op == "nest":
            lines.insert(k, "  define g\n    w = " + NESTINGS["calls"](draw(st.integers(150, 900))) + "\n  end")
    return "\n".join(lines)


@settings(SETTINGS, max_examples=300)
@given(library_mutant())
def test_library_mutants_load_or_fail_located(text: str) -> None:
    _loads_or_located(text)


NEW_SYNTAX = [
    """algorithm beta extends grpo
  define logbeta(a, b) = lgamma(a) + lgamma(b) -
                         lgamma(a + b)
  define mean_beta(a, b) = exp(logbeta(a + 1, b) - logbeta(a, b))
  define posterior
    s = group_sum(r)
    b = mean_beta(40 * (s + 1),   # successes
                  40 * (G - s + 1))
  end
  baseline  posterior
""",
    """algorithm c extends grpo
  define sq(x) = x * x
  define gate
    w = clamp(rho,
              0.8,
              1.2) *
        where(A > 0, sq(1), 0.5)
  end
  trust_region  gate
""",
]


@settings(SETTINGS, max_examples=150)
@given(mutated_spec(NEW_SYNTAX))
def test_mutants_of_functions_and_continued_lines_load_or_fail_located(text: str) -> None:
    _loads_or_located(text)


@pytest.mark.parametrize("text", [
    "algorithm c extends grpo\n  define gate\n    w = clamp(rho,\n              0.8,\n",
    "algorithm c extends grpo\n  define sq(x) = sq(1,\n",
])
def test_a_parenthesis_open_at_the_end_of_the_file_is_shown_on_its_last_line(text: str) -> None:
    """A last line ending inside an open parenthesis: the error is the end of the file, on the
    file's last line (it was reported one line past the end, where no caret can be drawn)."""
    with pytest.raises(SpecError) as e:
        rldsl.loads(text, filename="open.rl")
    _located(e.value)
    last = text.rstrip("\n").split("\n")
    assert (e.value.line, e.value.column) == (len(last), len(last[-1]) + 1)
    assert "unexpected end of file" in e.value.message


def test_every_library_spec_loads_as_it_is() -> None:
    for name, path in LIBRARY:
        assert _loads_or_located(path.read_text(encoding="utf-8"), str(path)) is not None, name


def test_a_huge_file_reports_every_error() -> None:
    n = 10_000
    text = "algorithm huge\n" + "".join(f"  baseline grp{i}\n" for i in range(n))
    with pytest.raises(SpecErrors) as e:
        rldsl.loads(text, "huge.rl")
    assert len(e.value.errors) == n
    rendered = e.value.render()
    assert rendered.endswith(f"\n\n{n} errors") and f"huge.rl:{n + 1}:3: error: " in rendered


# ---------------------------------------------------------------------------------------
# Reporting is linear in the number of errors


def _many_errors(n: int) -> SpecErrors:
    text = "algorithm m\n" + "".join(f"  trust_region clip(lo{i}=0.2)\n" for i in range(n))
    with pytest.raises(SpecErrors) as e:
        rldsl.loads(text, "m.rl")
    assert len(e.value.errors) == n
    return e.value


def test_rendering_splits_the_source_once_not_once_per_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An operation count: the characters split into lines while rendering N errors of one file
    stay within a small multiple of the file's size (it was N times the size)."""
    split = []
    real = errors.source_lines
    monkeypatch.setattr(errors, "source_lines", lambda s: split.append(len(s)) or real(s))
    for n in (500, 1000, 2000):
        e = _many_errors(n)
        errors._lines_of.cache_clear()
        split.clear()
        e.render()
        assert sum(split) <= 2 * len(e.source), (n, sum(split), len(e.source))


def test_rendering_time_grows_linearly() -> None:
    """A generous ratio of best-of-3 times: twice the errors may take at most ~3x (quadratic: 4x)."""
    def best(e: SpecErrors) -> float:
        times = []
        for _ in range(3):
            errors._lines_of.cache_clear()
            t = time.perf_counter()
            e.render()
            times.append(time.perf_counter() - t)
        return min(times)

    small, large = _many_errors(3000), _many_errors(6000)
    assert best(large) <= 3.0 * best(small) + 0.02
