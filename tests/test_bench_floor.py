"""bench/step_phases.py's matmul floor (the flop count it divides by the machine's peak) and
bench/forced_lengths.py's answers ended at their drawn lengths."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from torch import nn

ROOT = Path(__file__).resolve().parent.parent


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def step_phases():
    return _bench_module("step_phases")


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


def test_gemm_floor_runs_the_products_the_floor_counts(step_phases, tmp_path, monkeypatch) -> None:
    # bench/gemm_floor.py's bare products: the same weights as step_phases' N, each multiplied
    # three times (forward, input gradient, weight gradient), 2 M k n flops apiece = 6 N M
    import torch
    from transformers import AutoModelForCausalLM
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # sys.path restored after (the script adds bench/ too)
    gemm_floor = _bench_module("gemm_floor")
    folder = step_phases.make_model("tiny", tmp_path / "tiny")
    shapes = gemm_floor.linear_shapes(AutoModelForCausalLM.from_pretrained(folder))
    assert sum(k * n for k, n in shapes) == step_phases.matmul_flops("tiny", folder)["N"]
    seen = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append((a.shape, b.shape)) or real_mm(a, b))
    gemm_floor.products(shapes, 5)()
    assert len(seen) == 3 * len(shapes)
    assert sum(2 * a[0] * a[1] * b[1] for a, b in seen) == 6 * 5 * sum(k * n for k, n in shapes)


def test_floor_line_says_when_the_target_is_out_of_reach(step_phases) -> None:
    flops = {"N": 1e6, "Tp": 7.0, "update": 3e9, "generate": 1e9}  # 4 s at 1 GFLOP/s
    slow_trl = {"rldsl": {"step_s": 8.0}, "trl": {"step_s": 10.0}}
    fast_trl = {"rldsl": {"step_s": 8.0}, "trl": {"step_s": 6.0}}
    line = step_phases.floor_line(flops, 1e9, slow_trl)
    assert "4.000 s" in line and "2.00x the floor" in line and "0.40x TRL" in line
    assert "cannot be met" not in line
    assert "cannot be met" in step_phases.floor_line(flops, 1e9, fast_trl)  # 4 / 6 > 0.5


@pytest.fixture(scope="module")
def forced_lengths():
    return _bench_module("forced_lengths")


def _answer_lengths(ids, stops: set[int]) -> list[int]:
    """Tokens up to and including each row's first stop token (the whole row without one)."""
    out = []
    for row in ids.tolist():
        ends = [i for i, t in enumerate(row) if t in stops]
        out.append(ends[0] + 1 if ends else len(row))
    return out


def test_lognormal_lengths_end_rldsl_answers_at_their_drawn_length(step_phases, forced_lengths, tmp_path,
                                                                   monkeypatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.rollout.engines.hf import HFEngine
    for name in ("_generate_padded", "_logits"):  # restored after the test
        monkeypatch.setattr(HFEngine, name, getattr(HFEngine, name))
    folder = step_phases.make_model("tiny", tmp_path / "tiny")
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))
    forced_lengths.install_rldsl(seed=3)
    params = SamplingParams(n=4, max_new_tokens=16, seed=0)
    for call in range(2):
        batch = engine.generate(["12+34=", "5+6="], params)
        drawn = forced_lengths.lengths(3, call, 8, 16)
        assert len(set(drawn)) > 2  # lengths that differ, so rows leave the sampler at different steps
        assert _answer_lengths(batch.response_ids, engine.stop_ids) == drawn
        assert batch.response_mask.sum(1).tolist() == drawn
        assert batch.finish_reason == ["stop"] * 8
        assert batch.response_ids.shape[1] == max(drawn)


def test_lognormal_lengths_end_trl_answers_at_their_drawn_length(step_phases, forced_lengths, tmp_path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = step_phases.make_model("tiny", tmp_path / "tiny")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)

    class Trainer:  # what install_trl reads of a GRPOTrainer
        pass
    trainer = Trainer()
    trainer.model, trainer.eos_token_ids = model, [tok.eos_token_id]
    forced_lengths.install_trl(trainer, seed=5, limit=16)
    ids = torch.tensor([tok("12+34=")["input_ids"]] * 8)
    for call in range(2):
        out = trainer.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     max_new_tokens=16, min_new_tokens=None, top_k=0,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        assert _answer_lengths(out[:, ids.shape[1]:], {tok.eos_token_id}) == forced_lengths.lengths(5, call, 8, 16)
