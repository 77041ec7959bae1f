"""The experts vLLM routed each token to, captured inside its workers on builds that cannot
return them (the CPU build), for ``rollout.routing_replay`` (docs/moe.md).

vLLM GPU builds return them with the result (``LLM(enable_return_routed_experts=True)``,
``CompletionOutput.routed_experts`` [fed tokens, layers, top_k]); on the CPU build that option
needs Model Runner V2, hence Triton, and is refused. There vLLM's own router hook
(``BaseRouter.set_capture_fn``, the one vLLM's ``RoutedExpertsCapturer`` binds) is set on every
MoE layer's router inside the worker (:class:`RoutingCapture`, driven through ``collective_rpc``
by :class:`RoutingWorkerMixin`'s ``rldsl_routing_*`` methods, mixed into worker.py's extension).

One forward step of vLLM runs the flattened tokens of every scheduled request. The capture reads
that step's layout from the model runner while the forward runs -- the requests in input-batch
order (``input_batch.req_ids``), each one's rows (``query_start_loc``), each row's position in its
sequence (``positions``) and token (``input_ids``) -- and files each row under its request and
position. Chunked prefill and preemption (a request recomputed) are handled by the positions;
prefix caching is not (a cached prompt block is not computed, so not routed): the engine turns it
off while it records. convert.py lays the records out as ``routed_experts``, matching each batch
row with the request whose fed tokens are its prompt and completion (all but the last token): no
vLLM request-id scheme is relied on, and a mismatch is an error rather than a wrong record.

Shapes: N rows of one step, Y MoE layers (in layer order), K = top-k.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .convert import CAPTURED_PARTS
from .weights import pack_bucket


def moe_layer_ids(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """(layer id, router) of every MoE layer of a vLLM model whose router takes a capture hook
    (vLLM's ``MoERunner``: ``layer_id``, ``router.set_capture_fn``), in layer order."""
    out = []
    for module in model.modules():
        router = getattr(module, "router", None)
        layer_id = getattr(module, "layer_id", None)
        if callable(getattr(router, "set_capture_fn", None)) and isinstance(layer_id, int):
            out.append((layer_id, router))
    out.sort(key=lambda x: x[0])
    if len({i for i, _ in out}) != len(out):
        raise RuntimeError("routing capture: two MoE layers of the vLLM model share a layer id")
    return out


class RoutingCapture:
    """Inside a vLLM worker: the experts of every token its model runner computes while
    :attr:`on` (one ``generate`` call), filed by request and position.

    ``runner`` is vLLM's (GPU or CPU) model runner, whose ``execute_model`` it wraps (this
    instance only) so that only scheduled steps are recorded, not the profiling and warm-up
    forwards. :meth:`bind` (again before each call: a weight reload may rebuild layers) sets the
    routers' capture hooks."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.on = False
        self.layers: list[int] = []  # vLLM layer ids of the MoE layers (Y)
        self._rows: list[list[torch.Tensor]] = []  # per MoE layer: this step's captured chunks
        self._layout: tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._steps: list[tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        original = runner.execute_model

        def execute_model(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return original(*args, **kwargs)
            self._rows = [[] for _ in self.layers]
            self._layout = None
            try:
                return original(*args, **kwargs)
            finally:
                self._close_step()

        runner.execute_model = execute_model  # this runner only (an instance attribute)

    def bind(self, model: torch.nn.Module) -> int:
        """Set the capture hook of every MoE router of ``model``; returns Y."""
        found = moe_layer_ids(model)
        if not found:
            raise RuntimeError("routing capture: the vLLM model has no MoE layer with a router capture hook "
                               "(BaseRouter.set_capture_fn)")
        self.layers = [i for i, _ in found]
        for y, (_, router) in enumerate(found):
            router.set_capture_fn(self._hook(y))
        return len(found)

    def _hook(self, y: int) -> Callable[[torch.Tensor], None]:
        def capture(topk_ids: torch.Tensor) -> None:
            if not self.on or len(self._rows) != len(self.layers):
                return  # a forward outside a recorded step (profiling, warm-up, a dummy batch)
            if self._layout is None:
                self._layout = self._read_layout()
            self._rows[y].append(topk_ids.detach().to("cpu", torch.int16, copy=True))
        return capture

    def _read_layout(self) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]:
        """(request ids in input-batch order, query_start_loc [R + 1], positions [N], token ids [N])
        of the step being computed (read while its forward runs)."""
        r = self.runner
        num_reqs = int(r.input_batch.num_reqs)
        req_ids = [str(x) for x in r.input_batch.req_ids[:num_reqs]]
        qsl = torch.as_tensor(r.query_start_loc.cpu[: num_reqs + 1]).to(torch.int64).clone()
        n = int(qsl[-1])
        positions = r.positions[:n].to("cpu", torch.int64).clone()
        tokens = r.input_ids.cpu[:n].to(torch.int64).clone()
        return req_ids, qsl, positions, tokens

    def _close_step(self) -> None:
        layout, rows = self._layout, self._rows
        self._layout, self._rows = None, []
        if layout is None:
            return  # no MoE forward in this step
        req_ids, qsl, positions, tokens = layout
        n = int(qsl[-1])
        per_layer = []
        for y, chunks in enumerate(rows):
            got = torch.cat(chunks) if chunks else torch.empty(0, 0, dtype=torch.int16)
            if got.shape[0] < n:
                raise RuntimeError(f"routing capture: MoE layer {self.layers[y]} routed {got.shape[0]} rows in a "
                                   f"step of {n} scheduled tokens")
            per_layer.append(got[:n])  # rows past n: padding of the step
        experts = torch.stack(per_layer, dim=1)  # [N, Y, K]
        self._steps.append((req_ids, qsl, positions, tokens, experts))

    def take(self) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(request id, positions [n], token ids [n], experts [n, Y, K]) per request seen since the
        last take, rows in the order computed (a recomputed position appears again, later)."""
        per_req: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for req_ids, qsl, positions, tokens, experts in self._steps:
            for i, rid in enumerate(req_ids):
                a, b = int(qsl[i]), int(qsl[i + 1])
                if b > a:
                    per_req.setdefault(rid, []).append((positions[a:b], tokens[a:b], experts[a:b]))
        self._steps = []
        return [(rid, torch.cat([p for p, _, _ in parts]), torch.cat([t for _, t, _ in parts]),
                 torch.cat([e for _, _, e in parts])) for rid, parts in per_req.items()]


class RoutingWorkerMixin:
    """The worker's side of the capture (mixed into worker.py's ``RldslWorkerExtension``; called
    through ``collective_rpc``): ``self`` is vLLM's worker."""

    def rldsl_routing_layers(self) -> list[int]:
        """vLLM layer ids of the model's MoE layers, in order (Y of them)."""
        return [i for i, _ in moe_layer_ids(self.model_runner.get_model())]

    def rldsl_routing_begin(self) -> int:
        """Record from now on (the routers' hooks set again, earlier records dropped); returns Y."""
        capture = getattr(self, "rldsl_capture", None)
        if capture is None:
            capture = self.rldsl_capture = RoutingCapture(self.model_runner)
        capture.take()
        capture.on = True
        return capture.bind(self.model_runner.get_model())

    def rldsl_routing_take(self) -> bytes:
        """Stop recording; the records since :meth:`rldsl_routing_begin` (``RoutingCapture.take``),
        packed for the RPC (:func:`unpack_captured`)."""
        capture = getattr(self, "rldsl_capture", None)
        taken = [] if capture is None else capture.take()
        if capture is not None:
            capture.on = False
        return pack_captured(taken)



def pack_captured(taken: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]) -> bytes:
    """:meth:`RoutingCapture.take`'s records as bytes (vLLM's RPC turns tensors and tuples into
    lists): safetensors, ``<request id>/<part>`` (convert.py's ``unpack_captured`` reads them)."""
    return pack_bucket([(f"{rid}/{part}", t) for rid, *tensors in taken for part, t in zip(CAPTURED_PARTS, tensors)])
