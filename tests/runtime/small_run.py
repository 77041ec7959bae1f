"""The small run most runtime tests train: one set of settings, each value with its reason, and
the readers of its records. ``small_run(model_dir, out, "train.steps=5", **{"rollout.n": 2})``
gives its RunConfig; a value a test depends on is written at the test's call, even when it equals
the one here. Importable from every test folder (pyproject's ``pythonpath``)."""
from __future__ import annotations

from pathlib import Path

from rldsl.runtime.config import RunConfig, load_config
from rldsl.runtime.records.metrics import TIMED, read_metrics

#: The settings of a small run on the tiny random model (tests/conftest.py's ``model_dir``); the
#: run's own defaults are sized for a real run (16 prompts x 8 samples, 300 steps).
SMALL_RUN: dict[str, object] = {
    # 4 prompts x 4 samples = 16 rows a step: groups of 4 give a group baseline with both rewards
    # in most groups (parity below), and a step stays well under a second on one CPU core
    "rollout.prompts_per_step": 4,
    "rollout.n": 4,
    # 3 steps: the 2nd and 3rd start from weights the run itself updated (an off-by-one in the
    # step, the optimizer or the weight sync shows there), a few seconds in all
    "train.steps": 3,
    # no held-out evaluation between steps (0 = never); the evaluation tests turn it on
    "eval.every": 0,
    # 2 sampled answers per held-out prompt when a test does evaluate: the sampled-accuracy path
    # runs, with the fewest samples that can disagree
    "eval.samples": 2,
    # 8 held-out prompts: the split runs (not the 200 of the built-in task), at a negligible cost
    "data.eval_size": 8,
    # no checkpoints (0 = never): each writes the model and optimizer to disk; checkpoint tests
    # set checkpoint.every themselves
    "checkpoint.every": 0,
    # no progress bar: plain output, nothing redrawn in pytest's capture
    "log.progress": False,
    # 1 for a completion of odd length: a random model gets both rewards, so the advantages are
    # not all zero and the update moves the weights (reward_helpers.py)
    "reward.name": "reward_helpers:parity",
    # the reward called in the test's own process, no time limit: no worker process to start per
    # run (a second or two on a loaded machine); the limit's tests set reward.timeout_s themselves
    "reward.timeout_s": 0,
}


def small_run(model_dir: Path, out: Path, *sets: str, **over: object) -> RunConfig:
    """SMALL_RUN on the model folder ``model_dir``, writing to ``out``; then ``sets``
    (``"key=value"`` strings, as ``--set``) and ``over`` (``**{"key": value}``), later ones win."""
    values = [f"{k}={_text(v)}" for k, v in SMALL_RUN.items()]
    return load_config(None, [f"model.path={model_dir}", f"out={out}", *values, *sets,
                              *(f"{k}={_text(v)}" for k, v in over.items())])


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def steps_of(run: Path) -> list[dict]:
    """The run's per-step records of metrics.jsonl (those with a reward)."""
    return [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]


def without_timing(records: list[dict]) -> list[dict]:
    """``records`` less their timings (which differ between two runs of the same steps)."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMED)} for r in records]
