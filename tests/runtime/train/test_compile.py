"""model.compile: the trainer's forwards through a torch.compile'd policy body stay within
1e-4 of eager (logprobs, entropies), padded and packed, and the policy module stays eager."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rldsl
from rldsl.runtime.config import RunConfig
from rldsl.runtime.models.loading import backbone
from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs
from rldsl.runtime.train.trainer import Trainer

ALGOS = Path(__file__).parents[3] / "algorithms"
PROMPTS = ["1+2=", "33+44=", "(5)*6-7=", "9="]


@pytest.mark.slow  # compiling takes ~30 s on a quiet 2-core machine
def test_compiled_body_logprobs_within_1e4_of_eager(tiny_model, tokenizer) -> None:
    cfg = RunConfig()
    cfg.model.compile = True
    fn = rldsl.compile(rldsl.load(str(ALGOS / "grpo.rl")), compile=False)
    t = Trainer.from_config(cfg, fn, tiny_model)
    assert t._compiled_body is not None and not hasattr(backbone(tiny_model), "_orig_mod")
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(4, len(tokenizer), (4, 6), generator=g)
    resp_mask = (torch.arange(6)[None] < torch.tensor([[6], [2], [5], [3]])).long()
    ids = torch.cat([enc["input_ids"], resp], 1)
    mask = torch.cat([enc["attention_mask"], resp_mask], 1)
    m = resp_mask.bool()
    for packing in (False, True):
        with torch.no_grad():
            eager = token_logprobs(tiny_model, Forward(ids, mask, 6), LogprobOptions(packing=packing))
            compiled = token_logprobs(tiny_model, Forward(ids, mask, 6),
                                      LogprobOptions(packing=packing, body=t._compiled_body))
        for a, b in ((eager.logprobs, compiled.logprobs), (eager.entropy, compiled.entropy)):
            torch.testing.assert_close(b[m], a[m], atol=1e-4, rtol=0)


@pytest.mark.slow  # compiling the sampler's forwards takes ~20-60 s
def test_compiled_sampler_draws_the_eager_tokens_and_follows_weight_syncs(tiny_model, tiny_model_factory,
                                                                         tokenizer) -> None:
    """model.compile in the HF engine: greedy answers equal eager's, logprobs within 1e-4, also after
    update_weights (the compiled graphs read the engine's parameters, not copies of them); the
    module handed in for training is never compiled."""
    import copy

    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.rollout.engines.hf import HFEngine

    eager = HFEngine(copy.deepcopy(tiny_model), tokenizer)
    compiled = HFEngine(copy.deepcopy(tiny_model), tokenizer, compile=True)
    greedy = SamplingParams.greedy(6)
    sampled = SamplingParams(n=3, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=5)

    def same(params: SamplingParams) -> torch.Tensor:
        a, b = eager.generate(PROMPTS, params), compiled.generate(PROMPTS, params)
        assert torch.equal(a.response_ids, b.response_ids)
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=0)
        return a.logprobs

    before = same(greedy)
    same(sampled)
    body = backbone(compiled.model)
    assert "forward" in vars(body) and "forward" not in vars(backbone(tiny_model))  # the engine's copy only
    other = tiny_model_factory(tokenizer, seed=1).state_dict()
    eager.update_weights(other.items())
    compiled.update_weights(other.items())
    after = same(greedy)
    assert after.shape != before.shape or not torch.allclose(after, before)  # the sync changed the samples
