"""Reward functions by name, combined by a weighted spec string.

Spec syntax (``--reward``)::

    spec  := term ("," term)*
    term  := name ["=" weight]          weight: a float, default 1.0
    name  := exact | math | gsm8k | addition | package.module:function

    "math"                              the math verifier alone
    "math=0.9,mypkg.rewards:fmt=0.1"    0.9 * math + 0.1 * mypkg.rewards.fmt

The reward of a sample is ``sum_k weight_k * reward_k``. Every reward function has the
signature ``(prompt, completion, answer) -> float``; one that also accepts a
``finish_reason`` keyword (or ``**kwargs``) is given it ("stop" | "length").

Built-ins:
  exact     1.0 if ``completion.strip() == answer.strip()`` else 0.0
  math      the final ``\\boxed{...}`` of the completion, else its last number, checked
            against the answer with ``math_verify`` (plain numbers compared directly
            first); anything unparsable scores 0.0
  gsm8k     GSM8K rows: the reference answer is the text after the last ``####`` of the
            ``answer`` field (the whole field when it has none); the completion's answer is
            its last ``#### x``, else what ``math`` extracts; compared as ``math`` does
  addition  the toy task's: 1.0 only for exactly the answer followed by EOS
            (``completion == answer`` and finish_reason "stop")

Errors: a reward function that raises, or returns something that is not a finite
number, raises ``RewardError`` naming the reward, the sample index, the prompt and the
completion. With ``on_error="skip"`` the sample gets a NaN reward instead (the trainer
masks NaN-reward samples) and the count is reported in ``RewardResult.num_errors``.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import math as _math
import re
import threading
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from .batch import RolloutBatch
from .errors import RewardError

RewardCallable = Callable[..., float]


# ------------------------------------------------------------------------ built-ins
def exact_reward(prompt: str, completion: str, answer: str, *, finish_reason: str = "stop") -> float:
    """1.0 if the stripped completion equals the stripped answer."""
    return float(completion.strip() == answer.strip())


def addition_reward(prompt: str, completion: str, answer: str, *, finish_reason: str = "stop") -> float:
    """1.0 only for exactly the answer followed by EOS (the toy task)."""
    return float(finish_reason == "stop" and completion == answer)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: the answer was cut off


def extract_final_answer(completion: str) -> str | None:
    r"""The final ``\boxed{}`` content, else the last number in the text, else None."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    t = text.strip().replace(",", "")
    if t.startswith("$") and t.endswith("$") and len(t) > 1:
        t = t[1:-1].strip()
    try:
        return float(t)
    except ValueError:
        return None


def _timeout() -> int | None:
    # math_verify's timeouts use SIGALRM, which only the main thread may set
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple:
    import math_verify

    text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    return tuple(math_verify.parse(text, parsing_timeout=_timeout()))


def math_reward(prompt: str, completion: str, answer: str, *, finish_reason: str = "stop") -> float:
    r"""1.0 if the final ``\boxed{}`` (or last number) of the completion equals the answer."""
    predicted = extract_final_answer(completion)
    if predicted is None:
        return 0.0
    if predicted == answer.strip():
        return 1.0
    a, b = _as_number(predicted), _as_number(answer)
    if a is not None and b is not None:  # fast path: two plain numbers
        return float(abs(a - b) <= 1e-9 * max(1.0, abs(b)))
    import math_verify

    gold = _parse_gold(answer.strip())
    if not gold:
        return 0.0
    target = math_verify.parse(f"${predicted}$", parsing_timeout=_timeout())
    if not target:
        return 0.0
    return float(math_verify.verify(list(gold), target, timeout_seconds=_timeout()))


def final_after_hashes(text: str) -> str | None:
    """The text after the last ``####`` (GSM8K's final-answer marker), stripped; None without one."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else ""


def gsm8k_reward(prompt: str, completion: str, answer: str, *, finish_reason: str = "stop") -> float:
    """1.0 if the completion's final answer equals the number after the answer's ``####``."""
    gold = final_after_hashes(answer)
    gold = answer.strip() if gold is None else gold.replace(",", "")
    if not gold:
        return 0.0
    predicted = final_after_hashes(completion)
    if predicted:
        completion = f"\\boxed{{{predicted}}}"
    return math_reward(prompt, completion, gold, finish_reason=finish_reason)


BUILTIN_REWARDS: dict[str, RewardCallable] = {
    "gsm8k": gsm8k_reward,
    "exact": exact_reward,
    "math": math_reward,
    "addition": addition_reward,
}


# ------------------------------------------------------------------------ the spec
def _short(text: str, n: int = 200) -> str:
    return repr(text if len(text) <= n else text[: n - 3] + "...")


