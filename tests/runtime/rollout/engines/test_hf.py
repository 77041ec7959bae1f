"""HFEngine: layout of the batch, masks, logprobs against an unpadded recompute, seeding, weight sync."""
from __future__ import annotations

import copy

import pytest
import torch

from rldsl.runtime.batch import RolloutBatch
from rldsl.runtime.rollout.engines.base import RolloutEngine, SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine


PROMPTS = ["1+2=", "33+44=", "(5)*6-7="]  # different lengths: left padding matters
PAD, BOS, EOS = 0, 1, 2


def test_implements_protocol(tiny_model, tokenizer) -> None:
    assert isinstance(HFEngine(tiny_model, tokenizer), RolloutEngine)


def test_batch_layout_groups_contiguous_and_left_padded(tiny_model, tokenizer) -> None:
    G = 3
    batch = HFEngine(tiny_model, tokenizer).generate(
        PROMPTS, SamplingParams(n=G, temperature=1.0, max_new_tokens=5, seed=0)
    )
    assert isinstance(batch, RolloutBatch)
    B = len(PROMPTS) * G
    assert len(batch) == B and batch.group_size == G
    assert batch.prompts == [p for p in PROMPTS for _ in range(G)]
    # "(5)*6-7=" has 8 characters + <bos> = 9 tokens; "1+2=" is left padded by 4
    assert batch.prompt_ids.shape == (B, 9)
    assert batch.prompt_ids[0].tolist() == [PAD] * 4 + [BOS, 5, 14, 6, 17]
    assert batch.prompt_mask[0].tolist() == [0] * 4 + [1] * 5
    for g in range(len(PROMPTS)):
        rows = batch.prompt_ids[g * G : (g + 1) * G]
        assert (rows == rows[0]).all()
    assert batch.response_ids.shape == batch.response_mask.shape == batch.logprobs.shape
    assert batch.response_ids.shape[1] <= 5
    assert not batch.logprobs.requires_grad


def test_masks_eos_and_completions_consistent(tiny_model, tokenizer) -> None:
    # temperature 2 on a random model: EOS (1 of 23 tokens) ends some rows, not others
    batch = HFEngine(tiny_model, tokenizer).generate(
        ["12+34="], SamplingParams(n=64, temperature=2.0, max_new_tokens=8, seed=1)
    )
    assert {"stop", "length"} == set(batch.finish_reason)
    for b in range(len(batch)):
        ids, mask = batch.response_ids[b], batch.response_mask[b]
        eos_at = (ids == EOS).nonzero().flatten().tolist()
        if batch.finish_reason[b] == "stop":
            assert len(eos_at) == 1  # everything after the first EOS was replaced by pad
            n = eos_at[0] + 1  # the mask includes the EOS
        else:
            assert eos_at == [] and int(mask.sum()) == ids.shape[0] == 8
            n = 8
        assert mask.tolist() == [1] * n + [0] * (ids.shape[0] - n)
        assert (ids[n:] == PAD).all() and (batch.logprobs[b, n:] == 0).all()
        kept = [t for t in ids[:n].tolist() if t > 3]  # not <pad> <bos> <eos> <unk>
        assert batch.completions[b] == "".join(tokenizer.convert_ids_to_tokens(kept))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_unpadded_recompute(tiny_model, tokenizer, unpadded_logits, temperature) -> None:
    batch = HFEngine(tiny_model, tokenizer).generate(
        PROMPTS, SamplingParams(n=4, temperature=temperature, max_new_tokens=6, seed=2)
    )
    with torch.no_grad():
        refs = unpadded_logits(
            tiny_model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask
        )
    for b, logits in enumerate(refs):
        L = logits.shape[0]
        tokens = batch.response_ids[b, :L]
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
        torch.testing.assert_close(batch.logprobs[b, :L], expected, atol=1e-5, rtol=0)


def test_greedy_is_argmax_and_ignores_n(tiny_model, tokenizer, unpadded_logits) -> None:
    batch = HFEngine(tiny_model, tokenizer).generate(
        PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    )
    assert torch.equal(batch.response_ids[0::2], batch.response_ids[1::2])
    with torch.no_grad():
        refs = unpadded_logits(
            tiny_model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask
        )
    for b, logits in enumerate(refs):
        assert torch.equal(batch.response_ids[b, : logits.shape[0]], logits.argmax(-1))
        # greedy logprobs are under the untempered distribution
        expected = torch.log_softmax(logits, -1).max(-1).values
        torch.testing.assert_close(batch.logprobs[b, : logits.shape[0]], expected, atol=1e-5, rtol=0)


def test_tiny_top_p_is_greedy(tiny_model, tokenizer) -> None:
    engine = HFEngine(tiny_model, tokenizer)
    greedy = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=6))
    nucleus = engine.generate(
        PROMPTS, SamplingParams(n=1, temperature=1.0, top_p=1e-6, max_new_tokens=6, seed=3)
    )
    assert torch.equal(greedy.response_ids, nucleus.response_ids)


def test_checkpoint_generation_defaults_do_not_leak(tiny_model, tokenizer) -> None:
    """A generation_config.json with repetition_penalty / top_k must not change sampling."""
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=5)
    expected = HFEngine(copy.deepcopy(tiny_model), tokenizer).generate(PROMPTS, params)
    tiny_model.generation_config.repetition_penalty = 10.0
    tiny_model.generation_config.top_k = 1
    tiny_model.generation_config.suppress_tokens = [EOS]
    got = HFEngine(tiny_model, tokenizer).generate(PROMPTS, params)
    assert torch.equal(got.response_ids, expected.response_ids)
    assert tiny_model.generation_config.top_k == 1  # restored afterwards


