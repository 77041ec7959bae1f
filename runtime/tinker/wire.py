"""The Tinker client's wire formats: its protobuf ``ForwardBackwardRequest`` in, its protobuf
``ForwardBackwardOutput`` / ``SampleResponse`` out (the client 0.38 reads those two only as
protobuf), and the JSON pieces of its other requests (a ``ModelInput``'s tokens).

The schema is the client's own generated module (``tinker.proto.tinker_public_pb2``, the
``tinker`` extra): the only part of the SDK the server imports. Every decoding error is a
``TinkerRefused`` (400) naming what is wrong.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import TinkerRefused


def _bad(message: str) -> TinkerRefused:
    """A request that cannot be read: answered as HTTP 400 with ``message``."""
    return TinkerRefused(400, message)


def schema() -> Any:
    """The client's protobuf module (``tinker_public_pb2``), or a 400 saying how to get it."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError:
        raise _bad("rldsl serve-tinker needs the tinker SDK's schema: pip install 'rldsl[tinker]'") from None
    return tinker_public_pb2


@dataclass
class Datum:
    """One datum of a ``forward_backward``: its input tokens (position i predicts target i) and
    its ``loss_fn_inputs`` as numpy arrays (``target_tokens``, ``weights``, ``logprobs``,
    ``advantages``, ...)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def targets(self) -> np.ndarray:
        return self.inputs["target_tokens"].astype(np.int64)


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    data: list[Datum]
    forward_only: bool


_NUMPY = {"DTYPE_FLOAT32": np.float32, "DTYPE_INT64": np.int64, "DTYPE_INT32": np.int32}


def _tensor(msg: Any, where: str) -> np.ndarray:
    pb = schema()
    dtypes = {getattr(pb, name): dt for name, dt in _NUMPY.items()}
    if msg.dtype not in dtypes:
        raise _bad(f"{where}: unsupported tensor dtype {msg.dtype} (float32, int64 or int32)")
    dt = np.dtype(dtypes[msg.dtype])
    if msg.HasField("sparse_csr"):
        raise _bad(f"{where}: sparse tensors are not served (send dense loss_fn_inputs)")
    if len(msg.dense) % dt.itemsize:
        raise _bad(f"{where}: {len(msg.dense)} bytes is not a whole number of {dt.name} values")
    arr = np.frombuffer(msg.dense, dtype=dt).copy()
    shape = list(msg.shape)
    if shape and int(np.prod(shape)) != arr.size:
        raise _bad(f"{where}: shape {shape} does not hold {arr.size} values")
    return arr.reshape(shape) if shape else arr


def _tokens(chunks: Any, where: str) -> list[int]:
    out: list[int] = []
    for j, chunk in enumerate(chunks):
        if not chunk.HasField("encoded_text"):
            raise _bad(f"{where}: chunk {j} is not text tokens (images and audio are not served)")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise _bad(f"{where}: chunk {j}'s token bytes are not int32 values")
        out.extend(np.frombuffer(raw, dtype=np.int32).tolist())
    return out


def read_forward_backward(body: bytes) -> FwdBwdRequest:
    """Decode the client's protobuf ``ForwardBackwardRequest`` (zstd already undone) and check
    each datum: tokens present, every per-token input as long as its tokens."""
    pb = schema()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # google.protobuf.message.DecodeError and kin
        raise _bad(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({e})") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # v2 wins: it carries strings too
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        where = f"forward_backward datum {i}"
        tokens = _tokens(d.model_input, where)
        inputs = {name: _tensor(t, f"{where} loss_fn_inputs[{name!r}]") for name, t in d.loss_fn_inputs.items()}
        if not tokens:
            raise _bad(f"{where}: no input tokens")
        for name, arr in inputs.items():
            if arr.ndim >= 1 and arr.shape[0] != len(tokens):
                raise _bad(f"{where}: loss_fn_inputs[{name!r}] has {arr.shape[0]} values for "
                                f"{len(tokens)} input tokens (one per input position)")
        data.append(Datum(tokens, inputs))
    if not data:
        raise _bad("forward_backward: no data")
    return FwdBwdRequest(msg.model_id, int(msg.seq_id), msg.loss_fn, config, data, bool(msg.forward_only))


def _batched(arrays: list[np.ndarray], dtype: Any) -> Any:
    pb = schema()
    bt = pb.BatchedTensor()
    flat = [np.ascontiguousarray(a, dtype=dtype).reshape(-1) for a in arrays]
    bt.dtype = pb.DTYPE_FLOAT32 if np.dtype(dtype) == np.float32 else pb.DTYPE_INT64
    bt.data = b"".join(a.tobytes() for a in flat)
    itemsize = np.dtype(dtype).itemsize
    bt.offsets = np.cumsum([0] + [a.size * itemsize for a in flat], dtype=np.int64).tobytes()
    return bt


def forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """The protobuf ``ForwardBackwardOutput``: per datum its output arrays (``logprobs``, ...),
    one batched record, and the metrics (names ``name:reduction``, as the client folds them)."""
    pb = schema()
    out = pb.ForwardBackwardOutput()
    out.loss_fn_output_type = "ArrayRecord"
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    record = out.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in (outputs[0] if outputs else {}):
        record.fields[name].CopyFrom(_batched([o[name] for o in outputs], np.float32))
    return out.SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # True: a stop string or token ended it ("stop"); False: max_tokens ("length")


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    """The protobuf ``SampleResponse`` (prompt logprobs: NaN for the first prompt token, which
    has no context, as the client reads it back as None)."""
    pb = schema()
    out = pb.SampleResponse()
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()


def model_input_tokens(model_input: Any, where: str) -> list[int]:
    """The tokens of a JSON ``ModelInput`` (``{"chunks": [{"tokens": [...]}, ...]}``)."""
    if not isinstance(model_input, dict) or not isinstance(model_input.get("chunks"), list):
        raise _bad(f"{where}: expected a ModelInput object with a 'chunks' list")
    out: list[int] = []
    for j, chunk in enumerate(model_input["chunks"]):
        tokens = chunk.get("tokens") if isinstance(chunk, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise _bad(f"{where}: chunk {j} is not text tokens (a 'tokens' list of ints)")
        out.extend(tokens)
    return out
