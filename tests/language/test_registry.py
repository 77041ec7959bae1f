"""The registry: slot signatures checked at registration, component facts declared there and
agreeing with the code, and no component told apart by its name anywhere else."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path

import pytest
from torch import Tensor

import rldsl
from rldsl import explain, registry
from rldsl.compiled import DataPlan
from rldsl.registry import Bool, Float, Requires, register

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = [c for comps in registry.REGISTRY.values() for c in comps.values()]
NAMES = {c.name for c in COMPONENTS}


@pytest.fixture
def scratch():
    """Registers throwaway components and removes them afterwards, whatever the test did."""
    before = {s: dict(c) for s, c in registry.REGISTRY.items()}
    yield
    for s in registry.REGISTRY:
        registry.REGISTRY[s].clear()
        registry.REGISTRY[s].update(before[s])


DOC = """A throwaway component.

    formula: w = rho
    source: a test
    shapes: [B, T] -> [B, T]
    """


def documented(fn):
    fn.__doc__ = DOC
    return fn


# ---------------------------------------------------------------------------------------
# Slot signatures


def test_every_function_slot_has_a_readable_signature() -> None:
    for slot in registry.SLOTS.values():
        args = slot.args
        if slot.stage in ("declare", "data"):
            assert args is None, slot.name
        else:
            assert args and all(a.isidentifier() for a in args), slot.name
    assert registry.SLOTS["trust_region"].args == ("rho", "adv", "logp", "old_logp")
    assert registry.SLOTS["aggregation"].args == ("mask", "group_size")
    assert registry.signature_args("(mask [B, T], group_size) -> (weights [B, T], count [])") == \
        ("mask", "group_size")
    with pytest.raises(ValueError, match="not '\\(arg"):
        registry.signature_args("rho, adv -> w")


def test_every_registered_function_takes_its_slot_arguments_then_its_parameters() -> None:
    for c in COMPONENTS:
        if c.fn is None:
            continue
        names = list(inspect.signature(c.fn).parameters)
        args = registry.SLOTS[c.slot].args
        assert tuple(names[:len(args)]) == args, (c.slot, c.name)
        inputs = {registry.INPUTS[x].arg for x in c.facts.needs} if registry.SLOTS[c.slot].keyword_inputs else set()
        assert set(names[len(args):]) == {k for k, p in c.params.items() if not p.runtime} | inputs, \
            (c.slot, c.name)


@pytest.mark.parametrize("fn_src, message", [
    ("def bad(adv, rho, logp, old_logp): ...",
     r"trust_region.bad: the function takes \(adv, rho, logp, old_logp\) but slot trust_region calls "
     r"every component as \(rho \[B, T\], adv \[B, T\], logp \[B, T\], old_logp \[B, T\]\) -> w \[B, T\]; "
     r"its first arguments must be \(rho, adv, logp, old_logp\), in this order"),
    ("def bad(rho, adv, logp): ...", r"takes \(rho, adv, logp\) but slot trust_region"),
    ("def bad(rho, advantage, logp, old_logp): ...", r"must be \(rho, adv, logp, old_logp\)"),
    ("def bad(rho, adv, logp, old_logp, *rest): ...", r"must be \(rho, adv, logp, old_logp\)"),
    ("def bad(rho, adv, logp, old_logp): ...", r"it lacks the declared parameter\(s\) high"),
    ("def bad(rho, adv, logp, old_logp, high, scale): ...",
     r"it takes scale, which register\(\) does not declare"),
])
def test_register_refuses_a_function_that_does_not_match_its_slot(scratch, fn_src, message) -> None:
    ns: dict = {}
    exec(fn_src, ns)  # noqa: S102 - a test's own literal source
    with pytest.raises(ValueError, match=message):
        register("trust_region", per_token_only=False, high=Float(0.2, "a bound", gt=0))(documented(ns["bad"]))
    assert "bad" not in registry.REGISTRY["trust_region"]


def test_register_refuses_runtime_parameters_in_the_function(scratch) -> None:
    def bad(logp, ref_logp, rho, beta):
        return logp
    with pytest.raises(ValueError, match=r"takes beta, which register\(\) does not declare "
                                         r"\(runtime parameters are not passed\)"):
        register("kl", uses_ratio=False, beta=Float(doc="coefficient", runtime=True))(documented(bad))


def test_register_accepts_a_matching_function(scratch) -> None:
    @register("trust_region", per_token_only=False, high=Float(0.2, "a bound", gt=0))
    def ok(rho: Tensor, adv: Tensor, logp: Tensor, old_logp: Tensor, high: float) -> Tensor:
        """Capped ratio.

        formula: w = min(rho, 1+{high})
        source: a test
        shapes: [B, T] -> [B, T]
        """
        return rho.clamp(max=1 + high)
    assert registry.get("trust_region", "ok").formula_with({"high": 0.5}) == "w = min(rho, 1+0.5)"


# ---------------------------------------------------------------------------------------
# Facts


def test_every_component_declares_the_facts_its_slot_requires() -> None:
    required = {s: slot.declares for s, slot in registry.SLOTS.items()}
    assert required["objective"] == ("uses_ratio",) and required["kl"] == ("uses_ratio",)
    assert required["trust_region"] == ("per_token_only",) and required["ratio"] == ("sequence_level",)
    for c in COMPONENTS:
        assert isinstance(c.facts, registry.Facts)
        missing = [f for f in required[c.slot] if f not in c.declared]
        assert c.off or not missing, f"{c.slot}.{c.name} does not declare {missing}"
        assert c.declared <= set(registry.FACTS)
    # every slot whose default leaves it unused has exactly one `off` component, its default
    for s, slot in registry.SLOTS.items():
        off = [c.name for c in registry.REGISTRY[s].values() if c.off]
        assert off in ([], [slot.default]), (s, off)


@pytest.mark.parametrize("kw, exc, message", [
    ({}, ValueError, r"every objective component declares uses_ratio"),
    ({"uses_ratio": True, "needz": ()}, TypeError, r"unknown fact 'needz'; a parameter is a Param"),
    ({"uses_ratio": True, "needs": ("rollout_logp",)}, ValueError, r"needs 'rollout_logp' is not an input"),
    ({"uses_ratio": "scale"}, ValueError, r"uses_ratio='scale' must be True, False or the name of a bool"),
    ({"uses_ratio": True, "plan": {"rounds": "k"}}, ValueError, r"plan maps a field of CompiledAlgorithm.data"),
    ({"uses_ratio": True, "requires": Requires("reward", "binary")}, ValueError, r"with a known slot"),
])
def test_register_refuses_missing_or_malformed_facts(scratch, kw, exc, message) -> None:
    def bad(w, adv, logp, mask, scale):
        return -adv * w * scale
    with pytest.raises(exc, match=message):
        register("objective", scale=Float(1.0, "a scale"), **kw)(documented(bad))
    assert "bad" not in registry.REGISTRY["objective"]


def test_a_bool_parameter_can_decide_a_flag() -> None:
    k3 = registry.get("kl", "k3")
    assert k3.facts.uses_ratio == "ratio_weighted"
    assert k3.flag("uses_ratio", {"ratio_weighted": True}) and not k3.flag("uses_ratio", {})
    assert registry.get("kl", "none").flag("uses_ratio", {}) is False  # off: every flag is False


def _reads(fn) -> tuple[set[str], set[str]]:
    """(names and ``batch.<field>`` the function body reads as required, those it tests for None)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0]
    read, optional = set(), set()
    for node in ast.walk(body):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            read.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "batch":
            read.add(f"batch.{node.attr}")
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.ops[0], (ast.Is, ast.IsNot)) and not isinstance(node.body[0], ast.Raise):
            optional.add(ast.unparse(node.test.left))
    return read, optional


