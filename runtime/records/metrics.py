"""Metrics of a run: ``metrics.jsonl``, optional TensorBoard, a progress display, a summary.

``metrics.jsonl`` holds one JSON object per training step, ``{"step": N, ...}``, appended
and flushed as the step ends. Values are numbers, strings, booleans or null: NaN and
infinities are written as null (the run never crashes on a bad number), tensors and
numpy scalars become plain numbers. Every name is spelled one way; the ones the progress
display, the summary and ``rldsl plot`` read are the constants below (the full list of
what a step writes: docs/runtime.md, "Metrics").

Resume: a run restored from the checkpoint of step N must pass ``resume_step=N``;
lines with ``step > N`` are dropped so that the file equals the one of a run that was
never interrupted. The step-N line is therefore written before checkpoint N is saved.
"""
from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from fnmatch import fnmatchcase
from typing import Any, Callable, Iterator, Mapping, Sequence

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from rldsl.config_files import decode_utf8

from ..errors import RunError
from .run_dir import METRICS_FILE, write_text_atomic
from .trackers import TensorBoardTracker, Tracker, numeric

__all__ = [
    "REWARD", "GREEDY_ACC", "SAMPLED_ACC", "EVAL_FAILED", "HELDOUT_TASKS", "RESPONSE_LENGTH", "ENTROPY", "CLIP_FRACTION", "STEP_TIME",
    "ACCURACY", "TRUNCATED_FRACTION", "LR", "TOKENS_PER_S", "REWARD_ERRORS", "REWARD_TIMEOUTS",
    "REWARD_TERM_MEAN", "REWARD_TERM_STD",
    "TOOL_CALLS_PER_EPISODE", "TOOL_CALLS_WELL_FORMED", "TOOL_CALL_ERRORS",
    "AGENT_CALLS", "AGENT_PREFIX_BREAKS", "AGENT_ROWS_PER_EPISODE", "AGENT_ERRORS",
    "MOE_ROUTING_MISMATCH", "MOE_ROUTER_DRIFT", "MOE_EXPERT_LOAD_MAX", "MOE_EXPERT_LOAD_CV",
    "ROLLOUT_TOKENS_PER_S", "LOGPROBS_TOKENS_PER_S", "UPDATE_TOKENS_PER_S", "PADDING_RATIO", "MFU",
    "TOKEN_IMBALANCE", "MICROBATCH_IMBALANCE", "TIMED", "throughput",
    "PHASES", "time_key", "timed",
    "SUM", "MEAN", "MAX", "MIN", "TOKENS", "ROWS", "TERM", "COMBINE", "combine_kind", "combine", "combine_ranks",
    "Metric", "METRICS", "metric_by_concept",
    "KEY_METRICS",
    "HIGHER_IS_BETTER",
    "MetricsLogger",
    "read_metrics",
    "sanitize",
    "summary_table",
    "truncate_metrics",
]

