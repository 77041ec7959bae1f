"""Reward functions by name, combined by a weighted spec string.

Spec syntax (``--reward``)::

    spec    := term ("," term)*
    term    := name ["(" option ("," option)* ")"] ["=" weight]     weight: a float, default 1.0
    name    := exact | math | gsm8k | addition | package.module:function | path/to/file.py:function
             | http(s)://HOST:PORT/PATH | judge:URL | rm:PATH      batch terms (below)
    option  := key "=" value            true/false, a number, or a word; passed as a keyword

    "math"                              the math verifier alone
    "math=0.9,mypkg.rewards:fmt=0.1"    0.9 * math + 0.1 * mypkg.rewards.fmt
    "math(allow_truncated=true)"        math, crediting completions cut off at the length limit
    "myreward:digits"                   digits() of myreward.py in the current folder
    "rewards/fmt.py:fmt=0.5"            0.5 * fmt() of that file (relative to the current folder)

The reward of a sample is ``sum_k weight_k * reward_k``. Every reward function has the
signature ``(prompt, completion, answer) -> float``; one that also accepts a
``finish_reason`` keyword (or ``**kwargs``) is given it ("stop" | "length"). ``prompt`` is
the row's original prompt (``Example.reward_prompt``: before the chat template and system
prompt; a messages list as its contents joined by blank lines), not the text the model saw.

Built-ins (docs/rewards.md has the rules and examples):
  exact     1.0 if ``completion.strip() == answer.strip()`` else 0.0
  math      1.0 if the completion's final answer -- its last ``\\boxed{...}``, a GSM8K
            ``#### 42``, an anchored "answer is ..." / "Answer: ...", or a completion that
            is only a number or expression -- equals the answer (exact rationals first,
            then ``math_verify``). A number inside free text is not an answer, and a
            completion cut off at the length limit scores 0.0 (option ``allow_truncated``)
  gsm8k     ``math`` against a GSM8K answer column: the gold answer is the text after
            its last ``####``
  addition  the toy task's: 1.0 only for exactly the answer followed by EOS
            (``completion == answer`` and finish_reason "stop")
  reasoning_gym  a reasoning-gym row's own verifier (``score_answer``, partial credit kept) on
            the answer in the completion's last ``<answer>...</answer>`` (option
            ``answer_format=plain``: the whole completion); rows of ``reasoning_gym:`` data only

Batch terms score all samples of a call at once, concurrently: a reward server
(:mod:`.reward_remote`, served by ``rldsl serve-reward``), an LLM judge behind an
OpenAI-compatible API (:mod:`.reward_remote`), a sequence-classification reward model
(:mod:`.reward_model`). docs/rewards.md has their options and the server protocol.

Errors: a reward function that raises, or returns something that is not a finite
number (values.py ``reward_value``, the one check of every reward value; text is refused),
raises ``RewardError`` naming the reward, the sample index, the prompt and the completion.
With ``on_error="skip"`` the sample gets a NaN reward instead (the trainer masks NaN-reward
samples) and the count is reported in ``RewardResult.num_errors``.
"""
from __future__ import annotations

import functools
import inspect
import math as _math
import re
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable, Literal, Sequence
from urllib.parse import urlsplit

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

from ..batch import Episode, RolloutBatch
from .. import plugins
from ..errors import RewardError, RewardSpecError, RewardTimeout
from .deadline import DeadlinePool
from .remote import JudgeReward, ServerReward
from .values import reward_value
from ..data.reasoning_gym import reasoning_gym_reward

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


# ------------------------------------------------------------------------ the spec
def _short(text: str, n: int = 200) -> str:
    return repr(text if len(text) <= n else text[: n - 3] + "...")


_TERM = re.compile(r"^(?P<base>[^()=]+?)\s*(?:\((?P<options>[^()]*)\))?$")


