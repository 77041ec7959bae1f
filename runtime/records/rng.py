"""Random number generators: seeding a process, per-step sampling seeds, saved states.

Exact resume rests on two rules: every sampling seed is derived from (run seed, step,
round) by :func:`step_seed`, never drawn from a global generator, and the global
generators' states are saved with every checkpoint (:func:`capture_rng`) and put back
last on resume (:func:`restore_rng`).
"""
from __future__ import annotations

import hashlib
import random
from typing import Any, Mapping

import numpy as np
from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first


def seed_all(seed: int) -> None:
    """Seed python ``random``, numpy and torch (CPU and CUDA) in this process."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int, round_: int = 0, what: str = "rollout") -> int:
    """A sampling seed fixed by (run seed, step, round): resumed runs draw the same samples."""
    h = hashlib.sha256(f"{seed}:{step}:{round_}:{what}".encode()).digest()
    return int.from_bytes(h[:4], "little")


def capture_rng() -> dict[str, Any]:
    """The state of the global RNGs: python ``random``, numpy, torch CPU, CUDA.

    Only plain values and tensors, so the state survives ``torch.load(weights_only=True)``.
    Private generators (a ``torch.Generator`` of the data loader, a numpy ``Generator``)
    are the caller's: put their states in a checkpoint's ``extra_state``.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put every RNG back to a state from :func:`capture_rng`.

    The CUDA state is restored when it was saved and CUDA is available; a checkpoint
    saved on GPU resumed on CPU restores the CPU generators only.
    """
    py = state["python"]
    # torch.load returns the inner tuple of random.getstate() as a list.
    random.setstate((py[0], tuple(py[1]), py[2]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
