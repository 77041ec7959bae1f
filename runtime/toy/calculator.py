"""The tool-use task: sums of three 2-digit numbers ``"a+b+c="``, which the tiny model does not
add reliably alone, and the ``calculator`` tool that does (docs/tool_use.md).

``SumTask`` follows ``AdditionTask``'s conventions: a fixed held-out split that no training
prompt reorders, a validation slice of the training prompts for the warm start. ``calculator``
evaluates ``+`` and ``-`` of integers and nothing else (no ``eval``). ``teacher_trace`` writes
the warm start's conversations: well-formed calls whose expression is often wrong and final
answers that often ignore the result (toy/tool_warmup.py).
"""
from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass

from ..data.datasets import Example, PromptSource


_EXPRESSION = re.compile(r"\s*[+-]?\s*\d+(?:\s*[+-]\s*\d+)*\s*")
_TERM = re.compile(r"([+-]?)\s*(\d+)")
MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 30


def calculator(expression: str) -> str:
    """Add and subtract integers.

    Args:
        expression: Integers joined by + and -, e.g. "12+34-5".

    Returns:
        The value of the expression, e.g. "41".
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    if not _EXPRESSION.fullmatch(expression):
        raise ValueError(f"not a sum of integers: {expression!r} (only digits, + and - are allowed)")
    total = 0
    for sign, digits in _TERM.findall(expression.replace(" ", "")):
        if len(digits) > MAX_DIGITS:
            raise ValueError(f"a number longer than {MAX_DIGITS} digits")
        total += -int(digits) if sign == "-" else int(digits)
    return str(total)


#: The tool's name, as the model calls it and the chat template lists it: its function's.
TOOL_NAME = calculator.__name__


@dataclass(frozen=True)
class SumTask:
    """``"a+b+c="`` -> ``str(a + b + c)`` for a, b, c in [low, high].

    The split is by the multiset {a, b, c}: every reordering of a held-out prompt is held out
    too. The held-out prompts are the orderings of multisets drawn in a seeded order until
    exactly ``num_heldout``; the training prompts are ``num_train`` ordered triples drawn
    (seeded) from the rest, ``num_validation`` of them are the warm start's validation slice
    (which RL trains on, like AdditionTask's).
    """

    low: int = 10
    high: int = 99
    terms: int = 3
    num_heldout: int = 200
    num_train: int = 20000
    num_validation: int = 200
    heldout_seed: int = 1234

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high or self.terms < 2:
            raise ValueError(f"bad SumTask {self}: need 0 <= low <= high and terms >= 2")
        if not 0 < self.num_heldout or not 0 <= self.num_validation < self.num_train:
            raise ValueError(f"bad SumTask {self}: need num_heldout > 0, 0 <= num_validation < num_train")

    @staticmethod
    def key(numbers: tuple[int, ...]) -> tuple[int, ...]:
        """The multiset of a prompt's numbers (what the split is by)."""
        return tuple(sorted(numbers))

    @staticmethod
    def prompt(numbers: tuple[int, ...]) -> str:
        return "+".join(map(str, numbers)) + "="

    def _example(self, numbers: tuple[int, ...]) -> Example:
        r = self.high - self.low + 1
        idx = 0
        for x in numbers:  # the row-major index of the ordered tuple
            idx = idx * r + (x - self.low)
        return Example(id=idx, prompt=self.prompt(numbers), answer=str(sum(numbers)))

    @functools.cached_property
    def _split(self) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """(held-out ordered tuples, training ordered tuples)."""
        rng = random.Random(self.heldout_seed)
        held: list[tuple[int, ...]] = []
        held_keys: set[tuple[int, ...]] = set()
        while len(held) < self.num_heldout:
            key = self.key(tuple(rng.randint(self.low, self.high) for _ in range(self.terms)))
            if key in held_keys:
                continue
            orders = sorted(set(_permutations(key)))
            if len(held) + len(orders) > self.num_heldout:
                continue  # keep the count exact: a multiset with fewer orderings will fit
            held_keys.add(key)
            held.extend(orders)
        space = (self.high - self.low + 1) ** self.terms
        if self.num_train > space - len(held):
            raise ValueError(f"bad SumTask {self}: only {space - len(held)} training prompts exist")
        train: list[tuple[int, ...]] = []
        seen: set[tuple[int, ...]] = set()
        rng = random.Random(self.heldout_seed + 1)
        while len(train) < self.num_train:
            t = tuple(rng.randint(self.low, self.high) for _ in range(self.terms))
            if t in seen or self.key(t) in held_keys:
                continue
            seen.add(t)
            train.append(t)
        return held, train

    def train_examples(self) -> list[Example]:
        """The training prompts (``num_train``, none a reordering of a held-out one)."""
        return [self._example(t) for t in self._split[1]]

    def validation_examples(self) -> list[Example]:
        """The warm start's validation slice: the first ``num_validation`` training prompts."""
        return self.train_examples()[: self.num_validation]

    def heldout_examples(self) -> list[Example]:
        """The fixed held-out prompts (never trained on)."""
        return [self._example(t) for t in self._split[0]]

    def prompt_source(self, seed: int) -> PromptSource:
        """Training prompts as a ``PromptSource`` (shuffled per epoch from ``seed``)."""
        return PromptSource(self.train_examples(), seed=seed, name="toy-calculator")


def _permutations(key: tuple[int, ...]) -> list[tuple[int, ...]]:
    if len(key) <= 1:
        return [key]
    return [(key[i], *rest) for i in range(len(key)) for rest in _permutations(key[:i] + key[i + 1:])]


def carry_free(numbers: tuple[int, ...]) -> str:
    """The column sum with every carry dropped, e.g. 58+67+9 -> "14" (a wrong direct answer)."""
    width = max(len(str(x)) for x in numbers)
    digits = [sum((x // 10 ** k) % 10 for x in numbers) % 10 for k in range(width)]
    return str(int("".join(map(str, reversed(digits)))))


# ----------------------------------------------------------------------------- the warm start's traces

@dataclass(frozen=True)
class TeacherMix:
    """The warm start's teacher (toy/tool_warmup.py): how often it calls the tool, how often
    its expression is right, how often its final answer copies the tool's result."""

    call: float = 0.8  # else it answers directly, with the carry-free sum
    right_expression: float = 0.2  # else it drops the last term or swaps the digits of one number
    drop_term: float = 0.9  # of the wrong expressions: the last term dropped (else digits swapped)
    copy_result: float = 0.3  # else its final answer is the carry-free sum of the prompt

    # The numbers make the greedy (most likely) episode wrong by a wide margin -- after "a+b"
    # ending the expression (0.72) beats going on (0.28) -- while a few percent of sampled
    # episodes are right, so some groups of 8 hold a correct one for RL to reinforce.


def corrupt(numbers: tuple[int, ...], rng: random.Random, drop_term: float = 0.8) -> str:
    """A well-formed but wrong expression for ``numbers``: the last term dropped (with
    probability ``drop_term``) or one number's digits swapped (when that changes it)."""
    if rng.random() < drop_term:
        return "+".join(map(str, numbers[:-1]))
    i = rng.randrange(len(numbers))
    swapped = [str(x) for x in numbers]
    if swapped[i][::-1] == swapped[i] or swapped[i][-1] == "0":
        return "+".join(map(str, numbers[:-1]))
    swapped[i] = swapped[i][::-1]
    return "+".join(swapped)


def teacher_trace(numbers: tuple[int, ...], mix: TeacherMix, rng: random.Random) -> list[dict]:
    """One warm-start conversation for the prompt of ``numbers`` (after the user message):
    an assistant message with a Hermes call, the tool's answer and a final assistant answer;
    or a direct answer."""
    if rng.random() >= mix.call:
        return [{"role": "assistant", "content": carry_free(numbers)}]
    right = "+".join(map(str, numbers))
    expression = right if rng.random() < mix.right_expression else corrupt(numbers, rng, mix.drop_term)
    result = calculator(expression)
    final = result if rng.random() < mix.copy_result else carry_free(numbers)
    return [{"role": "assistant", "content": hermes_call(TOOL_NAME, {"expression": expression})},
            {"role": "tool", "name": TOOL_NAME, "content": result},
            {"role": "assistant", "content": final}]


def hermes_call(name: str, arguments: dict) -> str:
    """A Hermes/Qwen tool call as the model writes it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