REWARD = "reward_mean"                # mean verifier reward of the step's rollouts
# held-out accuracy: the fraction of samples with reward > 0.5 (a binary reward's 1; a sample
# whose reward failed counts as not correct and is reported in eval/failed)
GREEDY_ACC = "eval/greedy_acc"        # held-out accuracy, greedy (steps with an evaluation)
SAMPLED_ACC = "eval/sampled_acc"      # held-out accuracy, sampled at the rollout temperature
EVAL_FAILED = "eval/failed"           # held-out samples whose reward failed (NaN), greedy + sampled
# the held-out split per task (generated data, data/reasoning_gym.py):
# eval/heldout/<task>/greedy_acc, greedy_reward, sampled_acc, sampled_reward
HELDOUT_TASKS = "eval/heldout"
RESPONSE_LENGTH = "response_length"   # mean completion length in tokens
ENTROPY = "entropy"                   # mean per-token policy entropy (the compiled loss's)
CLIP_FRACTION = "clip_fraction"       # fraction of clipped tokens (the compiled loss's)
STEP_TIME = "step_s"                  # seconds the step took
ACCURACY = "accuracy"                 # fraction of the step's rollouts with reward > 0.5
TRUNCATED_FRACTION = "truncated_fraction"  # fraction of completions cut at max_new_tokens
LR = "lr"                             # the learning rate the step's update used
TOKENS_PER_S = "tokens_per_s"         # prompt + response tokens of the step per second
REWARD_ERRORS = "reward_errors"       # samples whose reward function failed (reward.on_error=skip)
REWARD_TIMEOUTS = "reward_timeouts"   # of those, the samples whose call ran past reward.timeout_s
# each reward term of the step's samples (TRL's names); <term> is the term's label
# (runtime/rewards/spec.py term_labels: `math`, a function's name, `server_HOST`, ...)
REWARD_TERM_MEAN = "rewards/{term}/mean"  # the term's mean over the samples it scored
REWARD_TERM_STD = "rewards/{term}/std"    # ... and their standard deviation
# multi-turn episodes with tools (runtime/rollout/tool_metrics.py); eval/<name> for the held-out
# greedy episodes, eval/sampled_<name> for the sampled ones
TOOL_CALLS_PER_EPISODE = "tool_calls/per_episode"  # tool calls the model wrote per episode
TOOL_CALLS_WELL_FORMED = "tool_calls/well_formed"  # fraction of those calls the parser reads
TOOL_CALL_ERRORS = "tool_calls/errors"             # fraction of tool results that are an error
# rollout.agent episodes (runtime/rollout/agents/runner.py agent_metrics)
AGENT_CALLS = "agent/calls"                        # model calls per episode
AGENT_PREFIX_BREAKS = "agent/prefix_breaks"        # calls of the step that did not continue an earlier call's ids
AGENT_ROWS_PER_EPISODE = "agent/rows_per_episode"  # training rows per episode (1 + its prefix breaks)
AGENT_ERRORS = "agent/errors"                      # fraction of episodes ended by an error
# the update's (train/trainer.py, workers/fsdp.py)
LOSS = "loss"                          # the minibatch losses' mean (the compiled loss's value)
PG_LOSS = "pg_loss"                    # its policy-gradient term (the compiled loss's metric)
VALUE_LOSS = "value_loss"              # its critic term (the compiled loss's metric)
GRAD_NORM = "grad_norm"                # the policy's gradient norm before clipping
CRITIC_GRAD_NORM = "critic_grad_norm"  # the critic's
OPTIMIZER_STEPS = "optimizer_steps"    # optimizer steps taken in the step's update
SKIPPED_ZERO_ADV = "skipped_zero_adv"  # 1 when a pure policy-gradient update had nothing to learn
SKIPPED_NONFINITE = "skipped_nonfinite"  # minibatches skipped for a NaN / inf loss or gradient
# model.dtype = float16 only (train/loss_scale.py): dynamic loss scaling
LOSS_SCALE = "train/loss_scale"        # the loss scale after the step's update
SKIPPED_STEPS = "train/skipped_steps"  # of skipped_nonfinite, the minibatches whose scaled gradient overflowed
# a mixture-of-experts policy's routing (runtime/models/moe.py, docs/moe.md), drawn by ``rldsl plot``
MOE_ROUTING_MISMATCH = "moe/routing_mismatch"  # (token, layer) pairs routed otherwise than the engine did
MOE_ROUTER_DRIFT = "moe/router_drift"          # ... that the trainer's router would route otherwise now
MOE_EXPERT_LOAD_MAX = "moe/expert_load_max"    # the busiest expert's share times E (1 = even)
MOE_EXPERT_LOAD_CV = "moe/expert_load_cv"      # std / mean of the experts' counts
# asynchronous rollouts (rollout.max_staleness > 0)
STALENESS_MEAN = "async/staleness_mean"  # policy versions between the step and its batch's tokens, mean
STALENESS_MAX = "async/staleness_max"    # ... and max (equal without partial rollouts: one version a batch)
TRAINER_WAIT = "time/trainer_wait_s"     # seconds the trainer waited for the step's batch
PRODUCER_WAIT = "time/producer_wait_s"   # seconds the producer waited (for weights, or room) before it
# throughput (every step; the trainer counts, ``throughput`` below derives): tokens/s of each
# phase, padding, model FLOPs utilisation, balance (runtime/train/throughput.py)
ROLLOUT_TOKENS_PER_S = "perf/rollout_tokens_per_s"    # generated tokens / time/rollout_s
LOGPROBS_TOKENS_PER_S = "perf/logprobs_tokens_per_s"  # real tokens of the old/ref/critic forwards / time/logprobs_s
UPDATE_TOKENS_PER_S = "perf/update_tokens_per_s"      # real tokens of the update's forwards / time/update_s
PADDING_RATIO = "perf/padding_ratio"  # of the tokens the training forwards computed, the fraction that was padding
MFU = "perf/mfu"                      # model FLOPs of the training forwards / (their seconds x the peak)
TOKEN_IMBALANCE = "perf/token_imbalance"  # the update: the largest rank's real tokens over the mean (1 = even)
MICROBATCH_IMBALANCE = "perf/microbatch_imbalance"  # ... the largest micro-batch's over the mean
REWARD_HIDDEN = "time/reward_hidden_s"   # of the batch's scoring (time/reward_s), the seconds the engine was
                                         # generating the next batch meanwhile (scoring overlapped)
