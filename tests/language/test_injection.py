"""No text from a spec file becomes code.

Names and strings crafted to look like Python are rejected with a SpecError before any code
is generated; the description (free text) never reaches the generated source; the code
generator refuses any literal that is not a validated number or a registry choice; and every
identifier in the generated code comes from the registry or the templates.
"""
from __future__ import annotations

import ast
import inspect
import io
import keyword
import math
import re
import tokenize
from functools import lru_cache
from importlib import resources
from pathlib import Path

import pytest

import rldsl
from rldsl import SlotValue, SpecError, codegen, inputs, registry
from rldsl.generated import CodegenError, literal

ROOT = Path(__file__).resolve().parents[2]
H = "algorithm demo\n"

# (id, spec text, the exact error message: the first one if there are several)
REJECTED = [
    ("import_call_component", H + "  baseline      __import__('os')\n", "unexpected character \"'\""),
    ("dotted_component", H + "  baseline      os.system\n", "unexpected character '.'"),
    ("dotted_value", H + "  trust_region  clip(low=torch.inf)\n", "unexpected character '.'"),
    ("statement_in_string", H + "  trust_region  clip(low=\"; import os; \")\n",
     "argument 'low' takes a number, not a string"),
    ("quoted_choice", H + "  kl            k3(beta=0.1, where=\"loss\")\n",
     "argument 'where' takes one of 'loss', 'reward', not a string"),
    ("newline_in_string", H + "  trust_region  clip(low=\"0.2\n)\")\n", "unterminated string"),
    ("semicolon", H + "  baseline      group_mean; import os\n", "unexpected character ';'"),
    ("import_statement", H + "  import        os\n", "unknown slot 'import'"),
    ("exec_component", H + "  baseline      exec\n", "unknown baseline 'exec'"),
    ("eval_argument", H + "  baseline      ema(eval=1)\n", "unknown argument 'eval' for baseline ema"),
    ("dunder_slot", H + "  __class__     group_mean\n", "unknown slot '__class__'"),
    ("dunder_component", H + "  baseline      __init__\n", "unknown baseline '__init__'"),
    ("dunder_argument", H + "  trust_region  clip(__class__=1)\n",
     "unknown argument '__class__' for trust_region clip"),
    ("dunder_choice", H + "  kl            k3(beta=0.1, where=__import__)\n",
     "argument 'where' must be one of 'loss', 'reward', got '__import__'"),
    ("dunder_algorithm", "algorithm __builtins__\n",
     "algorithm name '__builtins__' must start with a lower case letter, then lower case letters, "
     "digits or '_'"),
    ("dunder_parent", "algorithm demo extends __init__\n",
     "parent name '__init__' must start with a lower case letter, then lower case letters, "
     "digits or '_'"),
    ("python_true", H + "  normalizer    whiten(shift_mean=True)\n",
     "argument 'shift_mean' takes true or false, got 'True'"),
    ("name_as_number", H + "  trust_region  clip(low=getattr)\n", "argument 'low' takes a number, got 'getattr'"),
    ("triple_quotes", H + "  \"\"\"import os\"\"\"\n", "unexpected '\"import os\"', expected end of file or end of line"),
    ("huge_number", H + "  trust_region  clip(low=1e400)\n", "argument 'low' must be a finite number"),
    ("huge_int", H + "  aggregation   token_sum_norm(max_tokens=" + "9" * 400 + ")\n",
     "argument 'max_tokens' must be a finite number"),
    ("nan", H + "  trust_region  clip(low=nan)\n", "argument 'low' takes a number, got 'nan'"),
    ("inf", H + "  entropy       bonus(coef=inf)\n", "argument 'coef' takes a number, got 'inf'"),
    ("minus_inf", H + "  trust_region  truncate(high=-inf)\n", "unexpected character '-'"),
    ("backslash", H + "  baseline      group_mean \\\n", "unexpected character '\\\\'"),
    ("decorator", H + "  @property\n", "unexpected character '@'"),
    ("brackets", H + "  filter        [overlong]\n", "unexpected character '['"),
]


