"""Fixtures of the trainer's tests."""
from __future__ import annotations

import copy

import pytest

from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine

#: Four prompts of the tiny model's alphabet, of different lengths (the rows pad differently).
PROMPTS = ["1+2=", "33+44=", "(5)*6-7=", "9="]


@pytest.fixture()
def rollout(tiny_model, tokenizer):
    """(a copy of the tiny model, its rollout of PROMPTS: 2 samples each, 6 tokens at most)."""
    model = copy.deepcopy(tiny_model)
    batch = HFEngine(model, tokenizer).generate(
        PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3))
    return model, batch