#: prefixes of the metrics that measure the machine's speed (a resumed or repeated run equals
#: an uninterrupted one in every other metric)
TIMED = ("time/", STEP_TIME, TOKENS_PER_S, ROLLOUT_TOKENS_PER_S, LOGPROBS_TOKENS_PER_S, UPDATE_TOKENS_PER_S, MFU)

#: The timed phases of a step: ``time/<phase>_s`` in metrics.jsonl, the seconds the phase took
PHASES = (
    "rollout",       # the engine's generation (all sampling rounds)
    "reward",        # scoring the samples
    "greedy",        # ReMax's greedy baseline: its generation and scoring
    "reference",     # the reference model's answers (a spec reading ref_reward): their generation and scoring
    "answer",        # the policy's forwards over the reference answer (a spec reading answer_prob)
    "logprobs",      # the trainer's estimate: old / reference logprobs, values, advantages
    "teacher",       # of the estimate (time/logprobs_s), the teacher's forward (a spec with a teacher only)
    "update",        # the minibatch updates and the LR-schedule step
    "sync",          # the new weights to the engine(s) (an asynchronous run: published)
    "trainer_wait",  # an asynchronous run: the trainer waiting for the step's batch
)


def time_key(phase: str) -> str:
    """``time/<phase>_s``, the metric of a phase in :data:`PHASES`."""
    if phase not in PHASES:
        raise KeyError(f"no timed phase {phase!r}: one of {list(PHASES)}")
    return f"time/{phase}_s"


# ----------------------------------------------------------------------------- combining
# An update's metrics come in pieces: a value per micro-batch, per trainer rank, per minibatch
# and per epoch. Each metric declares here, once, how its pieces combine, and the one rule is
# applied at every level: micro-batches -> minibatch (train/trainer.py), ranks -> minibatch
# (workers/fsdp.py, all-reduced), minibatches and epochs -> the step (train/trainer.py).

SUM = "sum"        # counts: the pieces add up
MEAN = "mean"      # the plain mean of the pieces (a value every rank has alike: the mean is it)
MAX = "max"        # the largest piece (an extreme over tokens is an extreme over pieces)
MIN = "min"        # the smallest piece
TOKENS = "tokens"  # a per-token average: the pieces' mean weighted by their loss-mask tokens
ROWS = "rows"      # a per-row average: weighted by their rows with a loss-mask token
#: a term already divided by its minibatch's global denominator (docs/api.md, "Denominators"):
#: the pieces of one minibatch (micro-batches, ranks) add up to it; minibatches and epochs,
#: each a whole value, are averaged
TERM = "term"

