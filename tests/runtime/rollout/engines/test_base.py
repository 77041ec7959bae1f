"""What every engine shares: sampling-parameter checks, pad/EOS ids, the first-stop-token mask."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rldsl.runtime.rollout.engines.base import (SamplingParams, check_request, cut_at_first_stop, special_token_ids,
                                        valid_until_first_eos)

PAD, EOS = 0, 2


def test_valid_until_first_eos_hand_cases() -> None:
    ids = torch.tensor(
        [
            [5, 6, EOS, 7, EOS],  # stops at 2
            [EOS, 5, 5, 5, 5],  # immediate EOS
            [5, 6, 7, 8, 9],  # no EOS
        ]
    )
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(valid_until_first_eos(ids, EOS), expected)


def test_several_stop_ids_end_a_row_at_the_first_of_them() -> None:
    ids = torch.tensor([[5, 9, 6, EOS], [5, 6, 7, 8]])
    assert valid_until_first_eos(ids, {EOS, 9}).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_cut_at_first_stop_pads_after_the_stop_and_past_the_generated_length() -> None:
    ids = torch.tensor([[5, EOS, 7, 7], [5, 6, 7, 7], [5, 6, 9, 9]])
    lengths = torch.tensor([4, 4, 2])  # row 2 generated two ids; the rest is filler
    out, mask, stopped = cut_at_first_stop(ids, {EOS}, PAD, lengths)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert out.tolist() == [[5, EOS, PAD, PAD], [5, 6, 7, 7], [5, 6, PAD, PAD]]
    assert stopped.tolist() == [True, False, False]


@pytest.mark.parametrize("bad", [
    SamplingParams(n=0), SamplingParams(max_new_tokens=0),
    SamplingParams(temperature=-1.0), SamplingParams(top_p=0.0), SamplingParams(top_p=1.5),
])
def test_sampling_params_out_of_range_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="need"):
        check_request(["1+1="], bad)


def test_a_request_needs_a_prompt() -> None:
    SamplingParams(n=4, temperature=0.0, top_p=1.0).check()
    with pytest.raises(ValueError, match="at least one prompt"):
        check_request([], SamplingParams())


def test_special_token_ids_need_distinct_pad_and_eos() -> None:
    assert special_token_ids(SimpleNamespace(pad_token_id=0, eos_token_id=2), "E") == (0, 2)
    with pytest.raises(ValueError, match="E needs a tokenizer with both"):
        special_token_ids(SimpleNamespace(pad_token_id=None, eos_token_id=2), "E")
    with pytest.raises(ValueError, match="E needs pad != EOS"):
        special_token_ids(SimpleNamespace(pad_token_id=2, eos_token_id=2), "E")


def test_stop_ids_are_the_eos_and_every_generation_config_eos(tmp_path, tokenizer) -> None:
    from transformers import GenerationConfig

    from rldsl.runtime.rollout.engines.base import generation_config_eos_ids, stop_token_ids
    GenerationConfig(eos_token_id=[2, 9, 11]).save_pretrained(tmp_path)
    assert generation_config_eos_ids(str(tmp_path)) == {2, 9, 11}  # a folder's generation_config.json
    assert generation_config_eos_ids(str(tmp_path / "missing")) == set()
    assert generation_config_eos_ids(GenerationConfig(eos_token_id=7)) == {7}
    assert generation_config_eos_ids(GenerationConfig()) == set()
    pad_listed = GenerationConfig(eos_token_id=[tokenizer.pad_token_id, 9])
    assert stop_token_ids(tokenizer, pad_listed) == {tokenizer.eos_token_id, 9}  # the pad id never stops
