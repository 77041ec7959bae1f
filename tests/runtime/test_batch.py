"""RolloutBatch operations: rows and groups, concatenation, devices, model inputs."""
from __future__ import annotations

import torch

from rldsl.runtime.batch import (RolloutBatch, group_rows, model_inputs, position_ids_from_mask,
                                 repeat_each)

PAD = 0


def make(prompt_len: int, response_len: int, P: int = 2, G: int = 2, first: int = 10) -> RolloutBatch:
    """P groups of G rows; row b's tokens are first + b, its prompt fully real, response fully valid."""
    B = P * G
    tok = torch.arange(first, first + B)[:, None]
    return RolloutBatch(
        prompt_ids=tok.expand(B, prompt_len).clone(), prompt_mask=torch.ones(B, prompt_len, dtype=torch.long),
        response_ids=tok.expand(B, response_len).clone(), response_mask=torch.ones(B, response_len, dtype=torch.long),
        logprobs=-torch.ones(B, response_len), finish_reason=["stop"] * B,
        prompts=[f"p{b // G}" for b in range(B)], completions=[f"c{b}" for b in range(B)], group_size=G,
        answers=[f"a{b // G}" for b in range(B)])


def test_group_rows_and_select_groups_keep_groups_whole() -> None:
    assert group_rows([2, 0], 3).tolist() == [6, 7, 8, 0, 1, 2]
    b = make(3, 2, P=3, G=2)
    sub = b.select_groups([2, 0])
    assert sub.completions == ["c4", "c5", "c0", "c1"] and sub.answers == ["a2", "a2", "a0", "a0"]
    assert sub.response_ids[:, 0].tolist() == [14, 15, 10, 11] and sub.group_size == 2


def test_concat_pads_prompts_left_and_responses_right() -> None:
    a, b = make(2, 3, P=1, first=10), make(4, 1, P=1, first=20)
    c = RolloutBatch.concat([a, b], PAD)
    assert c.prompt_ids.tolist()[0] == [PAD, PAD, 10, 10] and c.prompt_mask.tolist()[0] == [0, 0, 1, 1]
    assert c.response_ids.tolist()[2] == [20, PAD, PAD] and c.response_mask.tolist()[2] == [1, 0, 0]
    assert c.logprobs.tolist()[2] == [-1.0, 0.0, 0.0]
    assert c.completions == ["c0", "c1", "c0", "c1"] and c.group_size == 2
    assert RolloutBatch.concat([a], PAD) is a


def test_model_inputs_positions_count_real_tokens_only() -> None:
    b = make(3, 2, P=1, G=1)
    b.prompt_mask[0, 0] = 0  # one left pad
    b.response_mask[0, 1] = 0  # a finished row's padding
    ids, attn, pos = model_inputs(b)
    assert ids.shape == attn.shape == pos.shape == (1, 5)
    assert attn.tolist() == [[0, 1, 1, 1, 0]]
    assert pos.tolist() == [[0, 0, 1, 2, 2]]
    assert torch.equal(pos, position_ids_from_mask(attn))


def test_to_the_same_device_is_the_batch_itself_and_repeat_each() -> None:
    b = make(2, 2)
    assert b.to("cpu") is b
    assert repeat_each(["x", "y"], 3) == ["x", "x", "x", "y", "y", "y"]