#: how each metric combines: (name or fnmatch pattern, kind), the first match wins
COMBINE: tuple[tuple[str, str], ...] = (
    (LOSS, TERM), (PG_LOSS, TERM), (VALUE_LOSS, TERM), ("distill/loss", TERM),
    (GRAD_NORM, MEAN), (CRITIC_GRAD_NORM, MEAN),  # from the all-reduced gradient: alike on every rank
    (OPTIMIZER_STEPS, SUM), (SKIPPED_NONFINITE, SUM), (SKIPPED_STEPS, SUM),
    ("correction/rejected_seq_fraction", ROWS),  # of the rows with a loss-mask token (rldsl/ops.py)
    ("*_max", MAX), ("*_min", MIN),              # ratio_max, correction/is_min, adv_max, ...
    ("*", TOKENS),                               # entropy, clip_fraction, ratio_mean, kl, ...
)


def combine_kind(name: str) -> str:
    """The kind (:data:`COMBINE`) by which the pieces of metric ``name`` combine."""
    for pattern, kind in COMBINE:
        if fnmatchcase(name, pattern):
            return kind
    return TOKENS


def _weighted(vals: Sequence[tuple[float, float]]) -> float:
    """sum(v * w) / sum(w), or the plain mean when no piece has weight."""
    total = sum(w for _, w in vals)
    if total > 0:
        return sum(v * w for v, w in vals) / total
    return sum(v for v, _ in vals) / len(vals)


def combine(parts: Sequence[tuple[Mapping[str, float], float, float]], *, whole: bool = False) -> dict[str, float]:
    """One value per metric from its pieces ``(metrics, loss-mask tokens, rows)``.

    ``whole=False``: the pieces make up one minibatch (its micro-batches), so a :data:`TERM`
    adds up; ``whole=True``: each piece is a whole minibatch (of an epoch), so a term is
    averaged. Every other kind combines alike at both levels. A metric missing from a
    piece is combined over the pieces that have it.
    """
    out: dict[str, float] = {}
    for k in sorted({k for m, _, _ in parts for k in m}):
        vals = [(m[k], tokens, rows) for m, tokens, rows in parts if k in m]
        kind = combine_kind(k)
        if kind == TERM:
            kind = MEAN if whole else SUM
        if kind == SUM:
            out[k] = sum(v for v, _, _ in vals)
        elif kind == MAX:
            out[k] = max(v for v, _, _ in vals)
        elif kind == MIN:
            out[k] = min(v for v, _, _ in vals)
        elif kind == MEAN:
            out[k] = sum(v for v, _, _ in vals) / len(vals)
        else:
            out[k] = _weighted([(v, t if kind == TOKENS else r) for v, t, r in vals])
    return out


