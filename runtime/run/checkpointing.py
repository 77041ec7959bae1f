"""A run's state in its checkpoints: :func:`save` (with an asynchronous run's batches generated
ahead) and :func:`restore` (starting again without one: run/folder.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..batch import Episode, RolloutBatch, StepRollout
from ..records import checkpoint as ckpt
from ..records.rng import restore_rng
from ..records.samples import truncate_samples
from ..rollout.producer import Produced, RolloutProducer
from .state import Run


def _extra_state(s: Run, step: int, algorithm: dict[str, Any],
                 queued: list[Produced[StepRollout]] | None = None,
                 teacher: dict[str, Any] | None = None,
                 loss_scale: dict[str, float] | None = None) -> dict[str, Any]:
    extra = {"step": step, "data": s.prompts.state_dict(), "algorithm": algorithm}
    if teacher is not None:  # teacher.ema: the EMA teacher's weights
        extra["teacher_ema"] = teacher
    if loss_scale is not None:  # model.dtype=float16: the loss scale and its count of finite steps
        extra["loss_scale"] = loss_scale
    if getattr(s, "prompt_stats", None) is not None:  # the per-prompt statistics a spec reads (prompt_mean, ...)
        extra["prompt_stats"] = s.prompt_stats.state_dict()
    if getattr(s, "replay", None) is not None:  # sampling replay: the kept groups, as plain values (rollout/replay.py)
        extra["replay"] = s.replay.state_dict(_plain_batch)
    if queued is not None:  # asynchronous rollouts: the batches generated ahead, as plain values
        extra["queued"] = [{"step": p.step, "version": p.version, "batch": _plain_batch(p.value.batch),
                            "rewards": p.value.rewards, "ids": p.value.prompt_ids, "metrics": p.value.metrics}
                           for p in queued]
    return extra


def _plain_batch(batch: RolloutBatch) -> dict[str, Any]:
    """The batch's fields as plain values (tensors, lists, dicts: what ``torch.load(weights_only=True)``
    reads), its episodes as dicts (``Episode.plain``); :func:`_batch_of` reads it back."""
    plain = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return {**plain, "episodes": [e.plain() for e in batch.episodes]}


def _batch_of(plain: dict[str, Any]) -> RolloutBatch:
    return RolloutBatch(**{**plain, "episodes": [Episode.from_plain(e) for e in plain.get("episodes", [])]})


def restored_queue(extra: dict[str, Any]) -> list[Produced[StepRollout]]:
    """The batches a checkpoint of an asynchronous run had generated ahead (scored)."""
    return [Produced(q["step"], q["version"], StepRollout(q["step"], _batch_of(q["batch"]), q["ids"], [],
                                                          q["rewards"], q["metrics"]))
            for q in extra.get("queued", [])]


def save(s: Run, step: int, producer: RolloutProducer[StepRollout] | None = None) -> Path:
    """Checkpoint ``step``; with a producer, after it has generated every batch the published
    weights allow (those batches are saved with it), paused until the save is done."""
    queued = producer.drain() if producer is not None else None
    try:
        t = s.trainers.checkpoint_state()  # distributed: full state dicts gathered from the ranks
        return ckpt.save_checkpoint(s.run_dir, step, policy=t.policy, tokenizer=s.tokenizer,
                                    optimizer=t.optimizer, scheduler=t.scheduler,
                                    critic=t.critic, critic_optimizer=t.critic_optimizer,
                                    extra_state=_extra_state(s, step, t.algorithm, queued, t.teacher, t.loss_scale),
                                    keep_last=s.cfg.checkpoint.keep_last or None)
    finally:
        if producer is not None:
            producer.resume()


def restore(s: Run, path: Path) -> int:
    """Load checkpoint ``path``; returns its step (and keeps the batches an asynchronous run had
    generated ahead in ``s.queued``). What the run folder holds after that step: newer (damaged)
    checkpoints are set aside as ``damaged-step-N``, the sample rows of later steps go (the run
    writes them again)."""
    c = ckpt.load_checkpoint(path)
    s.trainers.load_checkpoint(c)  # weights, critic, algorithm state, optimizers, scheduler
    s.prompts.load_state_dict(c.extra["data"])
    s.queued = restored_queue(c.extra)
    if getattr(s, "prompt_stats", None) is not None and "prompt_stats" in c.extra:
        s.prompt_stats.load_state_dict(c.extra["prompt_stats"])
    if getattr(s, "replay", None) is not None:
        s.replay.load_state_dict(c.extra.get("replay", {"seq": 0, "entries": []}), _batch_of)
    s.rollouts.load_weights(s.trainers.weights(), c.step)
    restore_rng(c.rng)  # last: no draw between the restore and the next step
    ckpt.set_aside_after(s.run_dir, c.step)  # newer, damaged ones (passed over, said): kept aside
    truncate_samples(s.run_dir, c.step)  # the sample rows of steps after it are written again
    return c.step