def _option_value(text: str) -> bool | int | float | str:
    """``true``/``false``, an int, a float, or the word itself."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def split_reward_name(name: str) -> tuple[str, dict[str, bool | int | float | str]]:
    """``"math(allow_truncated=true)"`` -> ``("math", {"allow_truncated": True})``."""
    m = _TERM.match(name.strip())
    if not m:
        raise RewardSpecError(f"reward {name!r}: write options as name(key=value, ...)")
    options: dict[str, bool | int | float | str] = {}
    if m.group("options") is not None:
        for raw in m.group("options").split(","):
            key, eq, value = (x.strip() for x in raw.partition("="))
            if not eq or not key.isidentifier() or not value:
                raise RewardSpecError(f"reward {name!r}: option {raw.strip()!r} is not key=value")
            if key in options:
                raise RewardSpecError(f"reward {name!r}: option {key!r} given twice")
            options[key] = _option_value(value)
    return m.group("base").strip(), options


def _options_of(fn: RewardCallable) -> list[str]:
    """The keyword options a reward function takes (besides the three texts and finish_reason)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p.name for p in params[3:] if p.name != "finish_reason"
            and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def resolve_reward(name: str) -> RewardCallable:
    """A built-in by name, ``package.module:function`` imported (the current folder first on the
    import path), or ``path/to/file.py:function`` loaded from that file; ``name(key=value)``
    binds options. Raises :class:`RewardSpecError` saying why a name cannot be loaded."""
    base, options = split_reward_name(name)
    batch_term = batch_reward(base, options)
    if batch_term is not None:
        return batch_term
    if base in BUILTIN_REWARDS:
        fn = BUILTIN_REWARDS[base]
    elif ":" not in base:
        raise RewardSpecError(
            f"unknown reward {base!r}: use one of {sorted(BUILTIN_REWARDS)}, "
            "'module:function' or 'path/to/file.py:function'"
        )
    else:
        fn = plugins.load_function(base, plugins.REWARD)
    if not options:
        return fn
    known = _options_of(fn)
    for key in options:
        if key not in known:
            raise RewardSpecError(f"reward {base!r} has no option {key!r}; its options: "
                             + (", ".join(known) if known else "none"))
    return functools.partial(fn, **options)


def gives_turn_rewards(name: str) -> str | None:
    """What per-turn rewards the term ``name`` (as a reward spec writes it) gives: ``"turns"``
    for the ``env`` term (each environment step's reward, kept by the episodes), ``"steps"`` for
    a reward model with a ``step_separator`` (a process reward: each step's score), else None."""
    base, options = split_reward_name(name)
    if base == "env":
        return "turns"
    if base.startswith("rm:") and options.get("step_separator") is not None:
        return "steps"
    return None


def batch_reward(base: str, options: dict[str, bool | int | float | str]) -> RewardCallable | None:
    """The batch reward term ``base`` names -- a reward server (``http(s)://...``), an LLM judge
    (``judge:URL``) or a reward model (``rm:PATH``) -- built with ``options``; None for a function."""
    make: Callable[..., RewardCallable]
    if base.startswith(("http://", "https://")):
        make, target = ServerReward, base
    elif base.startswith("judge:"):
        make, target = JudgeReward, base[len("judge:"):]
    elif base.startswith("rm:"):
        from .model import reward_model_term  # torch: imported when a reward model is named

        make, target = reward_model_term, base[len("rm:"):]
    elif base == "env":
        if options:
            raise RewardSpecError("reward 'env' (the environment's reward) takes no options")
        return EnvironmentReward()
    else:
        return None
    known = [p for p in inspect.signature(make).parameters if p not in ("url", "path", "check")]
    unknown = [k for k in options if k not in known]
    if unknown:
        raise RewardSpecError(f"reward {base!r} has no option {unknown[0]!r}; its options: {', '.join(known)}")
    try:
        return make(target, **options)
    except (ValueError, TypeError) as e:  # a bad address, template, folder or option value
        raise RewardSpecError(str(e)) from None


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