def combine_ranks(metrics: Mapping[str, float], tokens: float, rows: float, share: float,
                  reduce: Callable[[list[float], str], list[float]]) -> dict[str, float]:
    """Every rank's pieces of one minibatch -> its value (the same on every rank), by the
    kinds of :data:`COMBINE`. ``tokens``, ``rows``: this rank's; ``share`` 0 marks a rank
    without rows (a zero-weighted copy: its values count for nothing, but for a :data:`MEAN`,
    which every rank has alike). ``reduce(values, op)`` is the all-reduce of a list of floats
    over the ranks, ``op`` ``"sum"``, ``"max"`` or ``"min"`` (every rank calls it alike: the
    keys are sorted, and each rank has the same metrics)."""
    keys = sorted(metrics)
    kinds = {k: combine_kind(k) for k in keys}
    added = [k for k in keys if kinds[k] not in (MAX, MIN)]
    weight = {SUM: share, TERM: share, MEAN: 1.0, TOKENS: tokens * share, ROWS: rows * share}
    summed = reduce([metrics[k] * weight[kinds[k]] for k in added] + [tokens * share, rows * share, 1.0], "sum")
    total = {TOKENS: summed[-3], ROWS: summed[-2], MEAN: summed[-1]}
    out = dict(metrics)
    for k, v in zip(added, summed):
        kind = kinds[k]
        out[k] = v if kind in (SUM, TERM) else v / total[kind] if total[kind] > 0 else 0.0
    for kind, neutral in ((MAX, -math.inf), (MIN, math.inf)):
        ks = [k for k in keys if kinds[k] == kind]
        if ks:
            out.update(zip(ks, reduce([metrics[k] if share else neutral for k in ks], kind)))
    return out


@contextmanager
def timed(metrics: dict[str, float], phase: str) -> Iterator[None]:
    """Add the seconds the block takes to ``metrics["time/<phase>_s"]`` (a step names each of
    its phases once: ``with timed(m, "update"): ...``)."""
    key = time_key(phase)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = metrics.get(key, 0.0) + (time.perf_counter() - t0)


@dataclass(frozen=True)
class Metric:
    """One metric's names: ``key`` in metrics.jsonl; ``concept``, the short name figures and
    report columns use; ``label`` on the progress line (None: not shown there); ``title`` and
    ``unit`` of a figure; ``sparse``: logged at evaluations only (drawn raw, with markers);
    ``higher_is_better``: the summary reports its best value."""

    key: str
    concept: str
    title: str
    unit: str
    label: str | None = None
    sparse: bool = False
    higher_is_better: bool = False


#: The metrics the progress line, the summary, ``rldsl plot`` and ``rldsl ablate``'s report
#: read, in this order: the one table of their names and labels.
METRICS: dict[str, Metric] = {m.key: m for m in (
    Metric(REWARD, "reward", "training reward", "mean reward", label="reward", higher_is_better=True),
    Metric(GREEDY_ACC, "greedy_acc", "held-out accuracy (greedy)", "accuracy", label="acc", sparse=True,
           higher_is_better=True),
    Metric(SAMPLED_ACC, "sampled_acc", "held-out accuracy (sampled)", "accuracy", label="acc~", sparse=True,
           higher_is_better=True),
    Metric(RESPONSE_LENGTH, "response_length", "response length", "tokens"),
    Metric(ENTROPY, "entropy", "policy entropy", "nats / token"),
    Metric(CLIP_FRACTION, "clip_fraction", "clip fraction", "fraction of tokens", label="clip"),
    Metric(STEP_TIME, "step_time", "step time", "seconds"),
    Metric(UPDATE_TOKENS_PER_S, "update_tokens_per_s", "update throughput", "real tokens / s"),
    Metric(PADDING_RATIO, "padding_ratio", "padding in the training forwards", "fraction of tokens"),
    Metric(MFU, "mfu", "model FLOPs utilisation", "fraction of peak"),
)}


