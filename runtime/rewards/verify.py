"""The verifier: the built-in rewards by name (:data:`BUILTIN_REWARDS`) and what they check --
exact text, the toy task's answer-then-EOS, and a math completion's final answer (its last
``\\boxed{...}``, a GSM8K ``#### 42``, an anchored "answer is ...", or a completion that is only a
number or expression) against the reference, exact rationals first, then ``math_verify``; a
reasoning-gym row's own verifier (data/reasoning_gym.py). docs/rewards.md has the rules and
examples; the reward-spec language that names them is spec.py, the weighted sum functions.py.
"""
from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from ..data.reasoning_gym import reasoning_gym_reward

#: A reward function: ``(prompt, completion, answer[, finish_reason=..., **options]) -> float``
RewardCallable = Callable[..., float]


# ------------------------------------------------------------------------ built-ins
def exact_reward(prompt: str, completion: str, answer: str, *, finish_reason: str = "stop") -> float:
    """1.0 if the stripped completion equals the stripped answer."""
    return float(completion.strip() == answer.strip())


def addition_reward(prompt: str, completion: str, answer: str, *, finish_reason: str = "stop") -> float:
    """1.0 only for exactly the answer followed by EOS (the toy task)."""
    return float(finish_reason == "stop" and completion == answer)


# ------------------------------------------------------------------------ math answers
# What counts as the answer a completion gives (docs/rewards.md), in order:
#   1. the last \boxed{...} (or \fbox{...}), braces balanced -- verl's math scorers;
#      an unclosed last box (cut off) gives no answer
#   2. GSM8K's "#### 42": the rest of the line after the last "####"
#   3. an anchored final answer, the last of "final answer is/:", "answer is", "answer:"
#      (case-insensitive) -- TRL's accuracy reward takes only anchored answers
#   4. a completion that is nothing but a number or a math expression ("42", "\frac{2}{3}")
# A number elsewhere in free text is never the answer.
_ANCHOR = re.compile(r"\b(?:final\s+answer|answer)\s*(?:is\b\s*:?|:)", re.IGNORECASE)
_EQUALS = re.compile(r"(?<![<>!=:])=(?!=)")  # "=", not "<=", ">=", "!=", "=="
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")  # a word, not a LaTeX command's name
_SENTENCE_END = re.compile(r"(?<=\S)[.;!?](?=\s|$)|,\s+(?=[A-Za-z]{2})")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_FRACTION = re.compile(r"([-+]?)\s*(?:\\[dt]?frac\{\s*(\d+)\s*\}\{\s*(\d+)\s*\}|(\d+)\s*/\s*(\d+))")


@dataclass(frozen=True)
class Extraction:
    """The answer a completion gives (``text`` None: it gives none) and the rule that found it."""

    text: str | None
    rule: str


def _last_box(text: str) -> tuple[bool, str | None]:
    r"""(whether there is a ``\boxed{``/``\fbox{``, the content of the last one or None if unclosed)."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return False, None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return True, text[i:j]
    return True, None


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced; None if absent or unclosed."""
    return _last_box(text)[1]


def _unwrap(text: str) -> str:
    r"""Strip markdown bold, ``$...$`` / ``\(...\)`` / ``\[...\]`` delimiters and a final period."""
    t = text.strip().rstrip(".").strip().strip("*").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if t.startswith(left) and t.endswith(right) and len(t) >= len(left) + len(right):
            t = t[len(left): len(t) - len(right)].strip()
            break
    t = t.rstrip(".").strip()
    return t


def _is_math(text: str) -> bool:
    """A number or expression alone: one line, no words (LaTeX commands and single letters are fine)."""
    return bool(text) and "\n" not in text and not _WORD.search(text)


def _value_part(text: str) -> str:
    """The right-hand side of ``x = 5`` (the last ``=``); the text itself otherwise."""
    parts = _EQUALS.split(text)
    return parts[-1].strip() if len(parts) > 1 and parts[-1].strip() else text


def _anchored(rest: str) -> str | None:
    """The answer right after an anchor: delimited math, or the line up to the sentence's end."""
    rest = rest.lstrip(" \t:*")
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if rest.startswith(left):
            end = rest.find(right, len(left))
            if end > 0:
                return rest[len(left):end].strip() or None
    line = rest.split("\n", 1)[0]
    cut = _SENTENCE_END.search(line)
    text = _unwrap(line[: cut.start()] if cut else line)
    words = text.split()
    while words and not _is_math(" ".join(words)):  # "17 apples" -> "17"
        words.pop()
    return " ".join(words) or None


def find_final_answer(completion: str) -> Extraction:
    """The final answer of a completion by the rules above (``text`` None when there is none)."""
    has_box, boxed = _last_box(completion)
    if has_box:
        if boxed is None:
            return Extraction(None, "the last \\boxed{ is not closed (cut off)")
        return Extraction(boxed.strip(), "\\boxed{}")
    if "####" in completion:
        line = completion.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        text = _unwrap(line)
        return Extraction(text or None, "'####'" if text else "'####' with nothing after it")
    anchors = list(_ANCHOR.finditer(completion))
    if anchors:
        last = anchors[-1]
        text = _anchored(completion[last.end():])
        if text is not None:
            return Extraction(_value_part(text), f"anchored ({last.group(0).strip()!r})")
        return Extraction(None, f"nothing math-like after the anchor {last.group(0).strip()!r}")
    whole = _unwrap(completion)
    if _is_math(whole):
        return Extraction(_value_part(whole), "the whole completion")
    return Extraction(None, "no \\boxed{}, '####', 'answer is' / 'Answer:' or bare final answer "
                            "(a number inside free text is not taken as the answer)")