def test_seeded_sampling_is_reproducible_and_leaves_global_rng(tiny_model, tokenizer) -> None:
    engine = HFEngine(tiny_model, tokenizer)
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=6, seed=7)
    torch.manual_seed(123)
    a = engine.generate(PROMPTS, params)
    after = torch.rand(1)
    torch.manual_seed(123)
    b = engine.generate(PROMPTS, params)
    assert torch.equal(a.response_ids, b.response_ids) and a.completions == b.completions
    assert torch.equal(torch.rand(1), after)  # the global RNG stream was not consumed
    c = engine.generate(PROMPTS, SamplingParams(n=8, temperature=1.0, max_new_tokens=6, seed=8))
    assert not torch.equal(a.response_ids, c.response_ids)


def test_seeded_samples_do_not_depend_on_draws_from_the_global_rng_meanwhile(tiny_model, tokenizer) -> None:
    """An asynchronous run samples in a thread beside the trainer's: a draw from torch's global
    RNG in the other thread during a generation (here: in a forward hook, between two tokens)
    must not change the samples (it did while the sampler seeded the global RNG: a resumed run's
    first step measured the CPU's matmul rate with torch.randn, and the batch generated
    meanwhile differed from the uninterrupted run's)."""
    engine = HFEngine(tiny_model, tokenizer)
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=6, seed=7)
    quiet = engine.generate(PROMPTS, params)
    def other_thread_draws(*args: object) -> None:
        torch.randn(64)

    hook = tiny_model.register_forward_hook(other_thread_draws)
    try:
        busy = engine.generate(PROMPTS, params)
    finally:
        hook.remove()
    assert torch.equal(quiet.response_ids, busy.response_ids) and torch.equal(quiet.logprobs, busy.logprobs)


def test_update_weights_copies_into_engine_model(tiny_model, tokenizer, tiny_model_factory) -> None:
    engine = HFEngine(copy.deepcopy(tiny_model), tokenizer)
    other = tiny_model_factory(tokenizer, seed=1)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    before = engine.generate(PROMPTS, params)
    engine.update_weights(other.state_dict().items())  # includes the tied lm_head.weight name
    for name, p in other.named_parameters():
        assert torch.equal(engine.model.get_parameter(name), p)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still tied
    expected = HFEngine(other, tokenizer).generate(PROMPTS, params)
    assert torch.equal(engine.generate(PROMPTS, params).response_ids, expected.response_ids)
    assert not torch.equal(before.logprobs, expected.logprobs)


def test_update_weights_rejects_unknown_name_and_shape(tiny_model, tokenizer) -> None:
    engine = HFEngine(tiny_model, tokenizer)
    with pytest.raises(KeyError, match="no parameter 'model.nope'"):
        engine.update_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_pad_equal_to_eos_is_refused(tiny_model, tokenizer) -> None:
    bad = copy.deepcopy(tokenizer)
    bad.pad_token = bad.eos_token
    with pytest.raises(ValueError, match="pad != EOS"):
        HFEngine(tiny_model, bad)


def test_bad_params_are_refused(tiny_model, tokenizer) -> None:
    engine = HFEngine(tiny_model, tokenizer)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="at least one prompt"):
        engine.generate([], SamplingParams())


def test_generate_ids_equals_generate_on_the_same_tokens(tiny_model, tokenizer) -> None:
    """Token in: ids given as lists sample exactly what the text's tokenization samples, and the
    batch's prompt ids are those ids, left padded (nothing re-tokenized)."""
    engine = HFEngine(tiny_model, tokenizer)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    by_text = engine.generate(PROMPTS, params)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    by_ids = engine.generate_ids(ids, params, prompts=PROMPTS)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs"):
        assert torch.equal(getattr(by_text, name), getattr(by_ids, name)), name
    assert by_ids.prompts == by_text.prompts and by_ids.completions == by_text.completions
    odd = [[BOS, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], [BOS]]  # sequences no tokenizer would produce from text
    batch = engine.generate_ids(odd, SamplingParams(n=1, temperature=0.0, max_new_tokens=3))
    assert batch.prompt_ids[1].tolist() == [PAD] * 10 + [BOS]
    assert batch.prompt_ids[0].tolist() == odd[0]
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate_ids([[BOS], []], SamplingParams())


def test_min_new_tokens_samples_no_stop_before_it(tiny_model, tokenizer, unpadded_logits) -> None:
    """min_new_tokens = max_new_tokens: every row has exactly that many tokens (temperature 2 on a
    random model would otherwise stop some early); the logprob kept is the plain distribution's."""
    engine = HFEngine(tiny_model, tokenizer)
    free = engine.generate(PROMPTS, SamplingParams(n=4, temperature=2.0, max_new_tokens=10, seed=0))
    assert (free.response_mask.sum(1) < 10).any()  # without it some rows stop early
    fixed = engine.generate(PROMPTS, SamplingParams(n=4, temperature=2.0, max_new_tokens=10, seed=0,
                                                    min_new_tokens=10))
    assert (fixed.response_mask.sum(1) == 10).all() and fixed.finish_reason == ["length"] * 12
    assert not torch.isin(fixed.response_ids, torch.tensor([EOS])).any()
    with torch.no_grad():
        logits = unpadded_logits(tiny_model, fixed.prompt_ids, fixed.prompt_mask, fixed.response_ids,
                                 fixed.response_mask)
    for b in range(len(fixed)):
        ref = torch.log_softmax(logits[b] / 2.0, -1).gather(-1, fixed.response_ids[b][:, None]).squeeze(-1)
        assert torch.allclose(fixed.logprobs[b], ref, atol=1e-5)
    with pytest.raises(ValueError, match="min_new_tokens"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, min_new_tokens=5))
