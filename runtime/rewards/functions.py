"""The weighted sum of a reward spec (:class:`RewardFn`): every term of the spec (spec.py) scored on
every sample, summed with its weight, and what counts as correct.

The reward of a sample is ``sum_k weight_k * reward_k``. Every reward function has the
signature ``(prompt, completion, answer) -> float``; one that also accepts a
``finish_reason`` keyword (or ``**kwargs``) is given it ("stop" | "length"). ``prompt`` is
the row's original prompt (``Example.reward_prompt``: before the chat template and system
prompt; a messages list as its contents joined by blank lines), not the text the model saw.
The built-in functions are verify.py's; batch terms (a reward server or an LLM judge:
remote.py; a reward model: model.py; the environment's ``env``: spec.py) score all samples of
a call at once. docs/rewards.md has their options and the server protocol.

Errors: a reward function that raises, or returns something that is not a finite
number (values.py ``reward_value``, the one check of every reward value; text is refused),
raises ``RewardError`` naming the reward, the sample index, the prompt and the completion.
With ``on_error="skip"`` the sample gets a NaN reward instead (the trainer masks NaN-reward
samples) and the count is reported in ``RewardResult.num_errors``.
"""
from __future__ import annotations

import inspect
import math as _math
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

from ..batch import RolloutBatch
from ..errors import RewardError, RewardSpecError, RewardTimeout
from .deadline import DeadlinePool
from .spec import EnvironmentReward, accepts_finish_reason, parse_reward_spec, resolve_reward, term_labels
from .values import finite_or_error
from .verify import IN_PROCESS, RewardCallable


def _short(text: str, n: int = 200) -> str:
    return repr(text if len(text) <= n else text[: n - 3] + "...")


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
            return [v if isinstance(v, BaseException) else finite_or_error(v, "the batch term") for v in values]
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
        number = finite_or_error(value, "the function")
        if isinstance(number, BaseException):
            raise number
        return number


def reward_term(name: str, weight: float = 1.0) -> RewardTerm:
    """The term ``name`` of a reward spec (``math(allow_truncated=true)``, ``mod:fn``), resolved."""
    fn = resolve_reward(name)
    return RewardTerm(name, weight, fn, accepts_finish_reason(fn))


def exit_error(e: SystemExit) -> RuntimeError:
    """A reward function's ``sys.exit(code)`` as the error of its sample: the reward wrapper's
    and the CLI's ``except Exception`` would let it end the whole command with that code, silently."""
    return RuntimeError(f"the function called sys.exit({e.code!r}); a reward function returns a number")


class RewardFn:
    """A weighted sum of reward functions, built from a spec string (its syntax: spec.py).

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

    def check_signatures(self) -> None:
        """Each function term can be called as the run calls it, ``fn(prompt, completion, answer)``
        (with ``finish_reason=`` when it takes one; docs/rewards.md): checked on its signature
        (``inspect``), so that a function of the wrong shape is refused before any model loads, with
        a RewardSpecError, not after the model loaded and sampled a batch. Batch terms (servers,
        judges, reward models) are called as their own classes define."""
        for term in self.terms:
            if term.batched:
                continue
            try:
                signature = inspect.signature(term.fn)
            except (TypeError, ValueError):  # a builtin without one: nothing to check
                continue
            try:
                signature.bind("", "", "", **({"finish_reason": "stop"} if term.takes_finish_reason else {}))
            except TypeError as e:
                raise RewardSpecError(f"reward {term.name!r} cannot be called as a reward function: its signature "
                                      f"is {signature}, and a reward is called as fn(prompt, completion, answer) "
                                      f"(with finish_reason=... when it takes it; docs/rewards.md): {e}") from None

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
                scores = [d if isinstance(d, BaseException) else finite_or_error(sum(v for _, v in d), "its steps' sum")
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
