"""bench/step_phases.py's matmul floor: the flop count it divides by the machine's peak."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from torch import nn

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def step_phases():
    spec = importlib.util.spec_from_file_location("step_phases", ROOT / "bench" / "step_phases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_floor_counts_every_linear_weight_of_the_model(step_phases, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = step_phases.make_model("tiny", tmp_path / "tiny")
    flops = step_phases.matmul_flops("tiny", folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert flops["N"] == linear  # every projection and the LM head; no embedding
    hidden, layers, heads, new, P, G = step_phases.SIZES["tiny"]
    tok = AutoTokenizer.from_pretrained(folder)
    from rldsl.runtime.toy import AdditionTask
    prompts = [e.prompt for e in AdditionTask().prompt_source(0).next_batch(P)]
    Tp = sum(len(tok(p)["input_ids"]) for p in prompts) / P
    assert flops["Tp"] == pytest.approx(Tp)
    assert flops["update"] == pytest.approx(6 * linear * (P * Tp + P * G * new))
    assert flops["generate"] == pytest.approx(2 * linear * (P * Tp + P * G * (new - 1)))


def test_floor_line_says_when_the_target_is_out_of_reach(step_phases) -> None:
    flops = {"N": 1e6, "Tp": 7.0, "update": 3e9, "generate": 1e9}  # 4 s at 1 GFLOP/s
    slow_trl = {"rldsl": {"step_s": 8.0}, "trl": {"step_s": 10.0}}
    fast_trl = {"rldsl": {"step_s": 8.0}, "trl": {"step_s": 6.0}}
    line = step_phases.floor_line(flops, 1e9, slow_trl)
    assert "4.000 s" in line and "2.00x the floor" in line and "0.40x TRL" in line
    assert "cannot be met" not in line
    assert "cannot be met" in step_phases.floor_line(flops, 1e9, fast_trl)  # 4 / 6 > 0.5