@pytest.mark.parametrize("text,message", [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_python_lookalikes_are_rejected_before_codegen(text: str, message: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_codegen(*a: object, **k: object) -> None:
        raise AssertionError("code was generated for a rejected spec")

    monkeypatch.setattr(codegen, "generate", no_codegen)
    with pytest.raises(SpecError) as info:
        rldsl.compile(rldsl.loads(text, filename="evil.rl"), compile=False)
    assert info.value.message == message
    assert info.value.line >= 1 and info.value.column >= 1


SNEAKY_DESCRIPTION = ("__import__('os').system('rm -rf /'); exec(open('x').read()) "
                      "''' \\\\ {{ evil_jinja }} {% raw %} #: payload_marker")


def test_description_is_text_that_never_reaches_the_code() -> None:
    base = (ROOT / "algorithms" / "grpo.rl").read_text(encoding="utf-8")
    sneaky = base.replace('"Group-relative advantages (r - mean) / std, PPO clip, k3 KL in the loss."',
                          f'"{SNEAKY_DESCRIPTION}"')
    assert sneaky != base
    algo = rldsl.loads(sneaky.replace("algorithm grpo", "algorithm os_system_payload"),
                       filename="algorithms/grpo.rl")
    assert algo.description == SNEAKY_DESCRIPTION
    source = rldsl.compile(algo, compile=False).source
    for fragment in ("__import__", "system", "rm -rf", "exec(", "open(", "evil_jinja", "payload_marker",
                     "os_system_payload", "'''"):
        assert fragment not in source, fragment
    # the name and the description do not change the code at all
    assert source == rldsl.compile(rldsl.load("grpo"), compile=False).source


# ---------------------------------------------------------------------------------------
# generated.literal: the one writer of Python literals (templates and formulas)


@pytest.mark.parametrize("value,expected", [
    (None, "None"), (True, "True"), (False, "False"), (0, "0"), (4096, "4096"), (-3, "-3"),
    (0.2, "0.2"), (1e-6, "1e-06"), (-0.5, "-0.5"), (1e300, "1e+300"),
])
def test_literal_emits_plain_literals(value: object, expected: str) -> None:
    out = literal(value)
    assert out == expected
    assert ast.literal_eval(out) == value


def test_literal_emits_a_registry_choice() -> None:
    choices = registry.get("kl", "k3").params["where"].choices
    assert literal("loss", choices) == "'loss'"
    assert literal("reward", choices) == "'reward'"


@pytest.mark.parametrize("value,choices", [
    ("os", ()),                                   # a string that is no choice at all
    ("os", ("loss", "reward")),                   # not one of these choices
    ("loss", ()),                                 # a choice of another parameter is not enough
    ("__import__('os')", ("__import__('os')",)),  # even if listed: not an identifier
    ("a'b", ("a'b",)),
    ("loss\n", ("loss\n",)),                     # a trailing newline is not an identifier
    ("Loss", ("Loss",)),
    (float("nan"), ()), (float("inf"), ()), (float("-inf"), ()),
    (b"loss", (b"loss",)), ([0.2], ()), ((0.2,), ()), ({"a": 1}, ()), (object(), ()), (1j, ()),
])
def test_literal_refuses_anything_else(value: object, choices: tuple) -> None:
    with pytest.raises(CodegenError):
        literal(value, choices)


def test_codegen_refuses_an_unchecked_value_that_bypassed_the_checker() -> None:
    algo = rldsl.load("grpo")
    slots = dict(algo.slots)
    slots["trust_region"] = [SlotValue(slot="trust_region", component="clip",
                                       params={"low": "0.2); __import__('os').system('x'); (", "high": 0.2})]
    with pytest.raises(CodegenError, match="refusing to emit str literal"):
        codegen.generate(algo.model_copy(update={"slots": slots}))
    slots["trust_region"] = [SlotValue(slot="trust_region", component="clip",
                                       params={"low": float("nan"), "high": 0.2})]
    with pytest.raises(CodegenError, match="non-finite literal"):
        codegen.generate(algo.model_copy(update={"slots": slots}))
    slots["trust_region"] = [SlotValue(slot="trust_region", component="os", params={})]
    with pytest.raises((CodegenError, KeyError), match="os"):
        codegen.generate(algo.model_copy(update={"slots": slots}))


# ---------------------------------------------------------------------------------------
# Every identifier in the generated code is a registry name or comes from the templates


_JINJA = re.compile(r"\{\{.*?\}\}|\{%.*?%\}|\{#.*?#\}", re.S)
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@lru_cache(maxsize=1)
def _template_text() -> str:
    """The templates with every Jinja expression and tag removed: only their literal text."""
    folder = resources.files("rldsl").joinpath("templates")
    texts = [f.read_text("utf-8") for f in folder.iterdir() if f.name.endswith(".j2")]
    assert len(texts) >= 2
    return "\n".join(_JINJA.sub(" ", t) for t in texts)


@lru_cache(maxsize=1)
def allowed_names() -> frozenset[str]:
    """Registry names (slots, components, parameters), the inputs table's argument and batch field
    names, and the words of the templates' own text."""
    names = set(registry.SLOTS) | {"True", "False", "None"}
    names.update(n for i in inputs.INPUTS.values() for n in (i.arg, i.batch) if n)
    for comps in registry.REGISTRY.values():
        for c in comps.values():
            names.add(c.name)
            names.update(c.params)
    names.update(_WORD.findall(_template_text()))
    # the fixed words of the "where" comment the generator writes after each call
    for node in ast.walk(ast.parse(inspect.getsource(codegen._where))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(_WORD.findall(node.value))
    return frozenset(names)


@lru_cache(maxsize=1)
def allowed_strings() -> frozenset[str]:
    strings = set(re.findall(r'"[^"\n]*"|\'[^\'\n]*\'', _template_text()))
    for comps in registry.REGISTRY.values():
        for c in comps.values():
            for p in c.params.values():
                strings.update(repr(ch) for ch in p.choices)
    return frozenset(strings)


def foreign_tokens(source: str) -> list[str]:
    """Tokens of ``source`` that come neither from the registry nor from the templates."""
    bad = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string not in allowed_names():
            bad.append(tok.string)
        elif tok.type == tokenize.COMMENT:
            bad += [w for w in _WORD.findall(tok.string) if w not in allowed_names()]
        elif tok.type == tokenize.STRING and tok.string not in allowed_strings():
            bad.append(tok.string)
        elif tok.type == tokenize.NUMBER and not math.isfinite(float(tok.string)):
            bad.append(tok.string)
        elif tok.type == tokenize.ERRORTOKEN and not tok.string.isspace():
            bad.append(tok.string)
    return bad


def test_the_allow_list_is_not_too_wide() -> None:
    dangerous = {"os", "sys", "system", "subprocess", "exec", "eval", "compile", "open", "getattr",
                 "setattr", "globals", "locals", "__import__", "__builtins__", "__class__", "import",
                 "lambda", "del", "importlib", "pickle"}
    assert not dangerous & allowed_names()
    assert not {'"os"', "'os'"} & allowed_strings()
    assert {"torch", "def", "return", "mask", "clip", "trust_region", "low"} <= allowed_names()


def test_the_token_check_sees_injected_code() -> None:
    source = rldsl.compile(rldsl.load("grpo"), compile=False).source
    assert foreign_tokens(source) == []
    doctored = source.replace("    return total,", "    __import__('os').system('x')  # payload\n"
                                                    "    return total,")
    assert foreign_tokens(doctored) == ["__import__", "'os'", "system", "'x'", "payload"]
    assert foreign_tokens(source.replace("low=0.2", "low=1e400")) == ["1e400"]


SPECS = [f"algorithms/{n}.rl" for n in sorted(rldsl.library())] + \
    sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "specs" / "good").glob("*.rl"))


@pytest.mark.parametrize("spec", SPECS)
def test_generated_code_holds_only_registry_and_template_names(spec: str, in_root: Path) -> None:
    algo = rldsl.load(spec)
    source = codegen.generate(algo).source
    assert foreign_tokens(source) == []
    # the definitions use only keywords and names the template defines
    names = {t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.NAME}
    assert not {n for n in names if n.startswith("__")}
    assert {n for n in names if keyword.iskeyword(n)} <= {"def", "return", "if", "else", "is", "not",
                                                          "None", "True", "False", "with", "and", "or"}


# ---------------------------------------------------------------------------------------
# Formulas: define blocks never reach Python as text


def _define(*lines: str, slot: str = "trust_region", name: str = "gate") -> str:
    return (H + f"  define {name}\n" + "".join(f"    {ln}\n" for ln in lines) + "  end\n" +
            f"  {slot}  {name}\n")


FORMULA_REJECTED = [
    ("import_call", _define('w = __import__("os")'),
     "unexpected '\"os\"'"),
    ("method_call", _define("w = rho.exp()"), "unexpected character '.'"),
    ("torch_attribute", _define("w = torch.exp(rho)"), "unexpected character '.'"),
    ("exec_function", _define("w = exec(rho)"), "unknown function 'exec'"),
    ("eval_function", _define("w = eval(rho)"), "unknown function 'eval'"),
    ("globals_function", _define("w = globals()"), "unknown function 'globals'"),
    ("os_name", _define("w = rho * os"), "unknown name 'os'"),
    ("builtins_name", _define("w = __builtins__"), "unknown name '__builtins__'"),
    ("lambda_name", _define("w = lambda"), "unknown name 'lambda'"),
    ("semicolon", _define("w = rho; import os"), "unexpected character ';'"),
    ("subscript", _define("w = rho[0]"), "unexpected character '['"),
    ("matmul", _define("w = rho @ rho"), "unexpected character '@'"),
    ("python_conditional", _define("w = rho if A > 0 else 1"), "unexpected 'if'"),
    ("f_string", _define('w = f"{rho}"'), "unexpected '\"{rho}\"'"),
    ("backslash", _define("w = rho \\"), "unexpected character '\\\\'"),
    ("dunder_binding", _define("__class__ = rho", "w = rho"), "binding name '__class__' must start with a letter"),
    ("dunder_define", _define("w = rho", name="__init__"),
     "define name '__init__' must start with a lower case letter, then lower case letters, digits or '_'"),
    ("nan_name", _define("w = rho * nan"), "unknown name 'nan'"),
    ("huge_number", _define("w = min(rho, 1e400)"), "the number 1e400 is not finite"),
    ("overflowing_constant", _define("w = rho * exp(1000)"), "exp(1000) has no finite value"),
    ("keyword_argument", _define("w = clamp(rho, min=0.8, max=1.2)"), "unexpected '='"),
    ("star_args", _define("w = max(*rho)"), "unexpected '*'"),
]


@pytest.mark.parametrize("text,message", [c[1:] for c in FORMULA_REJECTED], ids=[c[0] for c in FORMULA_REJECTED])
def test_python_lookalikes_in_formulas_are_rejected_before_codegen(text: str, message: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def no_codegen(*a: object, **k: object) -> None:
        raise AssertionError("code was generated for a rejected spec")

    monkeypatch.setattr(codegen, "generate", no_codegen)
    with pytest.raises(SpecError) as info:
        rldsl.compile(rldsl.loads(text, filename="evil.rl"), compile=False)
    assert info.value.message == message
    assert info.value.line >= 2 and info.value.column >= 1


def formula_foreign_tokens(algo: rldsl.Algorithm, source: str) -> list[str]:
    """Tokens that are neither registry/template names nor the formula emitter's closed table;
    in comments the spec's own names (bindings, defines: rendered from the tree) are allowed."""
    from rldsl.formula import emit

    spec_names = set()
    for values in algo.slots.values():
        for v in values:
            if v.formula is not None:
                spec_names.add(v.formula.name)
                spec_names.update(b.name for b in v.formula.define.bindings)
                spec_names.update(v.formula.reads)
    code_ok = allowed_names() | emit.CODE_WORDS
    bad = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string not in code_ok and not emit.is_generated_name(tok.string):
            bad.append(tok.string)
        elif tok.type == tokenize.COMMENT:
            words = _WORD.findall(re.sub(r"\b\d+(\.\d*)?(e[-+]?\d+)?", " ", tok.string))  # numbers aside
            bad += [w for w in words if w not in code_ok | spec_names
                    and not emit.is_generated_name(w) and w not in emit.COMMENT_WORDS]
        elif tok.type == tokenize.STRING and tok.string not in allowed_strings():
            bad.append(tok.string)
        elif tok.type == tokenize.NUMBER and not math.isfinite(float(tok.string)):
            bad.append(tok.string)
        elif tok.type == tokenize.ERRORTOKEN and not tok.string.isspace():
            bad.append(tok.string)
    return bad


FORMULA_SPECS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "algorithms" / "examples").glob("*.rl")) + \
    sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "specs" / "formula").glob("*.rl"))