def _top_level_split(spec: str) -> list[str]:
    """Split at the commas outside parentheses (``name(a=1, b=2)`` stays one term)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise RewardSpecError(f"reward spec {spec!r}: unbalanced ')'")
        elif ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth:
        raise RewardSpecError(f"reward spec {spec!r}: unclosed '('")
    return parts + [spec[start:]]


def parse_reward_spec(spec: str) -> list[tuple[str, float]]:
    """``"math=0.9,pkg.mod:fn=0.1"`` -> ``[("math", 0.9), ("pkg.mod:fn", 0.1)]``.

    A name keeps its options: ``"math(allow_truncated=true)=2"`` ->
    ``[("math(allow_truncated=true)", 2.0)]``.
    """
    terms: list[tuple[str, float]] = []
    for raw in _top_level_split(spec):
        term = raw.strip()
        if not term:
            raise RewardSpecError(f"reward spec {spec!r}: empty term")
        close = term.rfind(")")  # "=" inside name(key=value) is not the weight's
        name, eq, weight_text = term[close + 1:].partition("=")
        name = (term[:close + 1] + name).strip()
        if not name:
            raise RewardSpecError(f"reward spec {spec!r}: term {term!r} has no reward name")
        try:
            weight = float(weight_text) if eq else 1.0
        except ValueError:
            raise RewardSpecError(f"reward spec {spec!r}: weight {weight_text.strip()!r} of {name!r} is not a number") from None
        if not _math.isfinite(weight):
            raise RewardSpecError(f"reward spec {spec!r}: weight of {name!r} must be finite")
        if name in (n for n, _ in terms):
            raise RewardSpecError(f"reward spec {spec!r}: {name!r} appears twice")
        terms.append((name, weight))
    return terms


def term_labels(names: Sequence[str]) -> dict[str, str]:
    """Each term's short name in metrics (``rewards/<label>/mean``) and samples.jsonl, by the
    term as written: a built-in or a weight name as it is (``math``, ``a``), options dropped
    (``math(allow_truncated=true)`` -> ``math``); ``module:function`` and ``file.py:function``
    -> ``function``; ``http(s)://HOST:PORT/PATH`` -> ``server_HOST``; ``judge:URL`` ->
    ``judge_HOST``; ``rm:PATH`` -> ``rm_<last folder of PATH>``. A label already taken gets
    ``_2``, ``_3``, ... in the spec's order."""
    out: dict[str, str] = {}
    for name in names:
        base, _ = split_reward_name(name)
        if base.startswith("judge:"):
            label = "judge_" + (urlsplit(base[len("judge:"):]).hostname or "")
        elif base.startswith(("http://", "https://")):
            label = "server_" + (urlsplit(base).hostname or "")
        elif base.startswith("rm:"):
            label = "rm_" + (Path(base[len("rm:"):].rstrip("/")).name or "model")
        elif ":" in base:
            label = base.rsplit(":", 1)[1]
        else:
            label = base
        label = label.rstrip("_") or "reward"
        taken, n = label, 2
        while taken in out.values():
            taken, n = f"{label}_{n}", n + 1
        out[name] = taken
    return out


def with_answer_format(spec: str, answer_format: str) -> str:
    """``spec`` with ``answer_format`` given to every ``reasoning_gym`` term that sets none."""
    if answer_format == "tag":
        return spec
    terms = []
    for name, weight in parse_reward_spec(spec):
        if name == "reasoning_gym":
            name = f"reasoning_gym(answer_format={answer_format})"
        terms.append(name if weight == 1.0 else f"{name}={weight:g}")
    return ",".join(terms)


@dataclass
class RewardResult:
    """rewards [B] fp64 (NaN on skipped samples: each value as the verifiers returned it, the
    weighted sum in Python's float arithmetic), each reward's raw values [B] fp64, the failures."""

    rewards: torch.Tensor
    components: dict[str, torch.Tensor]
    num_errors: int
    first_error: str | None = None
    # a process reward term's step scores by term name: per sample [[end, score], ...] (``end`` a
    # character offset into the completion) or None where it failed
    steps: dict[str, list] = field(default_factory=dict)
    num_timeouts: int = 0  # of the samples that failed, those whose call ran past reward.timeout_s

    def labelled_terms(self) -> dict[str, torch.Tensor]:
        """Each reward term's values [B] by its label (``rewards/<label>/...``: :func:`term_labels`)."""
        labels = term_labels(list(self.components))
        return {labels[name]: values for name, values in self.components.items()}

    def error_warning(self, step: int) -> str:
        """The warning of step ``step`` (numbered as metrics.jsonl logs it, from 1) about the samples
        whose reward failed (``reward.on_error=skip``)."""
        return f"step {step}: {self.num_errors} sample(s) skipped (reward failed); first:\n{self.first_error}"


