"""``rldsl reward``: the reward a verifier gives one completion, to check it on your own examples.

    rldsl reward math --completion 'The answer is 2/3.' --answer '\\frac{2}{3}'
    rldsl reward gsm8k --completion '... #### 72' --answer '... #### 72' --finish-reason length
    rldsl reward 'math=0.9,mypkg.rewards:fmt=0.1' --completion ... --answer ...
    rldsl reward reasoning_gym --task spell_backward --prompt 'Spell this word backward ...: cat' \
        --completion '<answer>tac</answer>' --answer tac

NAME is anything ``--reward`` accepts (a built-in, ``module:function``, options, a weighted
sum; ``rldsl.runtime.rewards.functions``). It prints the total reward, each weighted term, and for
``math`` / ``gsm8k`` the answer found in the completion, the rule that found it, the gold
answer and why they match or not (docs/rewards.md). ``reasoning_gym`` scores with the verifier of
the task ``--task`` names (reasoning-gym's ``score_answer`` on a row of the question and answer
given); a task whose verifier reads the generated row's metadata is refused (exit 2).

Exit codes (docs/errors.md): 0 scored; 1 the reward function raised or returned a non-number;
2 bad input (unknown reward, bad spec or option, bad ``--finish-reason``).
"""
from __future__ import annotations

from typing import Optional

import typer

from ...errors import UsageError
from ..data import reasoning_gym as rg
from ..errors import RewardError
from .functions import RewardFn, exit_error
from .spec import split_reward_name
from .verify import VERDICTS

__all__ = ["FINISH_REASONS", "show_reward"]

FINISH_REASONS = ("stop", "length")


def _fmt(x: float) -> str:
    return f"{x:g}"


def _quote(text: str) -> str:
    """The text in double quotes, backslashes as typed, newlines shown as \\n."""
    return '"' + text.replace("\n", "\\n") + '"'


def show_reward(name: str, completion: str, answer: str, prompt: Optional[str] = None,
                finish_reason: str = "stop", traceback: bool = False, task: Optional[str] = None) -> None:
    """``rldsl reward`` (its options: rldsl/runtime/cli.py): print the reward and each term.
    ``task``: the reasoning-gym task whose verifier a ``reasoning_gym`` term scores with."""
    if finish_reason not in FINISH_REASONS:
        raise UsageError(f"--finish-reason must be 'stop' or 'length', got {finish_reason!r}")
    fn = RewardFn(name)  # an unknown or unloadable reward: RewardSpecError, exit 2
    rg.check_reward(fn)  # a bad answer_format
    prompt = prompt or ""
    gym = [t.name for t in fn.terms if rg.reasoning_gym_reward in (t.fn, getattr(t.fn, "func", None))]
    if gym and task is None:
        raise UsageError(f"reward {gym[0]!r} scores a reasoning-gym row with its task's own verifier: name the "
                         "task with --task NAME (e.g. --task spell_backward), the row's question with --prompt "
                         "and its answer with --answer")
    if task is not None:
        if not gym:
            raise UsageError(f"--task names the reasoning-gym task of a reasoning_gym reward, and {name!r} "
                             "has no reasoning_gym term")
        with rg.only_task(task):  # the task's verifier alone: not every task's import (seconds)
            row = rg.offline_row(task, prompt, answer)  # an unknown task: DataError, exit 2
            total, lines = _score(fn, prompt, completion, answer, finish_reason, traceback, row)
    else:
        total, lines = _score(fn, prompt, completion, answer, finish_reason, traceback, None)
    typer.echo(f"reward: {_fmt(total)}")
    if len(fn.terms) > 1 or any(line.startswith("  ") for line in lines):
        for line in lines:
            typer.echo(line)


def _score(fn: RewardFn, prompt: str, completion: str, answer: str, finish_reason: str, traceback: bool,
           row: "rg.OfflineRow | None") -> tuple[float, list[str]]:
    """The total reward and each term's lines (with ``math`` / ``gsm8k``'s verdicts); ``row``: the
    reasoning-gym row a ``reasoning_gym`` term scores, checked for what its verifier read."""
    total = 0.0
    lines: list[str] = []
    for term in fn.terms:
        try:
            value = term(prompt, completion, answer, finish_reason)
        except (Exception, SystemExit) as raised:  # noqa: BLE001 - a user's function: reported, traceback on request
            # its sys.exit() is its error, not the command's end
            exc = exit_error(raised) if isinstance(raised, SystemExit) else raised
            if row is not None:
                row.check()  # the verifier needed what an offline row lacks: said so, exit 2
            if traceback:
                raise exc
            raise RewardError(f"reward {term.name!r} failed: {type(exc).__name__}: {exc}") from None
        total += term.weight * value
        weight = "" if term.weight == 1.0 else f" (weight {_fmt(term.weight)})"
        lines.append(f"{term.name}: {_fmt(value)}{weight}")
        base, options = split_reward_name(term.name)
        if base in VERDICTS:
            v = VERDICTS[base](completion, answer, finish_reason=finish_reason, **options)
            found = _quote(v.extracted) if v.extracted is not None else "none"
            lines += [f"  answer found: {found}  ({v.rule})",
                      f"  gold answer:  {_quote(v.gold)}",
                      f"  why:          {v.why}"]
    if row is not None:
        row.check()
    return total, lines

