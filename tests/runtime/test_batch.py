"""RolloutBatch operations: rows and groups, concatenation, devices, model inputs."""
from __future__ import annotations

import torch

from rldsl.runtime.batch import (Episode, RolloutBatch, TokenRow, group_rows, model_inputs, position_ids_from_mask,
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


def test_from_rows_pads_every_per_token_field_of_its_rows() -> None:
    """The one place rows become a batch: prompts left padded, responses (ids, loss mask, logprobs)
    right padded, routing laid out from the prompt's first column; an engine's rows (no loss mask)
    have no ``response_attention``, an episode's do."""
    rec = torch.arange(3 * 1 * 2, dtype=torch.int16).view(3, 1, 2)  # [p + fed = 3, Y=1, K=2]
    rows = [TokenRow([5, 6], [7, 8], [-0.5, -0.25], "stop", "p", "c0", routed_experts=rec),
            TokenRow([9], [], [], "length", "q", "c1")]
    b = RolloutBatch.from_rows(rows, 1, PAD)
    assert b.prompt_ids.tolist() == [[5, 6], [PAD, 9]] and b.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert b.response_ids.tolist() == [[7, 8], [PAD, PAD]] and b.response_mask.tolist() == [[1, 1], [0, 0]]
    assert b.logprobs.tolist() == [[-0.5, -0.25], [0.0, 0.0]] and b.logprobs.dtype == torch.float32
    assert b.finish_reason == ["stop", "length"] and b.prompts == ["p", "q"] and b.completions == ["c0", "c1"]
    assert b.response_attention is None and b.episodes == [] and b.group_size == 1
    assert b.routed_experts.shape == (2, 4, 1, 2) and b.routed_experts[0, :3].tolist() == rec.tolist()
    assert (b.routed_experts[0, 3:] == -1).all() and (b.routed_experts[1] == -1).all()
    assert RolloutBatch.from_rows(rows[1:], 1, PAD, width=3).response_ids.shape == (1, 3)  # an engine's columns

    turns = [TokenRow([5], [7, 1, 8], [-0.5, 0.0, -1.0], "stop", "p", "c", mask=[1, 0, 1], episode=Episode([])),
             TokenRow([5], [7], [-0.5], "length", "p", "d", mask=[1], episode=Episode([], 1.0))]
    e = RolloutBatch.from_rows(turns, 2, PAD)
    assert e.response_mask.tolist() == [[1, 0, 1], [1, 0, 0]] and e.attention.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert [x.env_reward for x in e.episodes] == [None, 1.0] and e.routed_experts is None


def test_images_are_a_batch_field_kept_by_rows() -> None:
    """Each row's image references travel with its row: made by from_rows, selected, concatenated
    beside a batch without images (its rows: none); a batch without any has none."""
    seen = RolloutBatch.from_rows([TokenRow([5], [7], [-0.5], "stop", "p", "c", images=["a.png", "b.png"]),
                                   TokenRow([5], [8], [-0.5], "stop", "p", "d")], 2, PAD)
    assert seen.images == [["a.png", "b.png"], []]
    assert seen.select(torch.tensor([1, 0])).images == [[], ["a.png", "b.png"]]
    assert RolloutBatch.concat([make(1, 1, P=1), seen], PAD).images == [[], [], ["a.png", "b.png"], []]
    assert make(1, 1).images == [] and RolloutBatch.concat([make(1, 1), make(2, 1)], PAD).images == []


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


def test_a_checkpoint_keeps_queued_episodes_as_plain_values(tmp_path) -> None:
    """An asynchronous run's checkpoint keeps the batches generated ahead as plain values (what
    ``torch.load(weights_only=True)`` reads): a tool episode and an agent's padding row come back
    equal, stored as the dicts episodes were before they had a type (older checkpoints read too)."""
    from types import SimpleNamespace

    from rldsl.runtime.batch import AgentRow, Episode, StepRollout
    from rldsl.runtime.rollout.producer import Produced
    from rldsl.runtime.run.checkpointing import _extra_state, restored_queue

    call = {"route": "chat", "row": 0, "prompt_tokens": 3, "completion_ids": [5, 6], "finish_reason": "stop",
            "version": 2, "bridged": False}
    b = make(2, 3, P=1, G=2)
    b.episodes = [Episode([{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}], 1.0,
                          [[1, 0.5], [2, 0.5]]),
                  Episode([{"role": "user", "content": "1+2="}], None, error="the agent raised KeyError: 'x'",
                          agent=AgentRow(row=1, rows=1, padding=True, prefix_breaks=0, calls=[call]))]
    queued = [Produced(4, 2, StepRollout(4, b, [7], ["1+2="], torch.tensor([1.0, float("nan")]), {"sampling_rounds": 1.0}))]
    extra = _extra_state(SimpleNamespace(prompts=SimpleNamespace(state_dict=dict)), 4, {}, queued)
    assert extra["queued"][0]["batch"]["episodes"] == [
        {"messages": b.episodes[0].messages, "env_reward": 1.0, "step_rewards": [[1, 0.5], [2, 0.5]]},
        {"env_reward": None, "error": "the agent raised KeyError: 'x'", "calls": [call], "messages": b.episodes[1].messages,
         "row": 1, "agent": {"calls": 1, "prefix_breaks": 0, "rows": 1, "error": "the agent raised KeyError: 'x'",
                             "versions": [2]}, "padding": True}]
    torch.save(extra, tmp_path / "extra.pt")
    (back,) = restored_queue(torch.load(tmp_path / "extra.pt", weights_only=True))
    assert (back.step, back.version, back.value.prompt_ids) == (4, 2, [7])
    assert back.value.batch.episodes == b.episodes and back.value.batch.completions == b.completions