#: A sample counts as correct when its reward is above this: a binary verifier's 1 (every
#: built-in reward is 0 or 1; a weighted sum whose terms are verifiers passes only with its
#: heaviest term right). What the accuracy metrics and every evaluation read.
CORRECT_ABOVE = 0.5


def correct(rewards: torch.Tensor, above: float = CORRECT_ABOVE) -> torch.Tensor:
    """[B] bool: the rewards that count as correct; a failed (NaN) reward never does."""
    return (rewards > above) & torch.isfinite(rewards)


def unscored(B: int) -> RewardResult:
    """The result of samples nobody scored (``Rollouts.generate(score=False)``): NaN rewards."""
    return RewardResult(torch.full((B,), float("nan"), dtype=torch.float64), {}, 0)


class EnvironmentReward:
    """The ``env`` term: the rewards a multi-turn environment gave in each episode, summed (every
    ``StepResult.reward`` that is not None; an agent's return value with ``rollout.agent``), read
    off the batch's episodes (a spec with ``rewards dense`` also gets each step's reward on its
    turn's last token: runtime/train/inputs.py); an agent episode that failed is that sample's error. An episode cut off before the
    environment was done (finish_reason "length": max_turns, max_new_tokens or the context ran
    out) scores 0, as a truncated answer does; one the environment ended without a reward, or a
    single-turn batch, is that sample's error."""

    def __repr__(self) -> str:
        return "EnvironmentReward()"

    def score_episodes(self, episodes: list[Episode], finish_reasons: list[str]) -> list[float | BaseException]:
        B = len(finish_reasons)
        if len(episodes) != B:
            return [ValueError("the 'env' reward needs multi-turn episodes (rollout.tools, rollout.env "
                               "or rollout.agent)")] * B
        out: list[float | BaseException] = []
        for e, finish in zip(episodes, finish_reasons):
            if e.error:  # an agent episode that failed (rollout.agent): reward.on_error decides
                out.append(RuntimeError(e.error))
            elif e.agent is not None and e.env_reward is None:
                out.append(ValueError("the agent returned None: give the episode's reward another way "
                                      "(--reward with terms on the final answer) or return a number"))
            elif e.env_reward is not None:
                out.append(_finite(e.env_reward, "the episode's environment"))
            elif finish == "length":
                out.append(0.0)
            else:
                out.append(ValueError("the environment ended this episode without a reward"))
        return out

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        raise ValueError("the 'env' reward reads the episode's environment reward: it scores batches only")


@dataclass(frozen=True)
class RewardTerm:
    """One weighted reward function of a spec."""

    name: str
    weight: float
    fn: RewardCallable
    takes_finish_reason: bool

    @property
    def batched(self) -> bool:
        """Scores all samples in one call (``score_batch``: reward servers, judges, reward models)."""
        return callable(getattr(self.fn, "score_batch", None))

    def score_batch(self, prompts: list[str], completions: list[str], answers: list[str],
                    finish_reasons: list[str], pool: Executor | None = None) -> list[float | BaseException]:
        """Every sample's value as a finite float, or the exception that sample raised. A
        per-sample function is called from ``pool``'s threads when one is given (one future per
        sample; the values come back in row order)."""
        if self.batched:
            values = self.fn.score_batch(prompts, completions, answers, finish_reasons)
            return [v if isinstance(v, BaseException) else _finite(v, "the batch term") for v in values]
        rows = list(zip(prompts, completions, answers, finish_reasons))
        if pool is not None and len(rows) > 1:
            return [f.result() for f in [pool.submit(self._value_or_error, *r) for r in rows]]
        return [self._value_or_error(*r) for r in rows]

    def _value_or_error(self, prompt: str, completion: str, answer: str,
                        finish_reason: str) -> float | BaseException:
        try:
            return self(prompt, completion, answer, finish_reason)
        except Exception as e:
            return e
        except SystemExit as e:  # user code's sys.exit() is its error, not the run's end
            return exit_error(e)

    def __call__(self, prompt: str, completion: str, answer: str, finish_reason: str) -> float:
        """The function's value as a finite float; anything else raises ``ValueError``."""
        if self.takes_finish_reason:
            value = self.fn(prompt, completion, answer, finish_reason=finish_reason)
        else:
            value = self.fn(prompt, completion, answer)
        number = _finite(value, "the function")
        if isinstance(number, BaseException):
            raise number
        return number


