"""Per-prompt running statistics of the rewards across steps: what a spec's formulas read as
``prompt_mean``, ``prompt_var``, ``prompt_count``, ``prompt_steps`` and ``prompt_step_var``
(rldsl/inputs.py, source ``history``).

A prompt is known by a stable hash of its rendered prompt (the same text in every process and
after a resume; two rows with the same prompt share their statistics). Each step folds the
finite rewards of the prompt's samples into its count, mean and sum of squared deviations
(Welford's update, in float64, in the order of the samples) and then reads them, so the
statistics a step reads include its own rewards. Each group with a finite reward is also one
sampling of the prompt: its count of samplings ("steps") goes up by one and the group's Bessel
variance (two-pass, float64, over its finite rewards; 0 for one) joins a running mean of them --
a per-step statistic that the pooled count, mean and M2 do not determine (DCPO's smooth advantage
standardisation reads it, algorithms/examples/dcpo_sas.rl). The run keeps one :class:`PromptStats` on the
driver (``Run.prompt_stats``) only when its spec reads them, and saves it in every checkpoint
(``state_dict``: plain tensors) to restore it exactly.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Sequence

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first


def prompt_key(prompt: Any) -> int:
    """A prompt's key: the first 63 bits of the SHA-256 of its rendered form (``repr``: a text, or
    a messages tuple), the same in every process and every run (Python's ``hash`` is salted)."""
    return int.from_bytes(hashlib.sha256(repr(prompt).encode()).digest()[:8], "little") >> 1


#: the saved columns of a prompt's statistics, in order (state_dict's ``stats`` [N, len(COLUMNS)])
COLUMNS = ("count", "mean", "m2", "steps", "step_var")


class PromptStats:
    """Count, mean and sum of squared deviations (M2) of each prompt's finite rewards so far, and
    the number of its groups (samplings) and the mean of their Bessel variances."""

    def __init__(self) -> None:
        self._stats: dict[int, list[float]] = {}  # key -> COLUMNS, Python floats (float64)

    def __len__(self) -> int:
        return len(self._stats)

    @staticmethod
    def key(prompt: Any) -> int:
        """The key a prompt's statistics are kept under (:func:`prompt_key`)."""
        return prompt_key(prompt)

    def update(self, keys: Sequence[int], rewards: Any) -> None:
        """Fold a step's rewards in: ``rewards`` [P * G] holds the G samples of each of the P
        ``keys`` in turn; a non-finite reward (a failed one) is left out."""
        flat = [float(x) for x in torch.as_tensor(rewards).reshape(-1).tolist()]
        if not keys or len(flat) % len(keys):
            raise ValueError(f"{len(flat)} rewards are not a whole number of groups of {len(keys)} prompts")
        G = len(flat) // len(keys)
        for p, key in enumerate(keys):
            s = self._stats.setdefault(key, [0.0] * len(COLUMNS))
            group = [x for x in flat[p * G:(p + 1) * G] if math.isfinite(x)]
            for x in group:
                s[0] += 1.0
                delta = x - s[1]
                s[1] += delta / s[0]
                s[2] += delta * (x - s[1])
            if group:  # one more sampling of the prompt: its Bessel variance joins the running mean
                s[3] += 1.0
                s[4] += (_bessel_var(group) - s[4]) / s[3]

    def read(self, keys: Sequence[int], group_size: int) -> dict[str, Any]:
        """``prompt_mean``, ``prompt_var`` (M2 / count), ``prompt_count``, ``prompt_steps`` and
        ``prompt_step_var`` [P * G] float32, each prompt's value repeated over its G rows; 0 for a
        prompt with no finite reward yet (and a variance of 0 below two rewards)."""
        rows = [self._stats.get(k, [0.0] * len(COLUMNS)) for k in keys]

        def per_row(v: list[float]) -> Any:
            return torch.tensor(v, dtype=torch.float64).repeat_interleave(group_size).to(torch.float32)
        return {"prompt_mean": per_row([s[1] for s in rows]),
                "prompt_var": per_row([s[2] / s[0] if s[0] > 0 else 0.0 for s in rows]),
                "prompt_count": per_row([s[0] for s in rows]),
                "prompt_steps": per_row([s[3] for s in rows]),
                "prompt_step_var": per_row([s[4] for s in rows])}

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors (``torch.load(weights_only=True)`` reads them): keys [N] int64 and their
        [N, 5] float64 (COLUMNS: count, mean, M2, steps, mean step variance), in the order the
        prompts were first seen."""
        return {"keys": torch.tensor(list(self._stats), dtype=torch.int64),
                "stats": torch.tensor(list(self._stats.values()), dtype=torch.float64).reshape(-1, len(COLUMNS))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` saved, bit for bit. A checkpoint saved before the
        step columns existed ([N, 3]) reads 0 steps: its spec read only the first three."""
        keys, stats = state["keys"].tolist(), state["stats"].tolist()
        self._stats = {int(k): [float(x) for x in s] + [0.0] * (len(COLUMNS) - len(s)) for k, s in zip(keys, stats)}


def _bessel_var(xs: list[float]) -> float:
    """The sample variance of a group's finite rewards (sum of squared deviations / (n - 1), the
    two-pass formula, as ``torch.std`` squared); 0 for a single reward."""
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
