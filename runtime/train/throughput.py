"""What the trainer's forwards push through the model: real and computed tokens, FLOPs, the peak.

Counted per forward (``TokenCount``): the tokens of its sequences (each row's prompt and
response, less the last token, which predicts nothing: the same number whatever the path), the
tokens it actually computed, of which how many were padding (a packed row's filler, a padded
row's pad columns; the shared-prompt forward computes each group's prompt once, so it can
compute fewer tokens than its sequences hold) and the sum of squared sequence lengths.

FLOPs, as verl's ``FlopsCounter`` counts them (verl/utils/flops_counter.py), over the *real*
sequences, so that padding is waste and not work:

    forward  = 2 N tokens + 4 d L sum_i s_i^2
    backward = 2 x forward

N the weights of the model's linear layers (LM head included, the embedding lookup not), L the
layers, d the attention width (heads x head_dim), s_i each sequence's length. The attention
term counts the full s x s scores, as verl does (a causal kernel computes about half).

The peak a step is measured against (``peak_flops``): ``train.peak_flops`` when set; on a GPU
the dense rate of its name in ``GPU_PEAKS`` (bf16 under autocast, else the fp32 rate: TF32
tensor cores are not counted); on CPU a float32 matmul rate measured once at start on this
process's threads.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

#: dense (no sparsity) peak FLOP/s from the vendors' spec sheets: (bf16/fp16 tensor, fp32)
GPU_PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 67e12),
    "H100 SXM": (989e12, 67e12),
    "H100 NVL": (835e12, 60e12),
    "H100 PCIe": (756e12, 51e12),
    "H100": (989e12, 67e12),   # an H100 of unstated form: the SXM figures
    "H20": (148e12, 44e12),
    "GH200": (989e12, 67e12),
    "B200": (2250e12, 80e12),
    "A100": (312e12, 19.5e12),
    "A800": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "L40": (181e12, 90.5e12),
    "L4": (121e12, 30.3e12),
    "A10G": (70e12, 31.2e12),
    "A10": (125e12, 31.2e12),
    "RTX 4090": (165e12, 82.6e12),
    "V100": (125e12, 15.7e12),
    "T4": (65e12, 8.1e12),
}


@dataclass
class TokenCount:
    """Tokens through the model over some forwards (see the module docstring)."""

    real: int = 0            # tokens of the sequences (each row's prompt + response, less its last)
    computed: int = 0        # tokens the forwards computed
    padding: int = 0         # of those, padding or filler
    square: int = 0          # sum over sequences of s^2
    per_forward: list[int] = field(default_factory=list)  # real tokens of each forward
    flops: float = 0.0       # filled by ``merge`` (the model's dimensions are the caller's)

    def add(self, lengths: Sequence[int], computed: int, distinct: int | None = None) -> None:
        """One forward over sequences of ``lengths`` that computed ``computed`` tokens, of which
        ``computed - distinct`` were padding; ``distinct`` defaults to sum(lengths) and is fewer
        when a shared prompt ran once per group."""
        n = int(sum(lengths))
        self.real += n
        self.computed += int(computed)
        self.padding += int(computed) - (n if distinct is None else int(distinct))
        self.square += int(sum(int(s) * int(s) for s in lengths))
        self.per_forward.append(n)

    def merge(self, other: "TokenCount", dims: "ModelDims", backward: bool, waste: bool = False) -> None:
        """Add ``other``'s forwards and their FLOPs on a model of ``dims``; ``waste``: a copy
        whose result is discarded (it keeps ranks' collectives in step): all its tokens count
        as padding, none as real work."""
        if waste:
            self.computed += other.computed
            self.padding += other.computed
            return
        self.real += other.real
        self.computed += other.computed
        self.padding += other.padding
        self.square += other.square
        self.per_forward += other.per_forward
        self.flops += other.model_flops(dims, backward)

    def model_flops(self, dims: "ModelDims", backward: bool) -> float:
        """Model FLOPs of these forwards (and their backward passes)."""
        fwd = 2.0 * dims.linear * self.real + 4.0 * dims.attention * dims.layers * self.square
        return fwd * (3.0 if backward else 1.0)


@dataclass(frozen=True)
class ModelDims:
    """What the FLOP count reads of a model: N linear weights, L layers, d attention width."""

    linear: int
    layers: int
    attention: int

    @classmethod
    def of(cls, model: nn.Module) -> "ModelDims":
        from transformers.pytorch_utils import Conv1D
        seen: set[int] = set()
        n = 0
        for m in model.modules():
            if isinstance(m, (nn.Linear, Conv1D)) and id(m.weight) not in seen:
                seen.add(id(m.weight))
                n += m.weight.numel()
        cfg = getattr(model, "config", None)
        if cfg is None:  # the critic: its body's config
            cfg = next((m.config for m in model.modules() if hasattr(m, "config")), None)
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        layers = _first(text, ("num_hidden_layers", "n_layer", "num_layers"), 0)
        heads = _first(text, ("num_attention_heads", "n_head"), 0)
        hidden = _first(text, ("hidden_size", "n_embd", "d_model"), 0)
        head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else 0)
        return cls(n, int(layers), int(heads * head_dim))


def _first(cfg: object, names: Sequence[str], default: int) -> int:
    for name in names:
        v = getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


def peak_flops(device: str | torch.device, dtype: torch.dtype | None, configured: float | None) -> float:
    """FLOP/s the step's MFU is measured against (module docstring)."""
    if configured:
        return float(configured)
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():  # a driver without the trainers' GPUs
            return float("nan")
        name = torch.cuda.get_device_name(device)
        for key, (half, single) in GPU_PEAKS.items():
            if key.lower() in name.lower():
                return half if dtype in (torch.bfloat16, torch.float16) else single
        return float("nan")  # unknown GPU: set train.peak_flops
    return cpu_matmul_rate(torch.get_num_threads())


@functools.cache
def cpu_matmul_rate(threads: int, size: int = 512, seconds: float = 0.2, tries: int = 5) -> float:
    """The best float32 matmul rate (FLOP/s) of ``size``-square products on this CPU, measured
    for ``seconds`` (and at least ``tries`` products) with the process's ``threads`` (the
    argument keys the cache). With one thread each product is timed on this thread's CPU clock,
    so a machine busy with other processes does not make the peak look lower than it is (wall
    time lost to them would: an MFU above 1); with several threads, on the wall clock. Its
    operands come from a generator of its own: a draw from the process-wide RNG would move the
    RNG state a run checkpoints (a resumed process measures again, an uninterrupted one does not)."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g)
    b = torch.randn(size, size, generator=g)
    a @ b  # warm up
    best = 0.0
    end = time.perf_counter() + seconds
    done = 0
    while done < tries or time.perf_counter() < end:
        t0 = clock()
        a @ b
        dt = clock() - t0
        done += 1
        if dt > 0:  # a CPU clock coarser than one product reads 0: not a measurement
            best = max(best, 2.0 * size ** 3 / dt)
    return best