def throughput(m: Mapping[str, Any], peak_flops: float, generated_tokens: float) -> dict[str, float]:
    """The step's ``perf/*`` metrics from the trainer's counts (``perf/<phase>_tokens``,
    ``_computed_tokens``, ``_padding_tokens``, ``_flops``, ``_token_imbalance``, ``_microbatch_imbalance``; phase
    ``logprobs`` or ``update``) and the phases' seconds (``time/<phase>_s``). Missing counts
    (an update skipped with nothing to learn) leave their metrics out."""
    out: dict[str, float] = {}

    def rate(n: float, seconds: Any) -> float:
        return n / seconds if isinstance(seconds, (int, float)) and seconds > 0 else float("nan")

    out[ROLLOUT_TOKENS_PER_S] = rate(generated_tokens, m.get("time/rollout_s"))
    padding = computed = flops = seconds = 0.0
    for phase, key in (("logprobs", LOGPROBS_TOKENS_PER_S), ("update", UPDATE_TOKENS_PER_S)):
        n = m.get(f"perf/{phase}_tokens")
        if n is None or not m.get(f"perf/{phase}_computed_tokens"):
            continue
        t = m.get(f"time/{phase}_s")
        out[key] = rate(float(n), t)
        padding += float(m.get(f"perf/{phase}_padding_tokens", 0.0))
        computed += float(m[f"perf/{phase}_computed_tokens"])
        flops += float(m.get(f"perf/{phase}_flops", 0.0))
        seconds += float(t) if isinstance(t, (int, float)) else 0.0
    if computed > 0:
        out[PADDING_RATIO] = padding / computed
        out[MFU] = flops / seconds / peak_flops if seconds > 0 and peak_flops > 0 else float("nan")
    if "perf/update_token_imbalance" in m:
        out[TOKEN_IMBALANCE] = float(m["perf/update_token_imbalance"])
        out[MICROBATCH_IMBALANCE] = float(m["perf/update_microbatch_imbalance"])
    return out


def metric_by_concept(concept: str) -> Metric:
    """The :data:`METRICS` row of a concept name (``"greedy_acc"``)."""
    for m in METRICS.values():
        if m.concept == concept:
            return m
    raise KeyError(f"no metric with concept {concept!r}: one of {[m.concept for m in METRICS.values()]}")


#: The summary's default rows, in this order (then every other ``eval/`` metric).
KEY_METRICS = tuple(METRICS)

#: Metrics whose best value is the largest one (the summary reports it).
HIGHER_IS_BETTER = frozenset(k for k, m in METRICS.items() if m.higher_is_better)


def sanitize(value: Any) -> Any:
    """A JSON-safe copy of ``value``: non-finite floats -> None, tensors/numpy -> Python."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if hasattr(value, "tolist"):  # tensors, numpy arrays and scalars (0-d -> a number)
        return sanitize(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitize(v) for v in value]
    return str(value)


def _parse_lines(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Records of a metrics file and the 1-based numbers of unreadable lines (a line a crash cut).
    A byte that is not UTF-8 is no crash's (every record is written as ASCII JSON): the file was
    changed by something else, and a RunError names its line."""
    records: list[dict[str, Any]] = []
    bad: list[int] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = decode_utf8(raw, path, RunError, first_line=number)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                bad.append(number)
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
            else:
                bad.append(number)
    return records, bad


def read_metrics(path: str | os.PathLike[str], *, warn_unreadable: bool = True) -> list[dict[str, Any]]:
    """The records of ``<run>/metrics.jsonl`` (or of the given .jsonl file), in file order.

    Unreadable lines (a line cut by a crash) are skipped, with a warning unless
    ``warn_unreadable`` is False (a file another process is still writing).
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    records, bad = _parse_lines(path)
    if bad and warn_unreadable:
        warnings.warn(f"{path}: skipped unreadable line(s) {bad}", stacklevel=2)
    return records


def truncate_metrics(path: str | os.PathLike[str], step: int) -> int:
    """Keep only the records with ``step <= step`` in a metrics file; return how many were dropped.

    Unreadable lines (a crash mid-write) are dropped too. The file is rewritten atomically.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        return 0
    records, bad = _parse_lines(path)
    keep = [r for r in records if r["step"] <= step]
    dropped = len(records) - len(keep) + len(bad)
    if dropped:
        write_text_atomic(path, "".join(json.dumps(record, allow_nan=False) + "\n" for record in keep))
    return dropped


