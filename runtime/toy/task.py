"""The built-in task: 2-digit addition ``"a+b="`` -> the sum, and the carry-dropping teacher
whose answers the warm start learns (docs/toy.md)."""
from __future__ import annotations

import random
from dataclasses import dataclass

from ..data import Example, PromptSource


@dataclass(frozen=True)
class AdditionTask:
    """``"a+b="`` -> ``str(a + b)`` for a, b in [low, high]; ``num_heldout`` pairs held out."""

    low: int = 10
    high: int = 99
    num_heldout: int = 200
    heldout_seed: int = 1234

    def __post_init__(self) -> None:
        n = (self.high - self.low + 1) ** 2
        if not 0 <= self.low <= self.high or not 0 < self.num_heldout < n:
            raise ValueError(f"bad AdditionTask {self}: need 0 <= low <= high and 0 < num_heldout < {n}")

    def pairs(self, heldout: bool) -> list[tuple[int, tuple[int, int]]]:
        """(id, (a, b)) of the training (or held-out) pairs; id = row-major index of the pair."""
        r = range(self.low, self.high + 1)
        every = [(a, b) for a in r for b in r]
        chosen = set(random.Random(self.heldout_seed).sample(range(len(every)), self.num_heldout))
        return [(i, ab) for i, ab in enumerate(every) if (i in chosen) == heldout]

    def _examples(self, heldout: bool) -> list[Example]:
        return [Example(id=i, prompt=f"{a}+{b}=", answer=str(a + b)) for i, (a, b) in self.pairs(heldout)]

    def train_examples(self) -> list[Example]:
        """Every pair not held out; ``Example.id`` = index of the pair in row-major order."""
        return self._examples(heldout=False)

    def heldout_examples(self) -> list[Example]:
        """The fixed held-out pairs (never trained on)."""
        return self._examples(heldout=True)

    def prompt_source(self, seed: int) -> PromptSource:
        """Training prompts as a ``PromptSource`` (shuffled per epoch from ``seed``)."""
        return PromptSource(self.train_examples(), seed=seed, name="toy-addition")


def carry_free_sum(a: int, b: int) -> str:
    """The digit-wise sum with every carry dropped, e.g. 58+67 -> "15" (the teacher's mode)."""
    return teacher_answer(a, b, drop_carry=1.0, rng=random.Random(0))


def teacher_answer(a: int, b: int, *, drop_carry: float, rng: random.Random) -> str:
    """Column addition of a + b where each carry is dropped with probability ``drop_carry``."""
    digits: list[int] = []
    carry = 0
    while a or b or carry:
        s = a % 10 + b % 10 + carry
        digits.append(s % 10)
        carry = s // 10 if rng.random() >= drop_carry else 0
        a, b = a // 10, b // 10
    return "".join(map(str, reversed(digits))) or "0"
