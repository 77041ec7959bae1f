"""Parser fuzzing: any text either loads or raises rldsl.SpecError -- never another exception.

Inputs: random text, and the library specs mutated (characters deleted, inserted, swapped,
lines duplicated or dropped, tokens from the grammar's vocabulary, the registry and Python
pasted in). Whatever loads must also generate valid Python; whatever fails must render,
with a position inside the file.
"""
from __future__ import annotations

from pathlib import Path

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
VOCAB = GRAMMAR_TOKENS + REGISTRY_TOKENS + PYTHON_TOKENS

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
def mutated_spec(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(LIBRARY_TEXTS))
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


def test_the_property_sees_failures() -> None:
    """The check above must not pass vacuously: bad text fails it only through SpecError."""
    for text in ["", "algorithm", "algorithm x\n  kl k3", "algorithm x\n  baseline os.system"]:
        try:
            rldsl.loads(text)
        except SpecError:
            continue
        raise AssertionError(f"{text!r} should not load")
    _check(LIBRARY_TEXTS[0])  # a good spec passes through codegen