def _last_value(records: Sequence[Mapping[str, Any]], key: str) -> tuple[Any, int | None]:
    for record in reversed(records):
        value = record.get(key)
        if value is not None:
            return value, record["step"]
    return None, None


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def summary_table(records: Sequence[Mapping[str, Any]], run_dir: str | os.PathLike[str],
                  keys: Sequence[str] | None = None) -> Table:
    """A rich Table of the run: final value of each metric and, for rewards and
    accuracies (higher is better), the best value and its step; the run folder is the
    caption.

    ``keys``: the metrics to show; None = the key metrics found (reward, accuracies,
    length, entropy, clip fraction, step time) and every ``eval/`` metric.
    """
    present: list[str] = []
    for record in records:
        for key in record:
            if key != "step" and key not in present:
                present.append(key)
    if keys is None:
        keys = [k for k in KEY_METRICS if k in present] + [
            k for k in present if k.startswith("eval/") and k not in KEY_METRICS]

    caption = f"run folder: {run_dir}"
    # Wide enough that the folder path is not wrapped (when the console is).
    table = Table(title="run summary", caption=caption, caption_justify="left",
                  min_width=len(caption))
    table.add_column("metric")
    table.add_column("final", justify="right")
    table.add_column("best", justify="right")
    table.add_column("best at step", justify="right")
    last_step = records[-1]["step"] if records else None
    table.add_row("steps", _fmt(last_step), "", "")
    for key in keys:
        final, _ = _last_value(records, key)
        best, best_step = "", ""
        higher = key in HIGHER_IS_BETTER or (
            key.startswith("eval/") and ("acc" in key or "reward" in key))
        if higher:
            numbers = [(r[key], r["step"]) for r in records
                       if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
            if numbers:
                value, step = max(numbers, key=lambda vs: vs[0])
                best, best_step = _fmt(value), str(step)
        table.add_row(key, _fmt(final), best, best_step)
    return table


class MetricsLogger:
    """Writes one JSON line per step and shows progress; optionally TensorBoard too.

    ``total_steps`` sizes the progress bar. ``progress=False`` shows nothing;
    otherwise a rich progress bar on a terminal, and elsewhere a plain line on the first
    step, every ``print_every`` steps (``log.every``), on steps with an evaluation and on
    the last. Printed messages are never wrapped (a path stays pasteable).
    ``resume_step``: continue a run restored at that step (later lines are dropped).
    A fresh logger refuses a run folder that already has metrics (that would mix two runs).
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, run_dir: str | os.PathLike[str], tensorboard: bool = False, *,
                 total_steps: int | None = None, progress: bool = True, print_every: int = 10,
                 resume_step: int | None = None, console: Console | None = None,
                 trackers: Sequence[Tracker] = ()):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.total_steps = total_steps
        self.print_every = max(1, print_every)
        # user text stays literal; soft_wrap: never broken at 80 columns when piped
        self.console = console or Console(markup=False, emoji=False, soft_wrap=True)
        self.records: list[dict[str, Any]] = []
        if resume_step is not None:
            dropped = truncate_metrics(self.path, resume_step)
            if dropped:
                self.console.print(f"metrics: dropped {dropped} line(s) after step {resume_step} "
                                   f"(resuming from its checkpoint)")
            if self.path.exists():
                self.records = read_metrics(self.path)
        elif self.path.exists() and self.path.stat().st_size > 0:
            raise FileExistsError(f"{self.path} already holds metrics: resume that run, or "
                                  f"choose a new run folder")
        self._file = open(self.path, "a", encoding="utf-8")
        # experiment trackers (trackers.open_trackers): each gets every numeric value of a record
        self._trackers = list(trackers)
        if tensorboard and not any(t.name == "tensorboard" for t in self._trackers):
            self._trackers.append(self._open_tensorboard(resume_step))
        self._times: deque[tuple[float, int]] = deque(maxlen=11)
        self._times.append((time.perf_counter(), resume_step if resume_step is not None else 0))
        self._first_step = (resume_step or 0) + 1  # the first step this logger trains: always shown
        self._shown: dict[str, Any] = {}
        for key in (GREEDY_ACC, SAMPLED_ACC):  # a resumed run shows its last evaluation
            value = _last_value(self.records, key)[0]
            if value is not None:
                self._shown[key] = value
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._plain = not self.console.is_terminal
        if progress and not self._plain:
            self._progress = Progress(
                TextColumn("{task.description}", style="bold", markup=False), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}"), console=self.console)
            self._progress.start()
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=resume_step or 0, stats="")
        self._show_plain = progress and self._plain
        self._closed = False

    # -- writing -------------------------------------------------------------------

    def _open_tensorboard(self, resume_step: int | None) -> Tracker:
        try:
            return TensorBoardTracker(self.run_dir, resume_step)
        except ImportError as exc:
            raise ImportError(
                "TensorBoard logging needs the tensorboard package: pip install "
                "'rldsl[tensorboard]' (or turn it off: log.tensorboard=false)") from exc

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append ``{"step": step, **metrics}`` to metrics.jsonl (flushed); return the record."""
        if self._closed:
            raise RuntimeError("MetricsLogger is closed")
        if "step" in metrics and metrics["step"] != step:
            raise ValueError(f"metrics carry step={metrics['step']!r} but log() got step={step}")
        record: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            if key != "step":
                record[str(key)] = sanitize(value)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        self.records.append(record)
        if self._trackers:
            values = numeric(record)
            for tracker in self._trackers:
                tracker.log(step, values)
        self._times.append((time.perf_counter(), step))
        self._show(record)
        return record

    def _seconds_per_step(self, record: Mapping[str, Any]) -> float | None:
        value = record.get(STEP_TIME)
        if isinstance(value, (int, float)):
            return float(value)
        (t0, s0), (t1, s1) = self._times[0], self._times[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 else None

    def _stats(self, record: Mapping[str, Any]) -> str:
        for key in (GREEDY_ACC, SAMPLED_ACC):  # evaluations are sparse: keep the last one shown
            if record.get(key) is not None:
                self._shown[key] = record[key]
        parts = []
        for key in (REWARD, GREEDY_ACC, SAMPLED_ACC, CLIP_FRACTION):
            value = self._shown.get(key) if key in (GREEDY_ACC, SAMPLED_ACC) else record.get(key)
            if value is not None:
                parts.append(f"{METRICS[key].label} {_fmt(value)}")
        sps = self._seconds_per_step(record)
        if sps is not None:
            parts.append(f"{sps:.2f} s/step")
        return " | ".join(parts)

    def _show(self, record: Mapping[str, Any]) -> None:
        step = record["step"]
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step, stats=self._stats(record))
        elif self._show_plain:
            has_eval = any(k.startswith("eval/") for k in record)
            last = self.total_steps is not None and step >= self.total_steps
            first = step == self._first_step
            if first or step % self.print_every == 0 or has_eval or last:
                total = f"/{self.total_steps}" if self.total_steps is not None else ""
                self.console.print(f"step {step}{total} | {self._stats(record)}",
                                   highlight=False, soft_wrap=True)
            else:
                self._stats(record)  # keep the latest accuracies for the next line

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """Print above the progress bar (plain print when there is none)."""
        self.console.print(*objects, **kwargs)

    # -- end -----------------------------------------------------------------------

    def summary(self, keys: Sequence[str] | None = None) -> Table:
        """:func:`summary_table` of everything logged in this run folder."""
        return summary_table(self.records, self.run_dir, keys)

    def print_summary(self, keys: Sequence[str] | None = None) -> None:
        """Stop the progress bar and print the summary table."""
        self._stop_progress()
        self.console.print(self.summary(keys))

    def _stop_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def close(self) -> None:
        """Stop the progress display, flush and close the file and the trackers."""
        if self._closed:
            return
        self._closed = True
        self._stop_progress()
        self._file.close()
        for tracker in self._trackers:
            tracker.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