# how each optional input reaches a component: a slot argument or an AdvantageBatch field
ARRIVES_AS = {"ref_logp": "ref_logprobs", "entropy": "entropy", "values": "values",
              "returns": "returns", "old_values": "old_values", "group_size": "group_size",
              "batch.values": "values", "batch.truncated": "truncated"}


def test_facts_agree_with_what_the_functions_read() -> None:
    """A component that reads an optional input declares it in ``needs``; one that reads the
    ratio (objective: w, kl: rho) says so in ``uses_ratio``."""
    assert set(ARRIVES_AS.values()) <= set(registry.INPUTS)
    for c in COMPONENTS:
        if c.fn is None or c.off:
            continue
        read, optional = _reads(c.fn)
        for name, inp in ARRIVES_AS.items():
            if name in read and name not in optional and name in (registry.SLOTS[c.slot].args or ()) + (
                    "batch.values", "batch.truncated"):
                assert inp in c.facts.needs, f"{c.slot}.{c.name} reads {name} but does not declare needs {inp!r}"
        ratio_arg = {"objective": "w", "kl": "rho"}.get(c.slot)
        if ratio_arg:
            assert (c.facts.uses_ratio is not False) == (ratio_arg in read), (c.slot, c.name)


def test_the_runtime_plan_is_declared_by_facts() -> None:
    assert {f.name for f in dataclasses.fields(DataPlan)} == set(registry.PLAN)
    planned = {f for c in COMPONENTS for f in c.facts.plan}
    # ... or by a formula: one reading the policy's top-K sets its size K (policy_topk)
    simko = rldsl.load(str(Path(__file__).resolve().parents[2] / "algorithms" / "examples" / "simko.rl"))
    planned |= {f for v in simko.active() for f in v.spec.facts.plan}
    assert planned == set(registry.PLAN), "every field of CompiledAlgorithm.data is set by a component"
    fn = rldsl.compile(rldsl.load("scalerl"), compile=False)
    assert (fn.data.dynamic_rounds, fn.data.pass_rate_cap) == (1, 0.9)
    fn = rldsl.compile(rldsl.load("dapo"), compile=False)
    assert (fn.data.dynamic_rounds, fn.data.pass_rate_cap) == (10, None)