def resolve_reward(name: str) -> RewardCallable:
    """A built-in by name, or ``package.module:function`` imported."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if ":" not in name:
        raise ValueError(
            f"unknown reward {name!r}: use one of {sorted(BUILTIN_REWARDS)} "
            "or 'package.module:function'"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: module {module_name!r} has no function {attr!r}")
    return fn


def _accepts_finish_reason(fn: RewardCallable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "finish_reason" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in params
    )


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """``"math=0.9,pkg.mod:fn=0.1"`` -> ``[("math", 0.9), ("pkg.mod:fn", 0.1)]``."""
    terms: list[tuple[str, float]] = []
    for raw in spec.split(","):
        term = raw.strip()
        if not term:
            raise ValueError(f"reward spec {spec!r}: empty term")
        name, eq, weight_text = term.partition("=")
        name = name.strip()
        if not name:
            raise ValueError(f"reward spec {spec!r}: term {term!r} has no reward name")
        try:
            weight = float(weight_text) if eq else 1.0
        except ValueError:
            raise ValueError(f"reward spec {spec!r}: weight {weight_text.strip()!r} of {name!r} is not a number") from None
        if not _math.isfinite(weight):
            raise ValueError(f"reward spec {spec!r}: weight of {name!r} must be finite")
        if name in (n for n, _ in terms):
            raise ValueError(f"reward spec {spec!r}: {name!r} appears twice")
        terms.append((name, weight))
    return terms


@dataclass
class RewardResult:
    """rewards [B] fp32 (NaN on skipped samples), each reward's raw values [B], the failures."""

    rewards: torch.Tensor
    components: dict[str, torch.Tensor]
    num_errors: int
    first_error: str | None = None


@dataclass(frozen=True)
class RewardTerm:
    """One weighted reward function of a spec."""

    name: str
    weight: float
    fn: RewardCallable
    takes_finish_reason: bool

    def __call__(self, prompt: str, completion: str, answer: str, finish_reason: str) -> float:
        """The function's value as a finite float; anything else raises ``ValueError``."""
        if self.takes_finish_reason:
            value = self.fn(prompt, completion, answer, finish_reason=finish_reason)
        else:
            value = self.fn(prompt, completion, answer)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"returned {value!r}, not a number") from None
        if not _math.isfinite(value):
            raise ValueError(f"returned a non-finite value {value}")
        return value


class RewardFn:
    """A weighted sum of reward functions, built from a spec string (see the module doc)."""

    def __init__(self, spec: str, *, on_error: Literal["raise", "skip"] = "raise") -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.spec = spec
        self.on_error = on_error
        self.terms: list[RewardTerm] = []
        for name, weight in parse_reward_spec(spec):
            fn = resolve_reward(name)
            self.terms.append(RewardTerm(name, weight, fn, _accepts_finish_reason(fn)))

    def score(self, batch: RolloutBatch) -> RewardResult:
        """Score every sample of ``batch`` (uses prompts, completions, answers, finish_reason)."""
        B = len(batch.completions)
        if len(batch.answers) != B:
            raise ValueError(
                f"batch has {B} completions but {len(batch.answers)} answers: set "
                'RolloutBatch.answers to the reference answers ("" for tasks without one)'
            )
        total = torch.zeros(B, dtype=torch.float32)  # [B]
        components: dict[str, torch.Tensor] = {}
        errors: list[str] = []
        for term in self.terms:
            values = torch.empty(B, dtype=torch.float32)  # [B]
            for i in range(B):
                prompt, completion = batch.prompts[i], batch.completions[i]
                try:
                    values[i] = term(prompt, completion, batch.answers[i], batch.finish_reason[i])
                except Exception as e:
                    message = (
                        f"reward {term.name!r} failed on sample {i}: {type(e).__name__}: {e}\n"
                        f"  prompt:     {_short(prompt)}\n"
                        f"  completion: {_short(completion)}"
                    )
                    if self.on_error == "raise":
                        raise RewardError(message) from e
                    errors.append(message)
                    values[i] = float("nan")
            components[term.name] = values
            total += term.weight * values
        num_errors = int(torch.isnan(total).sum())
        return RewardResult(total, components, num_errors, errors[0] if errors else None)

    def __call__(self, batch: RolloutBatch) -> torch.Tensor:
        """[B] fp32 rewards (NaN where a reward failed and ``on_error="skip"``)."""
        return self.score(batch).rewards

    def __repr__(self) -> str:
        return f"RewardFn({self.spec!r}, on_error={self.on_error!r})"
