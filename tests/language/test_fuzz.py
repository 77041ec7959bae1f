"""Parser fuzzing: any text either loads or raises rldsl.SpecError -- never another exception.

Inputs: random text, and the library specs mutated (characters deleted, inserted, swapped,
lines duplicated or dropped, tokens from the grammar's vocabulary, the registry and Python
pasted in). Whatever loads must also generate valid Python; whatever fails must render,
with a position inside the file.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rldsl
from rldsl import SpecError, SpecErrors, codegen, registry
from rldsl.errors import source_lines

ROOT = Path(__file__).resolve().parents[2]
LIBRARY_TEXTS = [p.read_text(encoding="utf-8") for _, p in sorted(rldsl.library().items())]

GRAMMAR_TOKENS = ["algorithm", "extends", "(", ")", ",", "=", '"', '"text"', "#", "# c", "\n", "\r\n",
                  " ", "\t", "true", "false", "TRUE", "none", "0", "1", "-1", "+2", "0.5", ".5", "5.",
                  "1e-6", "1E400", "-1e400", "99999999999999999999999", "1" * 400, "nan", "inf", "-"]
REGISTRY_TOKENS = sorted(set(registry.SLOTS) | {c for comps in registry.REGISTRY.values() for c in comps}
                         | {p for comps in registry.REGISTRY.values() for c in comps.values()
                            for p in c.params} | {"loss", "reward"} | set(rldsl.library()))
PYTHON_TOKENS = ["import", "os", ".", "os.system", "__import__", "('os')", "exec", "eval", "lambda",
                 "'", '"""', ";", ":", "[", "]", "{", "}", "\\", "__class__", "__builtins__", "self",
                 "**", "@", "`", "$", "\x00", "\ufeff", "\u2028", "\x0c", "\x85", "\r", "é", "∑", "😀"]
FORMULA_TOKENS = ["define", "end", "define g\n", "\nend\n", "+", "*", "/", "^", "**", "<=", "==", "where(",
                  "sg(", "seq_mean(", "group_std(", "batch_quantile(", "rho", "A", "w", "L", "G", "1e-6", "= 0"]
VOCAB = GRAMMAR_TOKENS + REGISTRY_TOKENS + PYTHON_TOKENS + FORMULA_TOKENS
FORMULA_TEXTS = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "algorithms" / "examples").glob("*.rl"))
                 + sorted((ROOT / "tests" / "specs" / "formula").glob("*.rl"))]

FUZZ = settings(max_examples=600, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def _check(text: str) -> None:
    """The property: load, or fail with a well-formed SpecError."""
    try:
        algo = rldsl.loads(text, filename="fuzz.rl")
    except SpecError as e:
        rendered = e.render()
        assert rendered.startswith(e.file)
        for err in e.errors if isinstance(e, SpecErrors) else [e]:
            assert err.message and "\n" not in err.message
            if err.line:
                lines = source_lines(err.source or "") or [""]
                assert 1 <= err.line <= len(lines), (err.line, len(lines))
                assert 1 <= err.column <= len(lines[err.line - 1]) + 1, (err.column, lines[err.line - 1])
        return
    # what loads is a valid algorithm: its code generates and compiles
    gen = codegen.generate(algo)
    compile(gen.source, "fuzz-generated.py", "exec")


@st.composite
def mutated_spec(draw: st.DrawFn, texts: list[str] = LIBRARY_TEXTS) -> str:
    text = draw(st.sampled_from(texts))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["delete", "insert_char", "swap", "dup_line", "drop_line",
                                   "insert_token", "replace_token"]))
        n = len(text)
        i = draw(st.integers(0, max(n - 1, 0)))
        if op == "delete" and n:
            j = min(n, i + draw(st.integers(1, 4)))
            text = text[:i] + text[j:]
        elif op == "insert_char":
            text = text[:i] + draw(st.characters(codec="utf-8")) + text[i:]
        elif op == "swap" and n > 1:
            i = min(i, n - 2)
            text = text[:i] + text[i + 1] + text[i] + text[i + 2:]
        elif op in ("dup_line", "drop_line"):
            lines = text.split("\n")
            k = draw(st.integers(0, len(lines) - 1))
            lines[k:k + 1] = [lines[k]] * (2 if op == "dup_line" else 0)
            text = "\n".join(lines)
        elif op == "insert_token":
            sep = draw(st.sampled_from(["", " "]))
            text = text[:i] + sep + draw(st.sampled_from(VOCAB)) + sep + text[i:]
        elif op == "replace_token":
            words = text.split(" ")
            k = draw(st.integers(0, len(words) - 1))
            words[k] = draw(st.sampled_from(VOCAB))
            text = " ".join(words)
    return text


@FUZZ
@given(st.text(max_size=200))
def test_random_text(text: str) -> None:
    _check(text)


@FUZZ
@given(st.lists(st.sampled_from(VOCAB), max_size=30).map(" ".join))
def test_random_token_sequences(text: str) -> None:
    _check(text)


