"""The vLLM engine's routing capture without vLLM (runtime/rollout/engines/vllm/routing.py and
convert.py): the rows of each step filed under their requests and positions from the model runner's
layout, and laid out as ``routed_experts``. A stand-in runner with vLLM's attribute names plays the
steps of a batched, chunk-prefilled schedule; tests/runtime/rollout/engines/test_vllm_moe.py runs
the real one."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rldsl.runtime.batch import RolloutBatch
from rldsl.runtime.rollout.engines.vllm.convert import (by_position, layout_captured, layout_returned,
                                                        outputs_to_rollout_batch, unpack_captured)
from rldsl.runtime.rollout.engines.vllm.routing import RoutingCapture, pack_captured

Y, K = 2, 2


def experts_of(token: int, position: int) -> torch.Tensor:
    """[Y, K] a made-up routing that names its token and position."""
    return torch.tensor([[token % 7, position % 5], [position % 3, 4 + token % 2]], dtype=torch.int16)


class Runner:
    """vLLM's model runner as the capture reads it: ``input_batch.req_ids`` / ``num_reqs``,
    ``query_start_loc.cpu``, ``positions``, ``input_ids.cpu``; ``execute_model`` runs one step, each
    MoE layer's router calling its capture hook (in ``chunks`` pieces, as a chunked MoE layer does)."""

    def __init__(self):
        self.routers = [SimpleNamespace(capture_fn=None) for _ in range(Y)]
        for r in self.routers:
            r.set_capture_fn = lambda fn, r=r: setattr(r, "capture_fn", fn)
        self.input_batch = SimpleNamespace(req_ids=[], num_reqs=0)

    def execute_model(self, step: list[tuple[str, list[int], int]], chunks: int = 1, padding: int = 0):
        """``step``: (request id, its token ids so far, first position computed now) per request."""
        self.input_batch.req_ids = [rid for rid, _, _ in step] + ["stale"]  # the batch is longer than num_reqs
        self.input_batch.num_reqs = len(step)
        counts = [len(tokens) - start for _, tokens, start in step]
        self.query_start_loc = SimpleNamespace(cpu=torch.tensor([0] + counts).cumsum(0).int())
        self.positions = torch.cat([torch.arange(start, len(t)) for _, t, start in step])
        self.input_ids = SimpleNamespace(cpu=torch.tensor([x for _, t, start in step for x in t[start:]]))
        rows = torch.stack([experts_of(int(t), int(p)) for t, p in zip(self.input_ids.cpu, self.positions)])
        rows = torch.cat([rows, torch.full((padding, Y, K), 9, dtype=torch.int16)])  # the step's padding rows
        for y, router in enumerate(self.routers):
            if router.capture_fn is not None:
                for piece in rows[:, y].chunk(chunks):
                    router.capture_fn(piece.int())
        return "output"


def capture_of(runner: Runner) -> RoutingCapture:
    capture = RoutingCapture(runner)
    model = torch.nn.Module()
    for i, r in enumerate(runner.routers):  # vLLM's MoERunner: layer_id, router
        holder = torch.nn.Module()
        holder.layer_id, holder.router = i, r
        model.add_module(f"layer{i}", holder)
    assert capture.bind(model) == Y
    return capture


def test_rows_of_batched_chunked_steps_are_filed_by_request_and_position():
    """Two requests prefilled in chunks next to a third's decode, one preempted and recomputed,
    a MoE layer that routes in pieces, padding rows, a profiling forward outside any step: each
    request gets exactly its tokens' experts, in position order."""
    runner = Runner()
    capture = capture_of(runner)
    a, b, c = [5, 6, 7, 8, 9], [11, 12, 13], [20, 21]
    runner.execute_model([("a", a[:3], 0), ("b", b, 0)], chunks=2, padding=3)  # not recording: dropped
    capture.on = True
    for router in runner.routers:  # a forward outside execute_model (vLLM's profiling run)
        router.capture_fn(torch.zeros(4, K, dtype=torch.int32))
    assert runner.execute_model([("a", a[:3], 0), ("b", b[:2], 0)], chunks=2, padding=3) == "output"
    runner.execute_model([("b", b, 2), ("a", a[:4], 3), ("c", c[:1], 0)], padding=1)
    runner.execute_model([("c", c, 0), ("a", a, 4)], chunks=3)  # c preempted: recomputed from 0
    taken = unpack_captured(pack_captured(capture.take()))
    records = {tuple(tok.tolist()): exp for tok, exp in by_position(taken)}
    assert set(records) == {tuple(a), tuple(b), tuple(c)}
    for tokens, experts in records.items():
        want = torch.stack([experts_of(t, p) for p, t in enumerate(tokens)])
        assert torch.equal(experts, want)
    assert capture.take() == []  # taken once