def test_there_are_formula_specs_to_check() -> None:
    assert len(FORMULA_SPECS) >= 4


@pytest.mark.parametrize("spec", FORMULA_SPECS)
def test_formula_code_holds_only_closed_table_names(spec: str, in_root: Path) -> None:
    algo = rldsl.load(spec)
    source = codegen.generate(algo).source
    assert "formula" in source
    assert formula_foreign_tokens(algo, source) == []


def test_spec_names_that_look_like_python_stay_in_comments() -> None:
    text = _define("exec = rho - 1", "os = exec * 2", "system = 0.5", "w = rho + os * system")
    algo = rldsl.loads(text, filename="names.rl")
    source = codegen.generate(algo).source
    code_lines = [ln.split("#", 1)[0] for ln in source.splitlines()]
    for word in ("exec", "os", "system"):
        assert not any(re.search(rf"\b{word}\b", ln) for ln in code_lines), word
        assert re.search(rf"#.*\b{word}\b", source), f"{word} is shown in the comments"
    assert formula_foreign_tokens(algo, source) == []
    # the check itself sees a name that slipped into the code
    assert formula_foreign_tokens(algo, source.replace("w = ", "w = exec + ", 1)) == ["exec"]


def test_numbers_are_reprinted_from_checked_floats() -> None:
    text = _define("cap = 1.2000", "w = min(rho, cap + 0e0) * 10")
    algo = rldsl.loads(text, filename="numbers.rl")
    code = "\n".join(ln.split("#", 1)[0] for ln in codegen.generate(algo).loss_source.splitlines())
    assert "torch.clamp(rho, max=1.2) * 10.0" in code
    assert "1.2000" not in code and "0e0" not in code


def test_codegen_refuses_a_formula_name_that_is_no_identifier() -> None:
    algo = rldsl.loads(_define("w = min(rho, 1.2)"), filename="x.rl")
    v = algo["trust_region"]
    bad = v.model_copy(update={"component": "gate); import os; ("})
    slots = dict(algo.slots)
    slots["trust_region"] = [bad]
    with pytest.raises(CodegenError, match="not an identifier"):
        codegen.generate(algo.model_copy(update={"slots": slots}))


def test_one_python_literal_writer() -> None:
    """Generated code gets its numbers from generated.literal only (the templates' values and
    the formula emitter's constants); formula/render.py writes numbers as the spec does (text)."""
    writers = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "rldsl").rglob("*.py"))
               if "repr(float(" in p.read_text(encoding="utf-8") or "repr(int(" in p.read_text(encoding="utf-8")]
    assert writers == ["rldsl/formula/render.py", "rldsl/generated.py"]
    from rldsl.formula import emit
    assert emit._literal(0.5) == literal(0.5) and emit._literal(2) == "2.0" and emit._literal(True) == "True"
    with pytest.raises(CodegenError, match="non-finite literal"):
        emit._literal(float("inf"))