@FUZZ
@given(st.lists(st.sampled_from(VOCAB), max_size=12).map(lambda ts: "algorithm fuzz\n  " + " ".join(ts)))
def test_a_header_then_random_tokens(text: str) -> None:
    _check(text)


@settings(FUZZ, max_examples=2500)
@given(mutated_spec())
def test_mutated_library_specs(text: str) -> None:
    _check(text)


@settings(FUZZ, max_examples=500)
@given(mutated_spec(FORMULA_TEXTS))
def test_mutated_formula_specs(text: str) -> None:
    _check(text)


def test_the_property_sees_failures() -> None:
    """The check above must not pass vacuously: bad text fails it only through SpecError."""
    for text in ["", "algorithm", "algorithm x\n  kl k3", "algorithm x\n  baseline os.system"]:
        try:
            rldsl.loads(text)
        except SpecError:
            continue
        raise AssertionError(f"{text!r} should not load")
    _check(LIBRARY_TEXTS[0])  # a good spec passes through codegen


# ---------------------------------------------------------------------------------------
# Formulas: random expressions either fail with a SpecError or run, with the slot's shapes


import functools  # noqa: E402

import torch  # noqa: E402

from rldsl.formula import hooks, lang  # noqa: E402
from rldsl.ops import AdvantageBatch  # noqa: E402

FORMULA_SLOTS = ["trust_region", "objective", "kl", "aggregation", "ratio", "entropy",
                 "baseline", "normalizer", "filter", "shaping"]
NUMBERS = ["0", "1", "2", "0.5", "1e-6", "3.0", "0.0", "1e400", "100"]
NAMES = sorted(lang.INPUTS) + ["p", "x", "q", "rh0", "nan", "os"]
FUNCS = sorted(lang.FUNCTIONS) + ["mean", "max", "foo", "sg"]
OPS = ["+", "-", "*", "/", "^", "<", ">=", "==", "!="]


@functools.lru_cache(maxsize=None)
def _expr(depth: int = 3) -> st.SearchStrategy[str]:
    leaf = st.sampled_from(NAMES + NUMBERS)
    return st.recursive(leaf, lambda c: st.one_of(
        st.tuples(c, st.sampled_from(OPS), c).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(st.sampled_from(FUNCS), st.lists(c, min_size=0, max_size=3)).map(
            lambda t: f"{t[0]}({', '.join(t[1])})"),
        c.map(lambda x: f"-{x}")), max_leaves=8)


@functools.lru_cache(maxsize=None)
def _typed(names: tuple[str, ...], kind: str, depth: int) -> st.SearchStrategy[str]:
    """Mostly well-formed expressions over ``names``: many pass the checker and reach the code."""
    if kind == "bool":
        topk = sorted(n for n, f in lang.FUNCTIONS.items() if f.kind == "order" and f.arity == (2,))
        return st.one_of(
            st.tuples(_typed(names, "num", depth), st.sampled_from(["<", "<=", ">", ">=", "==", "!="]),
                      _typed(names, "num", depth)).map(lambda t: f"{t[0]} {t[1]} {t[2]}"),
            st.tuples(st.sampled_from(topk), _typed(names, "num", depth),
                      st.sampled_from(["0", "1", "2", "G / 2", "B"])).map(lambda t: f"{t[0]}({t[1]}, {t[2]})"))
    leaf = st.sampled_from(names + ("0", "1", "0.5", "2", "1e-6"))
    if depth == 0:
        return leaf
    sub = _typed(names, "num", depth - 1)
    reductions = sorted(n for n, f in lang.FUNCTIONS.items() if f.kind == "reduce" and f.arity == (1,))
    quantiles = sorted(n for n, f in lang.FUNCTIONS.items() if f.kind == "reduce" and f.arity == (2,))
    orders = sorted(n for n, f in lang.FUNCTIONS.items() if f.kind == "order" and f.arity == (1,))
    over_k = sorted(n for n, f in lang.FUNCTIONS.items() if f.kind == "kreduce")  # the top-K axis
    return st.one_of(
        leaf,
        st.tuples(sub, st.sampled_from(["+", "-", "*", "/", "^"]), sub).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(st.sampled_from(["exp", "log", "sigmoid", "tanh", "abs", "sqrt", "sign", "sg"]), sub).map(
            lambda t: f"{t[0]}({t[1]})"),
        st.tuples(st.sampled_from(["min", "max"]), sub, sub).map(lambda t: f"{t[0]}({t[1]}, {t[2]})"),
        st.tuples(sub, sub, sub).map(lambda t: f"clamp({t[0]}, {t[1]}, {t[2]})"),
        st.tuples(_typed(names, "bool", depth - 1), sub, sub).map(lambda t: f"where({t[0]}, {t[1]}, {t[2]})"),
        st.tuples(st.sampled_from(reductions), sub).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(st.sampled_from(quantiles), sub, st.sampled_from(["0", "0.25", "1", "1 - 1 / G"])).map(
            lambda t: f"{t[0]}({t[1]}, {t[2]})"),
        st.tuples(st.sampled_from(orders), sub).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(st.sampled_from(over_k), sub).map(lambda t: f"{t[0]}({t[1]})"),
        sub.map(lambda x: f"-{x}"))