def extract_final_answer(completion: str) -> str | None:
    """The final answer of a completion (``find_final_answer(...).text``)."""
    return find_final_answer(completion).text


def _as_rational(text: str) -> Fraction | None:
    r"""An exact rational from ``42``, ``-3.5``, ``1,000`` (thousands), ``2/3``, ``\frac{2}{3}``; else None."""
    t = _unwrap(text).replace(" ", "").replace("{,}", ",")
    if _THOUSANDS.fullmatch(t):
        t = t.replace(",", "")
    if _DECIMAL.fullmatch(t):
        return Fraction(t)
    m = _FRACTION.fullmatch(t)
    if m:
        num, den = (m.group(2), m.group(3)) if m.group(2) is not None else (m.group(4), m.group(5))
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
        return -value if m.group(1) == "-" else value
    return None


def _timeout() -> int | None:
    # math_verify's timeouts use SIGALRM, which only the main thread may set
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple:
    import math_verify

    text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    return tuple(math_verify.parse(text, parsing_timeout=_timeout()))


def equivalent(predicted: str, gold: str) -> tuple[bool, str]:
    """Whether two answers are the same, and how that was decided.

    Same text; else two plain rationals compared exactly (``0.5 == 1/2 == \\frac{1}{2}``,
    ``1,000 == 1000``; ``1,2`` is a list, not a number); else ``math_verify`` (sympy
    equivalence of the parsed expressions, sets, intervals); an unparsable gold answer
    matches only its own text.
    """
    p, g = predicted.strip(), gold.strip()
    if p == g:
        return True, "the same text"
    a, b = _as_rational(p), _as_rational(g)
    if a is not None and b is not None:
        return a == b, "equal numbers" if a == b else "different numbers"
    import math_verify

    gold_parsed = _parse_gold(g)
    if not gold_parsed:
        return False, "the gold answer cannot be parsed and the texts differ"
    pred_parsed = math_verify.parse(f"${p}$", parsing_timeout=_timeout())
    if not pred_parsed:
        return False, "the answer cannot be parsed as math"
    same = bool(math_verify.verify(list(gold_parsed), pred_parsed, timeout_seconds=_timeout()))
    return same, "math_verify: equivalent" if same else "math_verify: not equivalent"


@dataclass(frozen=True)
class Verdict:
    """A math verifier's reward with its reasons (what ``rldsl reward`` prints)."""

    reward: float
    extracted: str | None  # the completion's final answer
    rule: str              # the rule that found it (or why there is none)
    gold: str              # the reference answer compared against
    why: str               # why the reward is what it is


def gsm8k_gold(answer: str) -> str:
    """GSM8K's reference answer: the text after the last ``####`` (the whole answer without one)."""
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


def judge_math(completion: str, answer: str, *, finish_reason: str = "stop",
               allow_truncated: bool = False) -> Verdict:
    """The ``math`` verdict: the completion's final answer checked against ``answer``.

    A completion cut off at the length limit (``finish_reason == "length"``) gets no credit
    unless ``allow_truncated``: its last number is a step of unfinished reasoning, not an answer.
    """
    found = find_final_answer(completion)
    gold = answer.strip()
    if finish_reason == "length" and not allow_truncated:
        return Verdict(0.0, found.text, found.rule, gold,
                       "cut off at the length limit (finish_reason=length): no credit")
    if found.text is None:
        return Verdict(0.0, None, found.rule, gold, "no final answer")
    same, how = equivalent(found.text, gold)
    return Verdict(float(same), found.text, found.rule, gold, how)


def judge_gsm8k(completion: str, answer: str, *, finish_reason: str = "stop",
                allow_truncated: bool = False) -> Verdict:
    """The ``gsm8k`` verdict: ``judge_math`` against the number after the answer's ``####``."""
    return judge_math(completion, gsm8k_gold(answer), finish_reason=finish_reason,
                      allow_truncated=allow_truncated)


def math_reward(prompt: str, completion: str, answer: str, *, finish_reason: str = "stop",
                allow_truncated: bool = False) -> float:
    r"""1.0 if the completion's final answer (``\boxed{}``, ``####``, anchored, or alone) equals ``answer``."""
    return judge_math(completion, answer, finish_reason=finish_reason,
                      allow_truncated=allow_truncated).reward


def gsm8k_reward(prompt: str, completion: str, answer: str, *, finish_reason: str = "stop",
                 allow_truncated: bool = False) -> float:
    """``math`` against a GSM8K answer column (``... #### 42``: the gold answer is 42)."""
    return judge_gsm8k(completion, answer, finish_reason=finish_reason,
                       allow_truncated=allow_truncated).reward


BUILTIN_REWARDS: dict[str, RewardCallable] = {
    "exact": exact_reward,
    "math": math_reward,
    "gsm8k": gsm8k_reward,
    "addition": addition_reward,
    "reasoning_gym": reasoning_gym_reward,
}

#: built-ins called in the run's own process even with ``reward.timeout_s``: ``exact`` and
#: ``addition`` are one string comparison, linear in the text (nothing to stop); ``reasoning_gym``
#: scores against the rows the run generated, which live in the run's process (data/reasoning_gym.py)
IN_PROCESS: tuple[RewardCallable, ...] = (exact_reward, addition_reward, reasoning_gym_reward)

# the built-ins that can say why (``rldsl reward`` prints their verdict)
VERDICTS: dict[str, Callable[..., Verdict]] = {"math": judge_math, "gsm8k": judge_gsm8k}
