"""``rldsl run``: the training step and the loop around it (evaluation, checkpoints, resume).

One step, data flowing one way::

    prompts -> rollouts.generate (G per prompt, scored by the reward) -> [dynamic sampling rounds]
            -> trainers.estimate (old/ref logprobs, the spec's shaping, filters, advantages)
            -> trainers.update (minibatches, compiled loss) -> weight sync -> metrics, checkpoint

The step talks to the two sides of a :class:`~rldsl.runtime.run.build.Run` only, so it is the
same in one process and on Ray. Every rule it carries out (dynamic sampling, the pass-rate
cap) is the compiled algorithm's. Exact resume: sampling seeds come from (seed, step, round)
(rng.py); the prompt position, optimizer, scheduler, RNG states and the algorithm's own
state are restored from the checkpoint.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
import contextlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from ..records import checkpoint as ckpt
from .. import faults
from ..batch import RolloutBatch, StepRollout, group_rows, repeat_each
from .build import Plan, Run, build, load_spec, plan_run
from ..config import MODEL_RUN_DEFAULTS, RunConfig
from ..rollout.engines.base import SamplingParams
from ..errors import RewardError, RunError, WorkerError
from ..rollout.tool_metrics import tool_call_metrics
from ..rollout.agents.runner import agent_metrics
from ..records.metrics import throughput
from ..records.metrics import (ACCURACY, LR, PRODUCER_WAIT, RESPONSE_LENGTH, REWARD, REWARD_ERRORS,
                               REWARD_TERM_MEAN, REWARD_TERM_STD,
                               REWARD_HIDDEN, STALENESS_MAX, STALENESS_MEAN, STEP_TIME, TOKENS_PER_S,
                               TRUNCATED_FRACTION, MetricsLogger, time_key, timed)
from ..rewards.functions import RewardResult, term_labels
from ..records.rng import restore_rng, step_seed
from ..records.samples import SAMPLES_FILE, append_samples, sample_rows, truncate_samples
from .evaluation import answer_set, heldout_metrics, scored_by, scored_here, set_metrics, unscored_by
from ..rollout.producer import Produced, RolloutProducer, snapshot
from ..records.trackers import open_trackers
from ..records.run_dir import (METRICS_FILE, SPEC_FILE, load_run_config, run_dir_of, save_config,
                               save_parent_specs)
from ..train import inputs as rollout_inputs
from ..train.throughput import peak_flops
from ..models.loading import autocast_dtype


# ----------------------------------------------------------------------------- one step

def rollout_step(s: Run, step: int) -> StepRollout:
    """Generate and score P groups; with ``sampling dynamic`` keep drawing until P are informative.

    Dynamic sampling (verl's rule, ``sampling dynamic`` in the registry): rounds of P fresh
    prompts, keeping only the informative groups (scorable rewards not all equal; a failed,
    NaN reward is left out, never read as 0), until P are kept or ``max_rounds`` are spent.
    Still short, the step trains on the informative groups only (a smaller batch, logged as
    ``informative_groups`` < P, with a warning): a zero-variance group has A = 0 everywhere,
    and its tokens in the loss denominator would only shrink the gradient. With no
    informative group at all, the last round is kept as it is (every A = 0: no policy
    gradient; a pure policy-gradient loss then skips its optimizer step).
    """
    cfg = s.cfg
    P = cfg.rollout.prompts_per_step
    rounds = s.fn.data.dynamic_rounds
    kept: list[StepRollout] = []
    last: StepRollout | None = None
    n_kept = 0
    m = {time_key("rollout"): 0.0, time_key("reward"): 0.0}
    reward_errors = 0
    used = 0
    # the inputs the algorithm reads that the rollout makes (ReMax's greedy rewards, GDPO's [B, K] rewards)
    producers = rollout_inputs.rollout_producers(s.fn.algorithm)
    side = rollout_inputs.RolloutSide(s.rollouts.generate, [(t.name, t.weight) for t in s.reward.terms],
                                      cfg.max_new_tokens, s.warn, step, s.episodes, s.tokenizer) if producers else None
    timed_inputs: dict[str, float] = {p.time_metric: 0.0 for p in producers if p.time_metric}
    for r in range(rounds):
        used = r + 1
        examples = s.source.next_batch(P)
        reward_prompts = [e.reward_prompt for e in examples]  # rewards: the untemplated prompt
        faults.at("generate", step + 1)
        gen = s.rollouts.generate(s.rollout_prompts(examples), [e.answer for e in examples],
                                  SamplingParams.for_rollout(cfg, step_seed(cfg.seed, step, r)), reward_prompts)
        batch, scored = gen.batch, gen.scored
        batch.reward_terms = labelled_terms(scored)
        for p in producers:
            batch, t = p.make(side, batch, scored, examples)
            if p.time_metric:
                timed_inputs[p.time_metric] += t
        reward_errors += _warn_reward_errors(s, step, scored)
        m[time_key("rollout")] += gen.generate_s
        m[time_key("reward")] += gen.reward_s
        made = StepRollout(step, batch, [e.id for e in examples], reward_prompts, scored.rewards)
        if rounds == 1:
            kept.append(made)
            n_kept = P
            break
        last = made
        informative = s.fn.data.informative(scored.rewards.view(-1, batch.group_size)).tolist()
        take = [g for g, ok in enumerate(informative) if ok][: P - n_kept]
        if take:
            kept.append(_select_groups(made, take))
            n_kept += len(take)
        if n_kept >= P:
            break
    m.update({"sampling_rounds": float(used), REWARD_ERRORS: float(reward_errors)})
    m.update(timed_inputs)
    if rounds > 1:
        m["informative_groups"] = float(n_kept)
        if n_kept < P:
            s.warn(f"step {step}: dynamic sampling found {n_kept} informative group(s) of {P} in "
                   f"{rounds} rounds; "
                   + (f"training on those {n_kept} only (a smaller batch)" if n_kept else
                      "training on the last round's groups, all with zero advantage"))
        if not kept:
            assert last is not None
            kept.append(last)
    return StepRollout(step, RolloutBatch.concat([k.batch for k in kept], s.tokenizer.pad_token_id),
                       sum((k.prompt_ids for k in kept), []), sum((k.reward_prompts for k in kept), []),
                       torch.cat([k.scored for k in kept]), m)


def _select_groups(made: StepRollout, groups: list[int]) -> StepRollout:
    """The rollout of the given prompt groups (their rows, rewards and prompts)."""
    return StepRollout(made.step, made.batch.select_groups(groups), [made.prompt_ids[g] for g in groups],
                       [made.reward_prompts[g] for g in groups],
                       made.scored[group_rows(groups, made.batch.group_size)])


def _warn_reward_errors(s: Run, step: int, scored: RewardResult) -> int:
    """Warn about the samples whose reward failed (``reward.on_error=skip``); returns their count."""
    if scored.num_errors:
        s.warn(f"step {step}: {scored.num_errors} sample(s) skipped (reward failed); first:\n"
               f"{scored.first_error}")
    return scored.num_errors


def labelled_terms(scored: RewardResult) -> dict[str, torch.Tensor]:
    """Each reward term's values [B] by its label (``rewards/<label>/...``)."""
    labels = term_labels(list(scored.components))
    return {labels[name]: values for name, values in scored.components.items()}


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


def evaluate(s: Run, step: int) -> dict[str, float]:
    """The ``eval.data`` sets' metrics and the held-out split's (greedy, and sampled at the rollout
    temperature), every set answered by the one evaluator (run/evaluation.py)."""
    cfg = s.cfg
    out: dict[str, float] = {}
    n = cfg.eval.samples if cfg.eval.n is None else cfg.eval.n
    for es in s.eval_sets:  # scored here, each by its own reward
        sampled = SamplingParams.for_evaluation(cfg, n, step_seed(cfg.seed, step, 0, "eval sets")) if n else None
        a = answer_set(scored_here(unscored_by(s.rollouts), es.reward, s.episodes), es.examples,
                       max_new_tokens=cfg.max_new_tokens, sampled=sampled)
        out.update(set_metrics(es.name, a, es.reward))
    if s.heldout:
        out.update(evaluate_heldout(s, step))
    return out


def evaluate_heldout(s: Run, step: int) -> dict[str, float]:
    """Held-out accuracy: greedy, and sampled at the rollout temperature (``eval.samples``), scored
    where the rollouts score (the rollout workers on Ray)."""
    cfg = s.cfg
    sampled = SamplingParams.for_evaluation(cfg, cfg.eval.samples, step_seed(cfg.seed, step, 0, "eval")) \
        if cfg.eval.samples else None
    a = answer_set(scored_by(s.rollouts, s.episodes), s.heldout, max_new_tokens=cfg.max_new_tokens,
                   sampled=sampled)
    if a.failed:
        s.warn(f"step {step}: evaluation: {a.failed} held-out sample(s) whose reward failed "
               f"(counted as not correct in the accuracy, left out of the mean reward)")
    return heldout_metrics(a, s.reward, cfg.rollout.tool_parser)


def optimizer_note(cfg: RunConfig) -> str:
    """The run-start line naming the optimizer settings and where their defaults come from."""
    t = cfg.train
    note = f"optimizer: AdamW lr {t.lr:g}, betas ({t.betas[0]:g}, {t.betas[1]:g})"
    if cfg.model.path is None:
        return note + " (the toy's tuned defaults)"
    if t.lr == MODEL_RUN_DEFAULTS["train.lr"] and tuple(t.betas) == MODEL_RUN_DEFAULTS["train.betas"]:
        return note + " (defaults for a user's model, as TRL and verl; set train.lr / train.betas to change)"
    return note


def scoring_overlaps(s: Run) -> bool:
    """Whether an asynchronous run scores batch s while generating batch s + 1: when a step is one
    round of sampling and nothing else made at rollout time reads the rewards (dynamic sampling's
    later rounds and ReMax's greedy baseline need the scores first: those steps generate and
    score in one stage)."""
    return s.fn.data.dynamic_rounds == 1 and not rollout_inputs.rollout_producers(s.fn.algorithm)


class StepRollouts:
    """The batch maker of an asynchronous run's producer (rollout/producer.py): the batches of
    :func:`rollout_step`; where :func:`scoring_overlaps`, in two stages (the samples of a step,
    then their scores) with the same prompts, seeds and samples."""

    def __init__(self, s: Run, score_apart: bool) -> None:
        self.s, self.score_apart = s, score_apart

    def make(self, step: int) -> StepRollout:
        if not self.score_apart:
            return rollout_step(self.s, step)
        s, cfg = self.s, self.s.cfg
        examples = s.source.next_batch(cfg.rollout.prompts_per_step)
        reward_prompts = [e.reward_prompt for e in examples]
        faults.at("generate", step + 1)
        gen = s.rollouts.generate(s.rollout_prompts(examples), [e.answer for e in examples],
                                  SamplingParams.for_rollout(cfg, step_seed(cfg.seed, step, 0)),
                                  reward_prompts, score=False)
        return StepRollout(step, gen.batch, [e.id for e in examples], reward_prompts,
                           metrics={time_key("rollout"): gen.generate_s})

    def score(self, made: StepRollout) -> StepRollout:
        s = self.s
        faults.at("score", made.step + 1)
        m = dict(made.metrics)
        with timed(m, "reward"):
            scored = s.rollouts.score(made.batch, repeat_each(made.reward_prompts, made.batch.group_size))
        made.batch.reward_terms = labelled_terms(scored)
        m.update({"sampling_rounds": 1.0, REWARD_ERRORS: float(_warn_reward_errors(s, made.step, scored))})
        return dataclasses.replace(made, rewards=scored.rewards, metrics=m)

    def load_weights(self, weights: Any, version: int) -> None:
        self.s.rollouts.load_weights(weights, version)


def start_producer(s: Run, start: int, total: int) -> RolloutProducer[StepRollout] | None:
    """The rollout producer of an asynchronous run (rollout.max_staleness > 0), its engine holding
    the weights of step ``start``; None for the synchronous loop. Scoring runs in a stage of its
    own, beside generation, where :func:`scoring_overlaps` allows."""
    K = s.cfg.rollout.max_staleness
    if K == 0:
        return None
    r = s.cfg.rollout
    apart = scoring_overlaps(s)
    producer = RolloutProducer(StepRollouts(s, apart), max_staleness=K, next_step=start, last_step=total,
                               loaded_version=start, loaded_weights=snapshot(s.trainers.weights()),
                               queued=s.queued, score_apart=apart, newest=r.partial, start=False)
    if r.partial:  # one process (checked at start): the engine loads newer weights between segments
        s.rollouts.sample_in_segments(r.partial_tokens or max(1, s.cfg.max_new_tokens // 4), producer.refresh)
    producer.start()
    return producer


def evaluate_current(s: Run, step: int, producer: RolloutProducer[StepRollout] | None) -> dict[str, float]:
    """:func:`evaluate` with the trainer's current weights: an asynchronous run pauses its
    producer, evaluates with them, and gives the engine back the version it was generating with."""
    if producer is None:
        return evaluate(s, step)
    with producer.paused():
        s.rollouts.load_weights(snapshot(s.trainers.weights()), step)
        try:
            return evaluate(s, step)
        finally:
            s.rollouts.load_weights(producer.loaded_weights, producer.loaded_version)


def staleness(batch: RolloutBatch, step: int, version: int) -> dict[str, float]:
    """Policy versions between ``step`` and the tokens of its batch, mean and max over the model's
    tokens: from each token's version (partial rollouts), else the batch's one ``version``."""
    tv, mask = batch.token_versions, batch.response_mask.bool()
    if tv is None or not bool(mask.any()):
        return {STALENESS_MEAN: float(step - version), STALENESS_MAX: float(step - version)}
    lag = (step - tv[mask]).float()
    return {STALENESS_MEAN: float(lag.mean()), STALENESS_MAX: float(lag.max())}


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
        if producer.score_apart:  # scored in a stage of its own, beside generation
            m[REWARD_HIDDEN] = item.hidden_s
    rewards = r.scored
    # ESTIMATE: old / reference logprobs, values, the spec's shaping, filters and advantages
    with timed(m, "logprobs"):
        tb = s.trainers.estimate(r.batch, rewards)
    # PASS-RATE CAP: retire the prompts the spec calls solved
    if s.fn.data.pass_rate_cap is not None:
        m["retired_prompts"] = float(_retire_solved(s, r))
    m.update(s.source.observe(r.prompt_ids, rewards.view(-1, r.batch.group_size)))  # per-task metrics, curriculum
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
            producer.publish(step + 1, snapshot(s.trainers.weights()))
    # RECORD: the step's metrics and samples
    m.update(step_metrics(s, r, time.perf_counter() - t_start))
    m.update({k: v for k, v in tb.metrics.items() if k != REWARD})  # REWARD: the step's own
    m.update(reward_term_metrics(r.batch.reward_terms))
    m.update(tool_call_metrics(r.batch, cfg.rollout.tool_parser))  # episodes with tools only
    m.update(agent_metrics(r.batch))  # rollout.agent episodes only
    m.update(um)
    m.update(throughput(m, peak_flops(cfg.device, autocast_dtype(cfg.model.dtype), cfg.train.peak_flops),
                        float(r.batch.response_mask.sum())))
    if cfg.log.samples_per_step:
        adv, mask = getattr(tb, "advantages", None), getattr(tb, "mask", None)  # None on Ray ranks
        append_samples(s.run_dir, sample_rows(step + 1, r.batch, rewards,
                                              None if adv is None else adv.cpu(),
                                              None if mask is None else mask.cpu(), cfg.log.samples_per_step))
    return m


def _retire_solved(s: Run, r: StepRollout) -> int:
    """Retire the prompts whose pass rate reached the cap (NaN rewards left out) unless that would
    leave no prompt to train on; returns how many are retired in all."""
    retired = s.fn.data.retire(r.scored.view(-1, r.batch.group_size)).tolist()  # p >= cap
    retire = [pid for pid, done in zip(r.prompt_ids, retired) if done]
    if retire and len(s.source) - len(set(retire) - s.source.excluded) > 0:
        s.source.exclude(retire)
    return len(s.source.excluded)


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


# ----------------------------------------------------------------------------- checkpoints

def _extra_state(s: Run, step: int, algorithm: dict[str, Any],
                 queued: list[Produced[StepRollout]] | None = None) -> dict[str, Any]:
    extra = {"step": step, "data": s.source.state_dict(), "algorithm": algorithm}
    if queued is not None:  # asynchronous rollouts: the batches generated ahead, as plain values
        extra["queued"] = [{"step": p.step, "version": p.version, "batch": _plain_batch(p.value.batch),
                            "rewards": p.value.rewards, "ids": p.value.prompt_ids, "metrics": p.value.metrics}
                           for p in queued]
    return extra


def _plain_batch(batch: RolloutBatch) -> dict[str, Any]:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


def restored_queue(extra: dict[str, Any]) -> list[Produced[StepRollout]]:
    """The batches a checkpoint of an asynchronous run had generated ahead (scored)."""
    return [Produced(q["step"], q["version"], StepRollout(q["step"], RolloutBatch(**q["batch"]), q["ids"], [],
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
                                    extra_state=_extra_state(s, step, t.algorithm, queued),
                                    keep_last=s.cfg.checkpoint.keep_last or None)
    finally:
        if producer is not None:
            producer.resume()


def restore(s: Run, path: Path) -> int:
    """Load checkpoint ``path``; returns its step (and keeps the batches an asynchronous run had
    generated ahead in ``s.queued``)."""
    c = ckpt.load_checkpoint(path)
    s.trainers.load_checkpoint(c)  # weights, critic, algorithm state, optimizers, scheduler
    s.source.load_state_dict(c.extra["data"])
    s.queued = restored_queue(c.extra)
    s.rollouts.load_weights(s.trainers.weights(), c.step)
    restore_rng(c.rng)  # last: no draw between the restore and the next step
    return c.step


@contextmanager
def _interrupt_guard() -> Iterator[dict[str, bool]]:
    """Ctrl-C (SIGINT) and SIGTERM stop the run at the end of the step in hand, which is then
    checkpointed (``flag["hit"]``, read by the loop between steps). A run's state is whole only
    between steps: mid-step, an update may be half applied, the data position moved on, an
    asynchronous batch taken from its queue. A second signal raises KeyboardInterrupt at once
    and nothing is saved (the newest checkpoint on disk is complete). A SIGINT that the process
    was started ignoring (a background job of a shell script) stays ignored."""
    flag = {"hit": False}

    def handler(signum: int, frame: Any) -> None:
        if flag["hit"]:
            raise KeyboardInterrupt
        flag["hit"] = True
        os.write(2, b"\nstopping at the end of this step to save a checkpoint "
                    b"(signal again to stop at once, without one)\n")

    old: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        current = signal.getsignal(sig)
        if current == signal.SIG_IGN:
            continue
        try:
            signal.signal(sig, handler)
        except ValueError:  # not the main thread: signals stay as they are
            break
        old[sig] = current
    try:
        yield flag
    finally:
        for sig, current in old.items():
            signal.signal(sig, current)


def _start_again(run_dir: Path) -> list[str]:
    """A run resumed without a complete checkpoint (killed before its first one was written)
    starts again from step 0 with its saved config: the records of the killed attempt go (the
    run writes them again). Returns the lines telling the user so."""
    for name in (METRICS_FILE, SAMPLES_FILE):
        with contextlib.suppress(FileNotFoundError):
            (run_dir / name).unlink()
    ckpt.remove_checkpoints_after(run_dir, -1)  # damaged ones, if any (listed in the notes)
    ckpt.clean_incomplete(run_dir)
    return [f"{run_dir} holds no complete checkpoint (the run stopped before its first one was "
            f"written): starting it again from step 0 with its saved config"]


def _shut_down(producer: RolloutProducer[StepRollout] | None, s: Run, quiet: bool) -> None:
    """Stop the producer and the run's workers. ``quiet`` (an error is on its way out): an error
    while stopping is printed, never raised, so it cannot hide the one that stopped the run."""
    first: BaseException | None = None
    for stop in ([producer.close] if producer is not None else []) + [s.close]:
        try:
            stop()
        except Exception as exc:  # noqa: BLE001 - reported below
            if quiet:
                print(f"while stopping the run: {type(exc).__name__}: {exc}", file=sys.stderr)
            first = first or exc
    if first is not None and not quiet:
        raise first


# ----------------------------------------------------------------------------- the run

def checked(plan: Plan) -> Plan:
    """``plan`` once the rollout-stage inputs the spec reads can be made in this run (e.g. per-turn
    rewards need a reward term that gives them, and turns): refused before any model loads."""
    rollout_inputs.check_rollout_inputs(plan.algo, [(t.name, t.weight) for t in plan.reward.terms],
                                        plan.cfg.rollout.env is not None or plan.cfg.rollout.tools is not None)
    return plan


def train(spec: str, cfg: RunConfig | None = None, resume: str | Path | None = None,
          stop_after: int | None = None) -> Path:
    """Run (or resume) training; returns the run folder.

    ``stop_after``: stop (with a checkpoint) once this many steps are done in total — used by
    tests to interrupt a run at a known point. ``resume``: continue that run folder from its
    newest whole checkpoint (a damaged newer one is passed over, saying so); a folder with none
    (the run was killed before its first one) starts again from step 0 with its saved config.
    Ctrl-C / SIGTERM: see :func:`_interrupt_guard`.
    """
    if resume is not None:
        run_dir = Path(resume)
        if not run_dir.is_dir():
            raise RunError(f"no run folder {run_dir} to resume")
        saved = load_run_config(run_dir)
        spec_file = run_dir / SPEC_FILE
        plan = checked(plan_run(load_spec(str(spec_file), spec_file.read_text(encoding="utf-8")),
                                saved if cfg is None else cfg))
        if plan.cfg != saved:
            save_config(plan.cfg, run_dir)  # config.json shows what actually runs
        start = None
        resume_from, notes = ckpt.newest_loadable(run_dir)
        if resume_from is None:
            notes += _start_again(run_dir)
            start, resume = 0, None
    else:
        cfg = cfg or RunConfig()
        algo = load_spec(spec)  # the one parse of the run
        run_dir = run_dir_of(cfg, algo.name)
        if (run_dir / METRICS_FILE).exists() or ckpt.latest_checkpoint(run_dir) is not None:
            raise RunError(f"{run_dir} already holds a run: resume it with `rldsl run --resume {run_dir}` "
                           f"or choose another --out")
        plan = checked(plan_run(algo, cfg))  # every check before a model loads
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(plan.cfg, run_dir, algo.source)  # the resolved config: what runs
        save_parent_specs(run_dir, algo.parent_sources)
        start, notes = 0, []
    cfg = plan.cfg
    s = build(plan, run_dir)
    producer: RolloutProducer[StepRollout] | None = None
    failed = True
    try:
        if start is None:
            start = restore(s, resume_from)
            ckpt.remove_checkpoints_after(run_dir, start)
            truncate_samples(run_dir, start)
        total = cfg.train.steps
        resume_step = start if resume is not None else None
        trackers = open_trackers(cfg.log.report_to, run_dir, config=cfg.model_dump(mode="json"),
                                 spec_text=(run_dir / SPEC_FILE).read_text(encoding="utf-8"),
                                 project=cfg.log.project, resume_step=resume_step)
        logger = MetricsLogger(run_dir, tensorboard=cfg.log.tensorboard, total_steps=total,
                               progress=cfg.log.progress, print_every=cfg.log.every,
                               resume_step=resume_step, trackers=trackers)
        step = start
        last_saved = start if resume is not None else -1
        s.warn = lambda msg: logger.print(msg, markup=False)
        for w in s.warnings:  # legal but almost surely a slip (checked before the models loaded)
            logger.print(w.render(), markup=False, soft_wrap=True)
        for note in notes + s.notes:  # what the run resolved: the reward, a clipped budget, ...
            logger.print(note, markup=False, soft_wrap=True)
        in_step = False  # between two steps, the only place the run's state is whole
        with logger, _interrupt_guard() as stop:
            try:
                if start == 0:
                    logger.print(optimizer_note(cfg), markup=False)
                    if cfg.eval.every:  # 0: no evaluation at all
                        logger.log(0, evaluate(s, 0))
                producer = start_producer(s, start, total)
                unscored_steps = 0  # steps in a row whose every reward failed (reward.on_error=skip)
                while step < total:
                    if stop_after is not None and step >= stop_after:
                        break
                    if stop["hit"]:  # Ctrl-C or SIGTERM during the last step: saved below
                        raise KeyboardInterrupt
                    in_step = True
                    m = train_step(s, step, producer)
                    step += 1
                    if cfg.eval.every and (step % cfg.eval.every == 0 or step == total):
                        m.update(evaluate_current(s, step, producer))
                    logger.log(step, m)
                    unscored_steps = unscored_steps + 1 if math.isnan(m[REWARD]) else 0
                    if cfg.reward.max_skipped_steps and unscored_steps >= cfg.reward.max_skipped_steps:
                        raise RewardError(
                            f"the reward failed on every sample of {unscored_steps} steps in a row (steps "
                            f"{step - unscored_steps + 1}-{step}; reward.on_error=skip skipped them all): "
                            f"nothing to train on. The warnings above show each step's first failure; fix "
                            f"the reward, or raise reward.max_skipped_steps (0 = never stop)")
                    if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                        save(s, step, producer)
                        last_saved = step
                    faults.at("step", step)
                    in_step = False
                if last_saved != step and (cfg.checkpoint.save_final or step < total):
                    save(s, step, producer)
            except KeyboardInterrupt:  # `rldsl run` names the command that resumes it (runtime/cli.py)
                if in_step:  # a second signal, mid-step: nothing whole to save
                    logger.print(f"stopped during step {step + 1} without saving it")
                    raise
                if last_saved != step:
                    save(s, step, producer)
                raise
            logger.print_summary()
        failed = False
    except WorkerError as exc:  # an actor died or timed out: the checkpoints on disk are complete
        last = ckpt.latest_checkpoint(run_dir)
        hint = (f"the run folder holds complete checkpoint {last.name}: continue with "
                f"`rldsl run --resume {run_dir}` (--trainers may differ)" if last is not None
                else f"no checkpoint was written yet: `rldsl run --resume {run_dir}` starts it again from step 0")
        raise WorkerError(f"{exc}\n{hint}") from None
    finally:
        _shut_down(producer, s, quiet=failed)
    return run_dir