@st.composite
def formula_spec(draw: st.DrawFn) -> tuple[str, str]:
    slot = draw(st.sampled_from(FORMULA_SLOTS))
    spec = lang.SLOTS[slot]
    typed = draw(st.booleans())
    lines = [] if typed else ["p = 0.5", f"x = {draw(_expr())}"]
    if slot == "kl":
        lines.append("beta = 0.1")
    for o in (spec.outputs[:1] if spec.one_of else spec.outputs):
        value = draw(_typed(tuple(spec.inputs), o.kind, 3)) if typed else draw(_expr())
        lines.append(f"{o.name} = {value}")
    if any("topk_logp" in ln for ln in lines):  # the policy's top-K: its size K (a formula parameter)
        lines.insert(0, "K = 3")
    text = ("algorithm fuzz\n  define gate\n" + "".join(f"    {ln}\n" for ln in lines) +
            f"  end\n  {slot}  gate\n")
    return slot, text


def _run(v) -> dict:  # noqa: ANN001 - a SlotValue with a formula
    fn = hooks.function(v)
    g = torch.Generator().manual_seed(0)
    B, T, G = 4, 3, 2
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    rand = lambda: torch.randn(B, T, generator=g)  # noqa: E731
    if v.formula.spec.stage == "loss":
        logp = -torch.rand(B, T, generator=g)
        return fn(torch.exp(rand()), torch.exp(rand()), rand(), logp, logp - 0.1, logp + 0.1,
                  torch.rand(B, T, generator=g), mask, G, rollout_logp=logp - 0.2,
                  teacher_logp=logp - 0.3, old_ent=torch.rand(B, T, generator=g),
                  seq_reward=torch.randn(B, generator=g), pol_topk_logp=-torch.rand(B, T, 3, generator=g),
                  old_topk_logp=-torch.rand(B, T, 3, generator=g),
                  is_top1=(torch.rand(B, T, generator=g) < 0.5).float(), ref_reward=torch.randn(B, generator=g))
    r = torch.randn(B, generator=g)
    batch = AdvantageBatch(rewards=r, raw_rewards=r, token_rewards=torch.zeros(B, T), mask=mask,
                           group_size=G, valid=torch.tensor([True, True, False, True]))
    logp = -torch.rand(B, T, generator=g)
    return fn(r, rand(), mask, G, batch, values=rand(), dense_rewards=rand() * mask, old_logp=logp,
              rollout_logp=logp - 0.1, self_certainty=torch.rand(B, T, generator=g) + 2.0,
              prompt_mean=torch.randn(B, generator=g),
              prompt_var=torch.rand(B, generator=g), prompt_count=torch.full((B,), 4.0),
              prompt_steps=torch.full((B,), 2.0), prompt_step_var=torch.rand(B, generator=g),
              ref_reward=torch.randn(B, generator=g), answer_prob=torch.rand(B, generator=g),
              bare_answer_prob=torch.rand(B, generator=g), node_value=torch.rand(B, T, generator=g),
              parent_value=torch.rand(B, T, generator=g), root_value=torch.rand(B, generator=g),
              node_leaves=torch.full((B, T), 1.0), parent_leaves=torch.full((B, T), 2.0))


@settings(FUZZ, max_examples=400)
@given(formula_spec())
def test_random_formulas_fail_cleanly_or_run_with_the_slot_shapes(case: tuple[str, str]) -> None:
    slot, text = case
    try:
        algo = rldsl.loads(text, filename="fuzz.rl")
    except SpecError as e:
        for err in e.errors if isinstance(e, SpecErrors) else [e]:
            assert err.message and "\n" not in err.message
            assert 1 <= err.line <= len(source_lines(text))
        return
    gen = codegen.generate(algo)  # the generated code compiles ...
    compile(gen.source, "fuzz-generated.py", "exec")
    out = _run(algo.slots[slot][0])  # ... and runs: every shape the checker accepted is a real shape
    spec = lang.SLOTS[slot]
    for o in spec.outputs:
        if o.name not in out:
            continue
        value = torch.as_tensor(out[o.name])
        want = {0: (), 1: (4,), 2: (4, 3)}[o.rank]
        if slot == "baseline":
            want = (4, 3)  # the advantage, on the tokens
        assert tuple(value.shape) == want, (o.name, tuple(value.shape), text)
        assert value.dtype.is_floating_point, (o.name, value.dtype)


def test_the_formula_property_sees_both_outcomes() -> None:
    ok = "algorithm fuzz\n  define gate\n    w = min(rho, 1.2)\n  end\n  trust_region  gate\n"
    bad = ok.replace("min(rho, 1.2)", "min(rho, mask > 0)")
    _run(rldsl.loads(ok)["trust_region"])
    with pytest.raises(SpecError):
        rldsl.loads(bad)
