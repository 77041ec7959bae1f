"""The reward-spec language (``--reward``, ``reward.name``): a spec string parsed into weighted
terms, each term's name resolved to a function (a built-in of verify.py, user code through
plugins.py, or a batch term: a reward server, an LLM judge, a reward model, the environment's
``env``), its options bound, and its label in metrics.

Spec syntax::

    spec    := term ("," term)*
    term    := name ["(" option ("," option)* ")"] ["=" weight]     weight: a float, default 1.0
    name    := exact | math | gsm8k | addition | reasoning_gym | package.module:function
             | path/to/file.py:function | http(s)://HOST:PORT/PATH | judge:URL | rm:PATH | env
    option  := key "=" value            true/false, a number, or a word; passed as a keyword

    "math"                              the math verifier alone
    "math=0.9,mypkg.rewards:fmt=0.1"    0.9 * math + 0.1 * mypkg.rewards.fmt
    "math(allow_truncated=true)"        math, crediting completions cut off at the length limit
    "myreward:digits"                   digits() of myreward.py in the current folder
    "rewards/fmt.py:fmt=0.5"            0.5 * fmt() of that file (relative to the current folder)
"""
from __future__ import annotations

import functools
import inspect
import math as _math
import re
from pathlib import Path
from typing import Callable, Sequence
from urllib.parse import urlsplit

from ..batch import Episode
from .. import plugins
from ..errors import RewardSpecError
from .remote import JudgeReward, ServerReward
from .values import finite_or_error
from .verify import BUILTIN_REWARDS, RewardCallable


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


def accepts_finish_reason(fn: RewardCallable) -> bool:
    """Whether ``fn`` takes the ``finish_reason`` keyword (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "finish_reason" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in params
    )


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
                out.append(finite_or_error(e.env_reward, "the episode's environment"))
            elif finish == "length":
                out.append(0.0)
            else:
                out.append(ValueError("the environment ended this episode without a reward"))
        return out

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        raise ValueError("the 'env' reward reads the episode's environment reward: it scores batches only")