def test_inputs_a_call_lacks_are_named_from_the_facts() -> None:
    import torch
    fn = rldsl.compile(rldsl.load("ppo"), compile=False)
    m = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"ppo: estimate\(\) needs values= for baseline gae"):
        fn.estimate(torch.ones(2), 2, m)
    with pytest.raises(ValueError, match=r"estimate\(\) needs old_logprobs= and ref_logprobs= for kl k1"):
        fn.estimate(torch.ones(2), 2, m, values=torch.zeros(2, 3))
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"loss\(\) needs values= and returns= for critic value"):
        fn.loss(z, z, z, m)


def test_algorithm_properties_come_from_facts() -> None:
    rows = {name: rldsl.load(name) for name in rldsl.library()}
    for name, a in rows.items():
        assert a.uses_ratio == (name not in ("reinforce", "rloo")), name
        assert a.uses_reference == (a["kl"].component != "none"), name
        assert a.needs() == list(dict.fromkeys(x for v in a.active() for x in v.spec.facts.needs))
    assert rows["ppo"].needs("advantage") == ["values", "old_logprobs", "ref_logprobs"]
    assert rows["ppo"].needs("loss") == ["values", "returns"]
    assert [v.slot for v in rows["grpo"].active("loss")] == ["ratio", "trust_region", "objective", "kl",
                                                             "aggregation"]


def test_active_is_computed_once_and_its_callers_cannot_change_it(monkeypatch) -> None:
    """The runtime asks a spec its active components ~17 times a step: computed once per stage
    (the spec is frozen; no registry lookup again), each caller gets its own list, and a pickled
    copy (a Ray worker's) answers the same."""
    import pickle
    grpo = rldsl.load("grpo")
    first = grpo.active("loss")
    first.clear()
    looked_up = []
    real_get = registry.get
    monkeypatch.setattr(registry, "get", lambda *a: looked_up.append(a) or real_get(*a))
    again = grpo.active("loss")
    assert [v.slot for v in again] == ["ratio", "trust_region", "objective", "kl", "aggregation"]
    assert looked_up == []  # answered from the first call's
    copy = pickle.loads(pickle.dumps(grpo))
    assert [v.slot for v in copy.active()] == [v.slot for v in grpo.active()] and copy.needs() == grpo.needs()


def test_explain_words_for_facts() -> None:
    assert explain.fact_notes(registry.get("filter", "overlong")) == ["needs truncated="]
    assert explain.fact_notes(registry.get("kl", "k3")) == ["needs old_logprobs=, ref_logprobs=",
                                                            "uses the ratio if ratio_weighted=true"]
    assert explain.fact_notes(registry.get("filter", "pass_rate_cap"), {"max": 0.8}) == \
        ["carried out by the runtime: data.pass_rate_cap = 0.8"]
    assert explain.fact_notes(registry.get("kl", "k1"), {"beta": 0.1, "where": "reward"})[-1] == \
        "acts in the advantage stage"


# ---------------------------------------------------------------------------------------
# One source of truth


def _language_modules() -> list[Path]:
    pkg = ROOT / "rldsl"
    return [p for p in sorted(pkg.rglob("*.py"))
            if p.name != "registry.py" and "components" not in p.relative_to(pkg).parts]


def _strings(node: ast.AST) -> list[ast.Constant]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c for e in node.elts for c in _strings(e)]
    return []


def _name_literals(tree: ast.AST) -> list[ast.Constant]:
    """Component names as string literals in a comparison, a membership test, a subscript or a
    ``get(...)`` call: how code tells components apart by name."""
    found: list[ast.Constant] = []
    for node in ast.walk(tree):
        suspects: list[ast.Constant] = []
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                suspects += _strings(side)
        elif isinstance(node, ast.Subscript):
            suspects += _strings(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)) and \
                (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) == "get":
            for a in node.args:
                suspects += _strings(a)
        found += [c for c in suspects if c.value in NAMES]
    return found


