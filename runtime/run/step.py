"""One training step, phase by phase: ROLLOUT (the step's batch, generated now or ahead by the
producer), ESTIMATE, PASS-RATE CAP, UPDATE, SYNC, RECORD. It talks to the two sides of a
:class:`~rldsl.runtime.run.state.Run` only, so it is the same in one process and on Ray."""
from __future__ import annotations

import time

from .. import faults
from ..batch import StepRollout
from ..records.metrics import PRODUCER_WAIT, REWARD_HIDDEN, timed
from ..records.rng import step_seed
from ..rollout.producer import RolloutProducer
from .state import Run
from .step_record import record_step, staleness
from .step_batch import rollout_step, with_replay


def train_step(s: Run, step: int, producer: RolloutProducer[StepRollout] | None = None) -> dict[str, float]:
    """One full step; returns its metrics. With a ``producer`` (rollout.max_staleness > 0) the
    batch was generated ahead by an older policy, and the new weights are published to it
    instead of synced."""
    cfg = s.cfg
    t_start = time.perf_counter()
    # ROLLOUT: the step's batch, scored (generated now, or ahead by the producer)
    if producer is None:
        r = rollout_step(s, step)
        m = dict(r.metrics)
    else:
        waited: dict[str, float] = {}
        with timed(waited, "trainer_wait"):
            item = producer.get(step)
        r = item.value
        m = {**r.metrics, **staleness(r.batch, step, item.version), **waited, PRODUCER_WAIT: item.wait_s}
        if getattr(s, "replay", None) is not None:  # sampling replay: the buffer lives where the step is assembled
            r = with_replay(s, r, step, item.version)
            m.update(r.metrics)
        if producer.score_apart:  # scored in a stage of its own, beside generation
            m[REWARD_HIDDEN] = item.hidden_s
    rewards = r.scored
    # ESTIMATE: old / reference logprobs, values, the spec's shaping, filters and advantages
    with timed(m, "logprobs"):
        tb = s.trainers.estimate(r.batch, rewards)
    replay = getattr(s, "replay", None)
    if replay is not None and replay.keeps_advantages:  # the advantages of the entries' first training
        advantages = getattr(tb, "advantages", None)  # None on Ray: the batch stays on the ranks
        replay.trained(s.trainers.advantages() if advantages is None else advantages, r.batch.replayed)
    # PASS-RATE CAP: retire the prompts the spec calls solved
    # (both read the groups this step generated: a replayed group's rewards are an older policy's)
    fresh = r.generated
    if s.fn.data.pass_rate_cap is not None:
        m["retired_prompts"] = float(_retire_solved(s, fresh))
    # per-task metrics, curriculum
    m.update(s.prompts.observe(fresh.prompt_ids, fresh.scored.view(-1, fresh.batch.group_size)))
    # UPDATE: minibatches of the compiled loss, then the LR-schedule step
    faults.at("update", step + 1)
    with timed(m, "update"):
        um = s.trainers.update(tb, step_seed(cfg.seed, step, 0, "minibatch"))
    # SYNC: the new weights to the engine (an asynchronous run: published; the producer loads them)
    faults.at("sync", step + 1)
    with timed(m, "sync"):
        if producer is None:  # policy version step + 1: the weights after this step's update
            s.rollouts.load_weights(s.trainers.weights(), step + 1)
        else:
            producer.publish(step + 1, s.trainers.weights().snapshot())
    sent = getattr(s.trainers, "sync_bytes", None)  # the weights' bytes sent to each engine
    if sent is not None:
        m["sync/bytes"] = float(sent)
    # RECORD: the step's metrics and samples
    record_step(s, r, tb, um, m, time.perf_counter() - t_start)
    return m


def _retire_solved(s: Run, r: StepRollout) -> int:
    """Retire the prompts whose pass rate reached the cap (NaN rewards left out) unless that would
    leave no prompt to train on; returns how many are retired in all."""
    retired = s.fn.data.retire(r.scored.view(-1, r.batch.group_size)).tolist()  # p >= cap
    retire = [pid for pid, done in zip(r.prompt_ids, retired) if done]
    if retire and len(s.prompts) - len(set(retire) - s.prompts.excluded) > 0:
        s.prompts.exclude(retire)
    return len(s.prompts.excluded)
