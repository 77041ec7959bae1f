"""The run's evaluations at a step: the ``eval.data`` sets and the held-out split, each answered by
the one evaluator (run/evaluation.py); an asynchronous run evaluates the trainer's current weights."""
from __future__ import annotations

from ..batch import StepRollout
from ..records.rng import step_seed
from ..rollout.engines.base import SamplingParams
from ..rollout.producer import RolloutProducer
from .state import Run
from .eval_sets import evaluate_sets
from .evaluation import answer_set, heldout_metrics, heldout_task_metrics, scored_by, unscored_by


def evaluate(s: Run, step: int) -> dict[str, float]:
    """The ``eval.data`` sets' metrics and the held-out split's (greedy, and sampled at the rollout
    temperature), every set answered by the one evaluator (run/evaluation.py)."""
    cfg = s.cfg
    out: dict[str, float] = {}
    n = cfg.eval.samples if cfg.eval.n is None else cfg.eval.n
    # scored here, each by its own reward
    out.update(evaluate_sets(unscored_by(s.rollouts), s.eval_sets, cfg, n=n,
                             seed=step_seed(cfg.seed, step, 0, "eval sets"), multi_turn=s.multi_turn))
    if s.heldout:
        out.update(evaluate_heldout(s, step))
    return out


def evaluate_heldout(s: Run, step: int) -> dict[str, float]:
    """Held-out accuracy: greedy, and sampled at the rollout temperature (``eval.samples``), scored
    where the rollouts score (the rollout workers on Ray)."""
    cfg = s.cfg
    sampled = SamplingParams.for_evaluation(cfg, cfg.eval.samples, step_seed(cfg.seed, step, 0, "eval")) \
        if cfg.eval.samples else None
    a = answer_set(scored_by(s.rollouts, s.multi_turn), s.heldout, max_new_tokens=cfg.max_new_tokens,
                   sampled=sampled)
    if a.failed:
        s.warn(f"step {step}: evaluation: {a.failed} held-out sample(s) whose reward failed "
               f"(counted as not correct in the accuracy, left out of the mean reward)")
    # a source with tasks (reasoning-gym, one task or a mix): each task's split too
    tasks = [s.source.task_of(e.reward_prompt) for e in s.heldout]
    return heldout_metrics(a, s.reward, cfg.rollout.tool_parser) | heldout_task_metrics(a, s.reward, tasks)


def evaluate_current(s: Run, step: int, producer: RolloutProducer[StepRollout] | None) -> dict[str, float]:
    """:func:`evaluate` with the trainer's current weights: an asynchronous run pauses its
    producer, evaluates with them, and gives the engine back the version it was generating with."""
    if producer is None:
        return evaluate(s, step)
    with producer.paused():
        s.rollouts.load_weights(s.trainers.weights().snapshot(), step)
        try:
            return evaluate(s, step)
        finally:
            s.rollouts.load_weights(producer.loaded_weights, producer.loaded_version)