def test_no_component_is_told_apart_by_its_name_outside_the_registry() -> None:
    """An ast check of rldsl/ (registry.py and components/ excepted): what a component needs
    or does is a fact declared in register(...), never a test of its name."""
    scanned = {p.name for p in _language_modules()}
    assert {"spec.py", "codegen.py", "compiled.py", "explain.py", "cli.py"} <= scanned
    found = [f"{path.relative_to(ROOT)}:{c.lineno}: {c.value!r}" for path in _language_modules()
             for c in _name_literals(ast.parse(path.read_text(encoding="utf-8")))]
    assert not found, "components told apart by name (declare a fact in register(...) instead):\n" + \
        "\n".join(found)


def test_the_ast_check_sees_each_form_of_name_test() -> None:
    sample = ('if v.component == "prompt_mean" or "overlong" in names or x in ("tv", "kl_div"):\n'
              '    REGISTRY["aggregation"]["ema"], registry.get("baseline", "gae")\n'
              'if algo["critic"] and kl.params["where"] == "reward": pass\n')
    assert {c.value for c in _name_literals(ast.parse(sample))} == \
        {"prompt_mean", "overlong", "tv", "kl_div", "ema", "gae"}


def test_the_slot_order_is_defined_once() -> None:
    assert not hasattr(explain, "FLOW")
    algo = rldsl.load("dapo")
    assert [r["slot"] for r in explain.slot_rows(algo)] == list(registry.SLOTS)
    assert [s["slot"] for s in explain.diff(algo, rldsl.load("grpo"))["slots"]] == list(registry.SLOTS)
    assert list(algo.slots) == list(registry.SLOTS)


def test_one_value_formatter() -> None:
    for path in _language_modules() + [ROOT / "rldsl" / "registry.py"]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defs = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        assert "_fmt" not in defs, path
    f = registry.format_value
    assert [f(True), f(False), f(None), f(0.2), f(1e-06), f(3), f("loss")] == \
        ["true", "false", "-", "0.2", "1e-06", "3", "loss"]
    assert registry.Param("float", 0.2, ge=0, lt=1).describe() == "float, >= 0, < 1, default 0.2"


def test_docs_describe_every_fact_input_and_plan_field() -> None:
    doc = (ROOT / "docs" / "components.md").read_text(encoding="utf-8")
    for name in (*registry.FACTS, *registry.INPUTS, *registry.PLAN):
        assert f"`{name}`" in doc, name


def test_needs_is_computed_once_and_its_callers_cannot_change_it(monkeypatch) -> None:
    """The runtime asks a spec the inputs its components read ~11 times a step: computed once per
    stage (each a registry lookup per active component before), the same answer, each caller its
    own list, a pickled copy (a Ray worker's) the same."""
    import pickle
    spec = rldsl.load("grpo")
    fresh = rldsl.load("grpo")
    want = {stage: list(dict.fromkeys(x for v in fresh.active(stage) for x in v.spec.facts.needs))
            for stage in (None, "loss", "advantage")}
    first = {stage: spec.needs(stage) for stage in want}
    assert first == want and "old_logprobs" in first[None]
    first[None].clear()
    looked_up = []
    real_given = registry.Component.given
    monkeypatch.setattr(registry.Component, "given", lambda *a, **k: looked_up.append(a) or real_given(*a, **k))
    assert {stage: spec.needs(stage) for stage in want} == want
    assert looked_up == []  # answered from the first calls'
    assert pickle.loads(pickle.dumps(spec)).needs() == want[None]



def test_flags_are_computed_once(monkeypatch) -> None:
    """old_from_rollout (asked twice a step) and uses_ratio: one registry lookup per active
    component the first time, none after, the same answers as the components' flags."""
    looked_up = []
    real_given = registry.Component.given
    monkeypatch.setattr(registry.Component, "given", lambda *a, **k: looked_up.append(a) or real_given(*a, **k))
    bypass = rldsl.loads("algorithm bypassed extends grpo\n  correction bypass\n", "bypassed.rl")
    for spec, from_rollout in ((rldsl.load("grpo"), False), (bypass, True)):
        first = (spec.old_from_rollout, spec.uses_ratio)
        assert first == (from_rollout, True)
        n = len(looked_up)
        assert (spec.old_from_rollout, spec.uses_ratio) == first and len(looked_up) == n
