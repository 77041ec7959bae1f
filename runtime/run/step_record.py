"""The step's record: its metrics (under the names of records/metrics.py) and its sample rows
in samples.jsonl, made from the step's batch, the trainer's estimate and update."""
from __future__ import annotations

from typing import Any

import torch

from ..batch import RolloutBatch, StepRollout
from ..models.loading import autocast_dtype
from ..records.metrics import (ACCURACY, LR, RESPONSE_LENGTH, REWARD, REWARD_TERM_MEAN, REWARD_TERM_STD,
                               STALENESS_MAX, STALENESS_MEAN, STEP_TIME, TOKENS_PER_S, TRUNCATED_FRACTION,
                               throughput)
from ..records.samples import append_samples, sample_rows
from ..rollout.agents.runner import agent_metrics
from ..rollout.tool_metrics import tool_call_metrics
from ..train.throughput import peak_flops
from .state import Run


def record_step(s: Run, r: StepRollout, tb: Any, um: dict[str, float], m: dict[str, float], step_s: float) -> None:
    """Add the step's metrics to ``m`` (which holds its timings and rollout metrics already) and
    append its sample rows: the rollout's reward, accuracy, lengths and time, the estimate's
    metrics (``tb.metrics``: its REWARD aside, the step's own is the rollout's), each reward
    term's, the tool calls' and agents' (episodes only), the update's (``um``), throughput."""
    cfg = s.cfg
    fresh = r.generated  # sampling replay: the rollout's metrics are of the groups this step generated
    m.update(step_metrics(s, fresh, step_s))
    m.update({k: v for k, v in tb.metrics.items() if k != REWARD})
    m.update(reward_term_metrics(fresh.batch.reward_terms))
    m.update(tool_call_metrics(fresh.batch, cfg.rollout.tool_parser))  # episodes with tools only
    m.update(agent_metrics(fresh.batch))  # rollout.agent episodes only
    m.update(um)
    m.update(throughput(m, peak_flops(cfg.device, autocast_dtype(cfg.model.dtype), cfg.train.peak_flops),
                        float(r.batch.response_mask.sum())))
    if cfg.log.samples_per_step:
        adv, mask = getattr(tb, "advantages", None), getattr(tb, "mask", None)  # None on Ray ranks
        append_samples(s.run_dir, sample_rows(r.step + 1, r.batch, r.scored,
                                              None if adv is None else adv.cpu(),
                                              None if mask is None else mask.cpu(), cfg.log.samples_per_step,
                                              ages=r.replay_ages))


def step_metrics(s: Run, r: StepRollout, step_s: float) -> dict[str, float]:
    """The step's rollout metrics: mean reward and accuracy over the scorable samples, length,
    truncation, learning rate, time and throughput."""
    batch, rewards = r.batch, r.scored
    finite = torch.isfinite(rewards)
    tokens = float(batch.response_mask.sum() + batch.prompt_mask.sum())
    return {
        REWARD: float(rewards[finite].mean()) if finite.any() else float("nan"),
        ACCURACY: float(s.reward.correct(rewards[finite]).float().mean()) if finite.any() else float("nan"),
        RESPONSE_LENGTH: float(batch.response_mask.sum(-1).float().mean()),
        TRUNCATED_FRACTION: float(batch.truncated.float().mean()),
        LR: s.trainers.lr,
        STEP_TIME: step_s,
        TOKENS_PER_S: tokens / max(step_s, 1e-9),
    }


def reward_term_metrics(terms: dict[str, torch.Tensor]) -> dict[str, float]:
    """``rewards/<term>/mean`` and ``rewards/<term>/std`` (TRL's names) of each reward term over
    the step's samples it scored (a failed sample, NaN, is left out; std with Bessel's correction,
    as TRL's, NaN for fewer than two samples)."""
    out: dict[str, float] = {}
    for label, values in terms.items():
        v = values[torch.isfinite(values)].double()
        out[REWARD_TERM_MEAN.format(term=label)] = float(v.mean()) if len(v) else float("nan")
        out[REWARD_TERM_STD.format(term=label)] = float(v.std()) if len(v) > 1 else float("nan")
    return out


def staleness(batch: RolloutBatch, step: int, version: int) -> dict[str, float]:
    """Policy versions between ``step`` and the tokens of its batch, mean and max over the model's
    tokens: from each token's version (partial rollouts), else the batch's one ``version``."""
    tv, mask = batch.token_versions, batch.response_mask.bool()
    if tv is None or not bool(mask.any()):
        return {STALENESS_MEAN: float(step - version), STALENESS_MAX: float(step - version)}
    lag = (step - tv[mask]).float()
    return {STALENESS_MEAN: float(lag.mean()), STALENESS_MAX: float(lag.max())}
