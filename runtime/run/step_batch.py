"""The step's batch: P prompt groups generated and scored now (:func:`rollout_step`, with
dynamic sampling's rounds), or ahead by an asynchronous run's producer (:func:`start_producer`:
the same batches, made by :class:`StepRollouts` in the producer's threads). Either way the
trainer gets one :class:`~rldsl.runtime.batch.StepRollout` per step."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import faults
from ..batch import RolloutBatch, StepRollout, group_rows, repeat_each
from ..records.metrics import REWARD_ERRORS, REWARD_TIMEOUTS, time_key, timed
from ..records.rng import step_seed
from ..rollout.engines.base import SamplingParams
from ..rollout.producer import RolloutProducer
from ..train.inputs import RolloutSide, reads_answers, rollout_producers, teacher_prompts
from .state import Run


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
    reward_errors = reward_timeouts = 0
    used = 0
    # the inputs the algorithm reads that the rollout makes (ReMax's greedy rewards, GDPO's [B, K] rewards)
    producers = rollout_producers(s.fn.algorithm)
    logged = step + 1  # the step's number in metrics.jsonl and the console (``step`` counts from 0)
    timed_inputs: dict[str, float] = {p.time_metric: 0.0 for p in producers if p.time_metric}
    # sampling replay: a Run has a buffer (None without); an asynchronous run's is stepped by the
    # trainer (run/step.py), where the step is assembled, not here in the producer's thread
    replay = getattr(s, "replay", None) if cfg.rollout.max_staleness == 0 else None
    for r in range(rounds):
        used = r + 1
        examples = s.prompts.next_batch(fresh_groups(s, replay))
        reward_prompts = [e.reward_prompt for e in examples]  # rewards: the untemplated prompt
        faults.at("generate", logged)
        params = dataclasses.replace(SamplingParams.for_rollout(cfg, step_seed(cfg.seed, step, r)),
                                     tree=s.fn.data.tree_shape)  # sampling tree: its shape (None: plain)
        gen = s.rollouts.generate(s.rollout_prompts(examples), [e.answer for e in examples], params, reward_prompts)
        batch, scored = gen.batch, gen.scored
        batch.reward_terms = scored.labelled_terms()
        teacher_prompts(s.cfg, s.tokenizer, batch, examples)
        side = _rollout_side(s, step, r) if producers else None
        for p in producers:
            batch, t = p.make(side, batch, scored, examples)
            if p.time_metric:
                timed_inputs[p.time_metric] += t
        if scored.num_errors:  # reward.on_error=skip: the samples skipped, said
            s.warn(scored.error_warning(logged))
        reward_errors += scored.num_errors
        reward_timeouts += scored.num_timeouts
        m[time_key("rollout")] += gen.generate_s
        m[time_key("reward")] += gen.reward_s
        made = StepRollout(step, batch, [e.id for e in examples], reward_prompts, scored.rewards)
        if replay is not None:  # sampling replay (rollout/replay.py): kept groups in, replayed ones out
            made = with_replay(s, made, step, step)
            m.update(made.metrics)
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
    m.update({"sampling_rounds": float(used), REWARD_ERRORS: float(reward_errors),
              REWARD_TIMEOUTS: float(reward_timeouts)})
    m.update(timed_inputs)
    if rounds > 1:
        m["informative_groups"] = float(n_kept)
        if n_kept < P:
            s.warn(f"step {logged}: dynamic sampling found {n_kept} informative group(s) of {P} in "
                   f"{rounds} rounds; "
                   + (f"training on those {n_kept} only (a smaller batch)" if n_kept else
                      "training on the last round's groups, all with zero advantage"))
        if not kept:
            assert last is not None
            kept.append(last)
    if len(kept) == 1:  # one round: its rollout as made (with replay, its fresh groups and ages)
        return dataclasses.replace(kept[0], metrics=m)
    return StepRollout(step, RolloutBatch.concat([k.batch for k in kept], s.tokenizer.pad_token_id),
                       sum((k.prompt_ids for k in kept), []), sum((k.reward_prompts for k in kept), []),
                       torch.cat([k.scored for k in kept]), m)


def fresh_groups(s: Run, replay: Any) -> int:
    """How many prompt groups a step generates: P, less the groups ``use=mix`` takes from the
    replay buffer -- as the buffer holds them now in a synchronous run (``replay``: the run's
    buffer), or from the policy alone in an asynchronous run's producer (``replay`` None), which
    makes batches ahead of the trainer and never reads the buffer (the trainer draws the share
    at the step: :func:`with_replay`)."""
    P = s.cfg.rollout.prompts_per_step
    if replay is not None:
        return replay.fresh_groups(P)
    policy = s.fn.data.replay_policy
    return P if policy is None else P - policy.mixed(P)


def with_replay(s: Run, made: StepRollout, step: int, version: int) -> StepRollout:
    """The step's batch through the run's replay buffer (rollout/replay.py): its groups that pass
    ``enter`` kept, replayed ones in; ``version`` is the policy that sampled ``made`` (an
    asynchronous run's may be older than ``step``'s: its batch was made ahead, and a ``use=mix``
    share is drawn here against ``step``), the metrics gain ``replay/*``."""
    P = s.cfg.rollout.prompts_per_step
    informative = s.fn.data.informative(made.scored.view(-1, made.batch.group_size))
    out, m = s.replay.step(made, version, informative, P,
                           torch.Generator().manual_seed(step_seed(s.cfg.seed, step, 0, "replay")), now=step,
                           ahead=s.cfg.rollout.max_staleness > 0)
    return dataclasses.replace(out, metrics={**made.metrics, **m})


def _rollout_side(s: Run, step: int, round_: int) -> RolloutSide:
    """What the rollout-stage producers read of the run in round ``round_`` of ``step``: the reference
    model's sampling (a spec reading ref_reward) is the rollout's, ``reward.reference_samples`` per
    prompt, with a seed of its own for each round; a spec reading answer_prob scores with the trainer's
    policy (the one that sampled: the run is synchronous)."""
    cfg = s.cfg
    reference = getattr(s, "reference", None)  # a Run has one (None unless the spec reads ref_reward)
    params = dataclasses.replace(SamplingParams.for_rollout(cfg, step_seed(cfg.seed, step, round_, "reference")),
                                 n=cfg.reward.reference_samples)
    # a spec reading answer_prob: the policy that sampled scores the reference answers (in process:
    # resolve.check_answers refused the rest)
    answers = reads_answers(s.fn.algorithm)
    return RolloutSide(s.rollouts.generate, [(t.name, t.weight) for t in s.reward.terms], cfg.max_new_tokens,
                       s.warn, step + 1, s.multi_turn, s.tokenizer, s.fn.algorithm.group_by, s.prompt_stats,
                       None if reference is None else reference.generate, params,
                       score=s.trainers.response_logprobs if answers else None,
                       answer_tags=tuple(cfg.reward.answer_tags))


def _select_groups(made: StepRollout, groups: list[int]) -> StepRollout:
    """The rollout of the given prompt groups (their rows, rewards and prompts)."""
    return StepRollout(made.step, made.batch.select_groups(groups), [made.prompt_ids[g] for g in groups],
                       [made.reward_prompts[g] for g in groups],
                       made.scored[group_rows(groups, made.batch.group_size)])


def scoring_overlaps(s: Run) -> bool:
    """Whether an asynchronous run scores batch s while generating batch s + 1: when a step is one
    round of sampling and nothing else made at rollout time reads the rewards (dynamic sampling's
    later rounds and ReMax's greedy baseline need the scores first: those steps generate and
    score in one stage)."""
    return s.fn.data.dynamic_rounds == 1 and not rollout_producers(s.fn.algorithm)


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
        examples = s.prompts.next_batch(fresh_groups(s, None))
        reward_prompts = [e.reward_prompt for e in examples]
        faults.at("generate", step + 1)
        gen = s.rollouts.generate(s.rollout_prompts(examples), [e.answer for e in examples],
                                  SamplingParams.for_rollout(cfg, step_seed(cfg.seed, step, 0)),
                                  reward_prompts, score=False)
        teacher_prompts(s.cfg, s.tokenizer, gen.batch, examples)
        return StepRollout(step, gen.batch, [e.id for e in examples], reward_prompts,
                           metrics={time_key("rollout"): gen.generate_s})

    def score(self, made: StepRollout) -> StepRollout:
        s = self.s
        faults.at("score", made.step + 1)
        m = dict(made.metrics)
        with timed(m, "reward"):
            scored = s.rollouts.score(made.batch, repeat_each(made.reward_prompts, made.batch.group_size))
        made.batch.reward_terms = scored.labelled_terms()
        if scored.num_errors:
            s.warn(scored.error_warning(made.step + 1))
        m.update({"sampling_rounds": 1.0, REWARD_ERRORS: float(scored.num_errors),
                  REWARD_TIMEOUTS: float(scored.num_timeouts)})
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
                               loaded_version=start, loaded_weights=s.trainers.weights().snapshot(),
                               queued=s.queued, score_apart=apart, newest=r.partial, start=False)
    if r.partial:  # one process (checked at start): the engine loads newer weights between segments
        s.rollouts.sample_in_segments(r.partial_tokens or max(1, s.cfg.max_new_tokens // 4), producer.refresh)
    producer.start()
    return producer