def reward_term(name: str, weight: float = 1.0) -> RewardTerm:
    """The term ``name`` of a reward spec (``math(allow_truncated=true)``, ``mod:fn``), resolved."""
    fn = resolve_reward(name)
    return RewardTerm(name, weight, fn, _accepts_finish_reason(fn))


def exit_error(e: SystemExit) -> RuntimeError:
    """A reward function's ``sys.exit(code)`` as the error of its sample: the reward wrapper's
    and the CLI's ``except Exception`` would let it end the whole command with that code, silently."""
    return RuntimeError(f"the function called sys.exit({e.code!r}); a reward function returns a number")


def _finite(value: object, source: str) -> float | BaseException:
    """``value`` as a finite float (:func:`.values.reward_value`, the one check of a reward value),
    or the ValueError saying it is not one (returned, not raised, for a batch; ``RewardTerm.__call__``
    raises it)."""
    try:
        return reward_value(value, source)
    except ValueError as e:
        return e


class RewardFn:
    """A weighted sum of reward functions, built from a spec string (see the module doc).

    ``timeout_s`` > 0 (``reward.timeout_s``): every per-sample function's call runs in one of
    ``workers`` processes under that wall-clock limit (:mod:`.deadline`); a call past it is that
    sample's :class:`~rldsl.runtime.errors.RewardTimeout`, skipped whatever ``on_error`` says (a completion
    the verifier cannot finish is not a bug to stop the run for) and counted in ``num_timeouts``.
    0: called in this process, from ``workers`` threads, without a limit. The ``IN_PROCESS``
    built-ins and batch terms (their own HTTP timeouts, a model's forward pass) stay in this process.
    """

    def __init__(self, spec: str, *, on_error: Literal["raise", "skip"] = "raise", workers: int = 1,
                 timeout_s: float = 0.0) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not (timeout_s >= 0 and _math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a finite number >= 0, got {timeout_s}")
        self.spec = spec
        self.on_error = on_error
        self.correct_above = CORRECT_ABOVE  # what counts as correct (:func:`correct`)
        self.workers = workers
        self.timeout_s = timeout_s
        self._pool: ThreadPoolExecutor | None = None  # made on first use (workers > 1)
        self._deadline: DeadlinePool | None = None  # made on first use (timeout_s > 0)
        self.terms: list[RewardTerm] = [reward_term(name, weight) for name, weight in parse_reward_spec(spec)]

    def correct(self, rewards: torch.Tensor) -> torch.Tensor:
        """[B] bool: the samples whose reward (of this function) counts as correct."""
        return correct(rewards, self.correct_above)

    def score(self, batch: RolloutBatch, prompts: list[str] | None = None) -> RewardResult:
        """Score every sample of ``batch`` (completions, answers, finish_reason). ``prompts``:
        the B prompts the functions receive -- the rows' original prompts
        (``Example.reward_prompt``); default ``batch.prompts``, the text the engine was fed."""
        B = len(batch.completions)
        if len(batch.answers) != B:
            raise ValueError(
                f"batch has {B} completions but {len(batch.answers)} answers: set "
                'RolloutBatch.answers to the reference answers ("" for tasks without one)'
            )
        prompts = batch.prompts if prompts is None else prompts
        if len(prompts) != B:
            raise ValueError(f"batch has {B} completions but {len(prompts)} reward prompts")
        # float64: a verifier's value as it returned it (0.2 stays 0.2 in samples.jsonl and the
        # metrics); the trainer takes the rewards as float32 (Trainer.estimate)
        total = torch.zeros(B, dtype=torch.float64)  # [B]
        components: dict[str, torch.Tensor] = {}
        errors: list[str] = []
        timeouts: set[int] = set()  # the samples some term's call timed out on
        steps: dict[str, list] = {}
        for term in self.terms:
            # a batch term (server, judge, reward model) gets all B samples in one call
            if isinstance(term.fn, EnvironmentReward):
                scores = term.fn.score_episodes(batch.episodes, list(batch.finish_reason))
            elif getattr(term.fn, "step_separator", None) is not None:  # a process reward: step scores, summed
                detail = term.fn.score_steps(list(prompts), list(batch.completions), list(batch.answers),
                                             list(batch.finish_reason))
                steps[term.name] = [None if isinstance(d, BaseException) else d for d in detail]
                scores = [d if isinstance(d, BaseException) else _finite(sum(v for _, v in d), "its steps' sum")
                          for d in detail]
            else:
                scores = self.term_scores(term, list(prompts), list(batch.completions), list(batch.answers),
                                          list(batch.finish_reason))
            row_values: list[float] = []  # one tensor built from them, not B element writes
            for i, score in enumerate(scores):
                if isinstance(score, BaseException):
                    message = (
                        f"reward {term.name!r} failed on sample {i}: {type(score).__name__}: {score}\n"
                        f"  prompt:     {_short(prompts[i])}\n"
                        f"  completion: {_short(batch.completions[i])}"
                    )
                    timed_out = isinstance(score, RewardTimeout)  # skipped in either mode (class doc)
                    if self.on_error == "raise" and not timed_out:
                        raise RewardError(message) from score
                    errors.append(message)
                    if timed_out:
                        timeouts.add(i)
                    row_values.append(float("nan"))
                else:
                    row_values.append(float(score))
            values = torch.tensor(row_values, dtype=torch.float64)  # [B]
            components[term.name] = values
            total += term.weight * values
        num_errors = int(torch.isnan(total).sum())
        return RewardResult(total, components, num_errors, errors[0] if errors else None, steps, len(timeouts))

    def term_scores(self, term: RewardTerm, prompts: list[str], completions: list[str], answers: list[str],
                    finish_reasons: list[str]) -> list[float | BaseException]:
        """One term's value (or error) for each sample: a per-sample function under ``timeout_s``
        in the worker processes, else as :meth:`RewardTerm.score_batch` calls it."""
        if self.timeout_s > 0 and self._limited(term):
            timed = [t.name for t in self.terms if self._limited(t)]
            if self._deadline is None:
                self._deadline = DeadlinePool(timed, workers=self.workers, timeout_s=self.timeout_s)
            return self._deadline.run(timed.index(term.name), list(zip(prompts, completions, answers, finish_reasons)))
        return term.score_batch(prompts, completions, answers, finish_reasons, self._threads())

    @staticmethod
    def _limited(term: RewardTerm) -> bool:
        """A per-sample function that could run long (``timeout_s`` applies to it)."""
        return (not term.batched and not isinstance(term.fn, EnvironmentReward)
                and getattr(term.fn, "func", term.fn) not in IN_PROCESS)  # a partial: options bound

    def _threads(self) -> ThreadPoolExecutor | None:
        if self.workers > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="reward")
        return self._pool

    def __getstate__(self) -> dict:  # shipped to Ray workers without the threads
        return {**self.__dict__, "_pool": None, "_deadline": None}

    def __call__(self, batch: RolloutBatch) -> torch.Tensor:
        """[B] fp64 rewards (NaN where a reward failed and ``on_error="skip"``)."""
        return self.score(batch).rewards

    def __repr__(self) -> str:
        return f"RewardFn({self.spec!r}, on_error={self.on_error!r})"