def test_a_position_never_computed_is_an_error():
    """A prompt block served from a prefix cache is not routed: refused, not filled."""
    with pytest.raises(RuntimeError, match="prefix caching"):
        by_position([("r", torch.tensor([0, 2]), torch.tensor([1, 3]), torch.zeros(2, Y, K, dtype=torch.int16))])


def request_output(prompt: list[int], completions: list[list[int]]):
    """vLLM's RequestOutput as convert.py reads it (logprobs 0)."""
    return SimpleNamespace(prompt_token_ids=prompt, outputs=[
        SimpleNamespace(index=i, token_ids=c, logprobs=[{t: SimpleNamespace(logprob=0.0)} for t in c],
                        finish_reason="length") for i, c in enumerate(completions)])


class Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, i)) for i in ids]


def test_layout_is_the_hf_engines():
    """Rows take the record that fed their tokens (two equal greedy rows one each): the prompt
    right-aligned in Tp columns, the response from Tp, -1 on padding, on each response's last
    token and after a stop id vLLM did not stop on."""
    EOS, STOP = 2, 99
    outs = [request_output([10, 11, 12], [[30, 31, 32, 33], [30, 31, 32, 33]]),
            request_output([40], [[41, STOP, 43, 44], [45]])]
    batch: RolloutBatch = outputs_to_rollout_batch(outs, Tok(), ["p", "q"], 2, pad_id=0, eos_id=EOS,
                                                   stop_ids={STOP})
    fed = [([10, 11, 12, 30, 31, 32], 2), ([40, 41, STOP, 43], 1), ([40], 1)]  # (tokens, copies)
    records = [(torch.tensor(t), torch.stack([experts_of(x, p) for p, x in enumerate(t)]))
               for t, n in fed for _ in range(n)]
    r = layout_captured(outs, records, batch)
    assert r.shape == (4, 3 + 4, Y, K)
    has = (r >= 0).all(-1).all(-1)
    assert has.tolist() == [[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0],
                            [0, 0, 1, 1, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0]]
    assert torch.equal(r[0, :6], records[0][1]) and torch.equal(r[1], r[0])
    assert torch.equal(r[2, 2:4], records[2][1][:2])  # 41 is fed; STOP (the cut) is the last token
    with pytest.raises(RuntimeError, match="no recorded request fed the tokens of row 3"):
        layout_captured(outs, records[:3], batch)


def test_returned_routing_is_laid_out_as_the_captured():
    """GPU builds return ``CompletionOutput.routed_experts`` [fed tokens, every layer, K] (uint8):
    the MoE layers' ids kept, laid out as the capture's records are (the vLLM side is unrun here)."""
    outs = [request_output([10, 11, 12], [[30, 31, 32]]), request_output([40], [[41, 42]])]
    batch = outputs_to_rollout_batch(outs, Tok(), ["p", "q"], 1, pad_id=0, eos_id=2)
    fed = [[10, 11, 12, 30, 31], [40, 41]]
    records = [(torch.tensor(t), torch.stack([experts_of(x, p) for p, x in enumerate(t)])) for t in fed]
    for (_, experts), ro in zip(records, outs):  # 4 layers, the MoE ones 1 and 3; one extra row
        every = torch.zeros(len(experts) + 1, 4, K, dtype=torch.uint8)
        every[:len(experts), 1], every[:len(experts), 3] = experts[:, 0], experts[:, 1]
        ro.outputs[0].routed_experts = every.numpy()
    assert torch.equal(layout_returned(outs, batch, [1, 3]), layout_captured(outs, records, batch))
