"""The optional inputs are data: one record each in rldsl/inputs.py, and nothing else tests a name.

An ast scan of the language core and the runtime finds every string literal equal to an input
name in a comparison or a membership test (``x == "entropy"``, ``"values" in needs``, a
tuple of names on either side): how code tells inputs apart by name. Only the table, the
runtime's producers (keyed by name) and the components' own declarations (``needs=``) name
inputs; everything else asks a record (its source, stages, slots, ...).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import rldsl
from rldsl import inputs, registry
from rldsl.formula import lang

ROOT = Path(__file__).resolve().parents[2]
NAMES = set(inputs.INPUTS)
#: where input names are data: the table, the producers keyed by them, components' declarations
ALLOWED = {ROOT / "rldsl" / "inputs.py", ROOT / "runtime" / "train" / "inputs.py"}
ALLOWED_DIRS = {ROOT / "rldsl" / "components"}


def _strings(node: ast.AST) -> list[ast.Constant]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [c for e in node.elts for c in _strings(e)]
    return []


def name_tests(tree: ast.AST) -> list[ast.Constant]:
    """Input names as string literals in a comparison or membership test."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                found += [c for c in _strings(side) if c.value in NAMES]
    return found


def scanned_files() -> list[Path]:
    files = sorted((ROOT / "rldsl").rglob("*.py")) + sorted((ROOT / "runtime").rglob("*.py"))
    return [p for p in files if p not in ALLOWED and not any(d in p.parents for d in ALLOWED_DIRS)]


def test_no_input_name_is_tested_as_a_string_outside_the_table() -> None:
    files = scanned_files()
    assert {"codegen.py", "compiled.py", "spec.py", "lint.py", "explain.py", "loop.py", "trainer.py"} <= \
        {p.name for p in files}
    found = [f"{p.relative_to(ROOT)}:{c.lineno}: {c.value!r}" for p in files
             for c in name_tests(ast.parse(p.read_text(encoding="utf-8")))]
    assert not found, "input names tested as strings (ask the record in rldsl/inputs.py instead):\n" + \
        "\n".join(found)


def test_the_scan_sees_each_form_of_name_test() -> None:
    sample = ('if "sum_pi_squared" in algo.needs() or name == "entropy_coef":\n'
              '    pass\n'
              'if x in ("values", "returns", "not_an_input"): pass\n'
              'c["reward_weights"]; f("truncated")\n')  # reads and calls are not tests
    assert {c.value for c in name_tests(ast.parse(sample))} == \
        {"sum_pi_squared", "entropy_coef", "values", "returns"}


# ----------------------------------------------------------------------------- the table itself

def test_every_input_is_a_keyword_of_its_calls() -> None:
    """The table and CompiledAlgorithm agree: each input of a stage is a keyword of its call."""
    import inspect
    calls = {"advantage": [rldsl.CompiledAlgorithm.estimate], "loss": [rldsl.CompiledAlgorithm.loss]}
    for stage, fns in calls.items():
        for i in inputs.of_stage(stage):
            for fn in fns:
                assert i.name in inspect.signature(fn).parameters, (stage, i.name)


def test_every_input_has_one_producer_in_the_runtime() -> None:
    from rldsl.runtime.train import inputs as producers
    for i in inputs.of_stage("advantage"):
        assert (i.name in producers.ESTIMATE), i.name
    for i in inputs.of_stage("loss"):
        assert i.name in producers.UPDATE, i.name
    # made at rollout time: from the rollout batch, from the run's history of them (per-prompt statistics),
    # from the reference model's answers to the same prompts (ref_reward), from the policy's forward over
    # the reference answer (answer_prob), or from the rollout's trees (sampling tree)
    assert set(producers.ROLLOUT) <= {i.name for i in inputs.INPUTS.values()
                                      if i.source in ("rollout", "history", "reference_rollout", "answer", "tree")}
    assert set(producers.ESTIMATE) | set(producers.UPDATE) | set(producers.ROLLOUT) <= NAMES


def test_formula_names_come_from_the_table() -> None:
    """A formula in a slot reads an optional input exactly where the table lists the slot."""
    for i in inputs.INPUTS.values():
        if i.formula is None:
            continue
        assert i.formula in lang.INPUTS, i.name
        for slot, fs in {**lang.SLOTS, **lang.ARGUMENTS}.items():  # a slot's formula or an argument's
            assert (i.formula in fs.inputs) == (slot in i.slots), (i.name, slot)


#: a slot signature's argument -> the formula name of the same value
FORMULA_NAME = {"adv": "A", "entropy": "ent", **{i.arg: i.formula for i in inputs.INPUTS.values() if i.formula}}


@pytest.mark.parametrize("slot", [s for s in lang.SLOTS if registry.SLOTS[s].stage == "loss"])
def test_a_formula_reads_what_the_registry_hands_its_slot(slot: str) -> None:
    """The language and the registry cannot disagree: every argument the registry passes a
    loss-stage slot's components is readable by a formula in that slot."""
    args = [a for a in registry.SLOTS[slot].args or () if a not in ("group_size",)]
    readable = set(lang.SLOTS[slot].inputs)
    assert [a for a in args if FORMULA_NAME.get(a, a) not in readable] == []


def test_shape_check_binds_letters() -> None:
    sizes = {"B": 4, "T": 3}
    comps, weights = inputs.INPUTS["reward_components"], inputs.INPUTS["reward_weights"]
    assert inputs.check_shape(comps, torch.zeros(4, 2), sizes) is None and sizes["K"] == 2
    assert inputs.check_shape(weights, torch.zeros(2), sizes) is None
    assert "K = 2" in inputs.check_shape(weights, torch.zeros(3), sizes)
    assert "must be [B, K]" in inputs.check_shape(comps, torch.zeros(4), sizes)


def test_docs_hold_the_input_table() -> None:
    doc = (ROOT / "docs" / "components.md").read_text(encoding="utf-8")
    assert inputs.doc_table() in doc, "paste rldsl.inputs.doc_table() into docs/components.md"
