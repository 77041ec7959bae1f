"""Good specs parse: the whole library, and valid edge cases in tests/specs/good/."""
from __future__ import annotations

from pathlib import Path

import pytest

import rldsl
from rldsl import registry

ROOT = Path(__file__).resolve().parents[2]
GOOD = ROOT / "tests" / "specs" / "good"
LIBRARY = sorted(rldsl.library())


def _summary(algo: rldsl.Algorithm) -> dict[str, list[tuple]]:
    """Slots as comparable plain data: component, params and where each was written."""
    return {s: [(v.component, v.params, v.origin and (v.origin.line, v.origin.column)) for v in vs]
            for s, vs in algo.slots.items()}


def test_the_library_has_the_designed_algorithms() -> None:
    assert set(LIBRARY) >= {"reinforce", "ppo", "grpo", "rloo", "dr_grpo", "dapo", "cispo", "dppo",
                            "maxrl", "lite_ppo", "scalerl"}


@pytest.mark.parametrize("name", LIBRARY)
def test_library_algorithm_loads(name: str, in_root: Path) -> None:
    algo = rldsl.load(name)
    assert algo.name == name
    assert algo.description, "every library algorithm has a description"
    assert set(algo.slots) == set(registry.SLOTS)
    for slot, values in algo.slots.items():
        assert values, slot
        for v in values:
            comp = registry.get(slot, v.component)
            assert set(v.params) == set(comp.params)
    # by path, from text, and by name: the same algorithm
    by_path = rldsl.load(f"algorithms/{name}.rl")
    text = (ROOT / "algorithms" / f"{name}.rl").read_text(encoding="utf-8")
    from_text = rldsl.loads(text, filename=f"algorithms/{name}.rl")
    assert _summary(by_path) == _summary(algo) == _summary(from_text)
    assert by_path.extends == algo.extends == from_text.extends


def test_every_good_spec_loads(in_root: Path) -> None:
    files = sorted(GOOD.glob("*.rl"))
    assert len(files) >= 10
    for path in files:
        algo = rldsl.load(path.relative_to(ROOT).as_posix())
        assert algo.name == path.stem, "good specs are named after their file"


def _good(name: str) -> rldsl.Algorithm:
    return rldsl.load(f"tests/specs/good/{name}.rl")


def test_comments_everywhere(in_root: Path) -> None:
    algo = _good("comments_everywhere")
    assert algo.description == "Comments may stand anywhere # but a '#' in the description is text."
    assert algo.extends == ["grpo"]
    tr = algo["trust_region"]
    assert (tr.component, tr.params) == ("clip", {"low": 0.2, "high": 0.28})
    assert (tr.origin.line, tr.origin.column) == (8, 17)
    assert algo.components("filter") == ["zero_variance", "overlong"]
    assert algo["kl"].component == "none" and algo["kl"].origin.line == 12
    assert algo["baseline"].component == "group_mean" and algo["baseline"].origin.file.endswith("grpo.rl")


def test_crlf_line_endings_parse_like_lf(in_root: Path) -> None:
    raw = (GOOD / "crlf.rl").read_bytes()
    assert raw.count(b"\r\n") == raw.count(b"\n") == 6
    crlf = _good("crlf")
    lf = rldsl.loads(raw.decode().replace("\r\n", "\n"), filename="tests/specs/good/crlf.rl")
    assert _summary(crlf) == _summary(lf)
    assert crlf.description == "Windows line endings."
    assert crlf["trust_region"].origin.line == 4


def test_no_trailing_newline(in_root: Path) -> None:
    assert not (GOOD / "no_trailing_newline.rl").read_bytes().endswith(b"\n")
    algo = _good("no_trailing_newline")
    agg = algo["aggregation"]
    assert (agg.component, agg.params, agg.origin.line) == ("token_sum_norm", {"max_tokens": 512}, 4)


def test_tabs(in_root: Path) -> None:
    algo = _good("tabs")
    norm = algo["normalizer"]
    assert (norm.component, norm.params) == ("group_std", {"eps": 1e-6, "unbiased": False, "group_by": None})
    assert (norm.origin.line, norm.origin.column) == (4, 14)  # a tab is one column
    assert algo["objective"].component == "ppo"


def test_scientific_notation_and_number_forms(in_root: Path) -> None:
    algo = _good("scientific")
    assert algo["normalizer"].params["eps"] == 1e-8
    assert algo["trust_region"].params == {"low": 0.2, "high": 0.28}
    assert algo["kl"].params["beta"] == 0.04
    assert algo["entropy"].params == {"coef": 0.0015}
    assert algo["ratio"].params == {"clamp": 20.0}
    rounds = algo["sampling"].params["max_rounds"]
    assert rounds == 5 and type(rounds) is int
    tokens = algo["aggregation"].params["max_tokens"]
    assert tokens == 4096 and type(tokens) is int


def test_negative_number_where_allowed(in_root: Path) -> None:
    algo = _good("negative_numbers")
    assert algo["trust_region"].params == {"high": -0.5, "low": None}


def test_empty_parens_mean_defaults(in_root: Path) -> None:
    algo = _good("empty_parens")
    assert algo["baseline"].params == {"singleton": "zero", "group_by": None}
    assert algo["normalizer"].params == {"eps": 1e-6, "unbiased": True, "group_by": None}
    assert algo.components("filter") == ["zero_variance", "pass_rate_cap"]
    assert algo["filter"][1].params == {"max": 0.9}


def test_extends_chain_of_three_files(in_root: Path) -> None:
    leaf = _good("chain_leaf")
    assert leaf.extends == ["chain_mid", "chain_base"]
    assert leaf.description == "Leaf of the chain."
    assert _good("chain_mid").description == "Base of the chain."  # inherited
    origin_files = {s: vs[0].origin and Path(vs[0].origin.file).name for s, vs in leaf.slots.items()}
    assert origin_files["normalizer"] == "chain_leaf.rl"
    assert origin_files["aggregation"] == "chain_leaf.rl"
    assert origin_files["trust_region"] == "chain_mid.rl"
    assert origin_files["kl"] == "chain_mid.rl"
    assert origin_files["baseline"] == "chain_base.rl"
    assert origin_files["sampling"] is None  # the slot default
    # a child's clip(high=...) replaces the parent's slot: low is the default, not chain_base's 0.1
    assert leaf["trust_region"].params == {"low": 0.2, "high": 0.3}
    assert leaf["normalizer"].component == "none" and leaf["kl"].component == "none"


def test_byte_order_mark_is_not_part_of_the_spec(in_root: Path) -> None:
    assert (GOOD / "bom.rl").read_bytes().startswith(b"\xef\xbb\xbf")
    algo = _good("bom")
    assert algo.name == "bom" and algo["baseline"].origin.column == 17


def test_defaults_only(in_root: Path) -> None:
    algo = _good("defaults_only")
    for slot, spec in registry.SLOTS.items():
        v = algo.slots[slot]
        assert [x.component for x in v] == [spec.default]
        assert v[0].origin is None
