"""Evaluation sets: ``eval.data`` during a run and ``rldsl eval`` (run/eval_command.py) on a checkpoint
or a model folder.

Each set is a data file (or datasets folder) with its own reward (default: the run's). Every
prompt is answered greedily once and sampled ``n`` times (``eval.n``; the rollout temperature
and top-p); per set, under ``eval/<set>/``:

    greedy_acc      fraction of prompts whose greedy answer is correct
    pass@1, pass@k  unbiased pass@k over the n samples (k = 1, 2, 4, ..., n), Chen et al. 2021:
                    1 - C(n - c, k) / C(n, k) per prompt with c correct samples, then the mean
    reward          mean reward of the samples (the scorable ones)
    length          mean response length of the samples, in tokens
    truncated       fraction of the samples cut off at max_new_tokens
    failed          samples whose reward failed (counted as not correct)

"Correct" is what the set's reward calls correct (``RewardFn.correct``: reward > 0.5, a binary
reward's 1), as for the held-out accuracy and the training accuracy. The held-out split is
evaluated by the same :func:`answer_set`, its metrics named as :func:`heldout_metrics` says (and
per task, generated data's, as :func:`heldout_task_metrics` says).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

from ..batch import RolloutBatch, repeat_each
from ..data.datasets import Example, rollout_prompts
from ..rollout.engines.base import SamplingParams
from ..rollout.tool_metrics import tool_call_metrics
from ..rollout.agents.runner import agent_metrics
from ..records.metrics import EVAL_FAILED, GREEDY_ACC, HELDOUT_TASKS, SAMPLED_ACC
from ..rewards.functions import RewardFn
from ..workers.base import Rollouts


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased probability that at least one of k samples drawn without replacement from
    n samples with c correct ones is correct: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n >= 1 else []


#: (prompts as ``data.rollout_prompts`` gives them, the rows' answers, params) -> the samples
Generate = Callable[[list[str | tuple], list[str], SamplingParams], RolloutBatch]
#: (examples, params) -> (the samples, [P * n] their rewards, NaN where the reward failed)
Answer = Callable[[Sequence[Example], SamplingParams], tuple[RolloutBatch, "torch.Tensor"]]


def score_rows(reward: RewardFn, batch: RolloutBatch, examples: Sequence[Example], n: int) -> torch.Tensor:
    """[P * n * K] rewards of ``batch`` (n episodes per example, K rows each: an agent's episode
    may make several), NaN where the reward failed."""
    per_example = batch.response_mask.shape[0] // max(len(examples), 1)  # n * K
    batch.answers = repeat_each([e.answer for e in examples], per_example)
    return reward.score(batch, repeat_each([e.reward_prompt for e in examples], per_example)).rewards


def episode_rewards(rewards: torch.Tensor, episodes: int) -> torch.Tensor:
    """[episodes] each episode's reward from its rows' ([episodes * K], an episode's K rows
    consecutive: an agent's episode may make several rows, docs/agents.md): the mean of its rows'
    finite rewards (they carry one reward unless the agent rewards its roles apart), NaN when
    none is."""
    if len(rewards) == episodes:
        return rewards
    if episodes == 0 or len(rewards) % episodes:
        raise ValueError(f"{len(rewards)} rows are not the same number of rows for each of {episodes} episodes")
    return rewards.view(episodes, -1).nanmean(dim=1)


def scored_here(generate: Generate, reward: RewardFn, multi_turn: bool = False) -> Answer:
    """Answers sampled by ``generate`` and scored in this process by ``reward``. ``multi_turn``:
    ``generate`` runs multi-turn episodes, which start from the rows' own prompts
    (``data.rollout_prompts``)."""
    def answer(examples: Sequence[Example], params: SamplingParams) -> tuple[RolloutBatch, torch.Tensor]:
        answers = [e.answer for e in examples]  # an environment's reset reads them
        batch = generate(rollout_prompts(examples, multi_turn), answers, params)
        return batch, score_rows(reward, batch, examples, params.n)
    return answer


def unscored_by(rollouts: Rollouts) -> Generate:
    """Samples of the run's rollout workers, not scored (a set's own reward scores them)."""
    def generate(prompts: list[str | tuple], answers: list[str], params: SamplingParams) -> RolloutBatch:
        return rollouts.generate(prompts, answers, params, score=False).batch
    return generate


def scored_by(rollouts: Rollouts, multi_turn: bool = False) -> Answer:
    """Answers sampled and scored by the run's rollout workers (with the run's reward)."""
    def answer(examples: Sequence[Example], params: SamplingParams) -> tuple[RolloutBatch, torch.Tensor]:
        g = rollouts.generate(rollout_prompts(examples, multi_turn), [e.answer for e in examples], params,
                              [e.reward_prompt for e in examples])
        return g.batch, g.scored.rewards
    return answer


@dataclass
class Answers:
    """A set's answers in one evaluation: one greedy answer per prompt and, when asked, n
    sampled ones, each with its reward ([P] and [P * n] episodes, NaN where the reward failed;
    the batches hold their rows: K per episode, an agent's episode may make several)."""

    greedy: RolloutBatch
    greedy_rewards: torch.Tensor
    sampled: RolloutBatch | None = None
    sampled_rewards: torch.Tensor | None = None

    @property
    def failed(self) -> int:
        """Answers whose reward failed (counted as not correct, left out of mean rewards)."""
        return sum(int((~torch.isfinite(r)).sum()) for r in (self.greedy_rewards, self.sampled_rewards)
                   if r is not None)


def answer_set(answer: Answer, examples: Sequence[Example], *, max_new_tokens: int,
               sampled: SamplingParams | None) -> Answers:
    """The one evaluator: every prompt answered greedily once and, with ``sampled``, ``sampled.n``
    times; the held-out split and each ``eval.data`` set alike (they differ in the names of
    their metrics only: :func:`set_metrics`, :func:`heldout_metrics`)."""
    greedy, greedy_rewards = answer(examples, SamplingParams.greedy(max_new_tokens))
    greedy_rewards = episode_rewards(greedy_rewards, len(examples))  # the figures count episodes
    if sampled is None:
        return Answers(greedy, greedy_rewards)
    batch, rewards = answer(examples, sampled)
    return Answers(greedy, greedy_rewards, batch, episode_rewards(rewards, len(examples) * sampled.n))


def _mean_finite(r: torch.Tensor) -> float:
    finite = torch.isfinite(r)
    return float(r[finite].mean()) if finite.any() else float("nan")


def set_metrics(name: str, a: Answers, reward: RewardFn) -> dict[str, float]:
    """An ``eval.data`` set's metrics (module doc) under ``eval/<name>/``."""
    out = {"greedy_acc": float(reward.correct(a.greedy_rewards).float().mean())}
    if a.sampled is not None and a.sampled_rewards is not None:
        P = len(a.greedy_rewards)
        n = len(a.sampled_rewards) // P
        correct = reward.correct(a.sampled_rewards).view(P, n).sum(dim=1).tolist()  # [P] correct samples each
        for k in k_values(n):
            out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / P
        out["reward"] = _mean_finite(a.sampled_rewards)
        episodes = P * n  # an episode's length: its rows' tokens; truncated: any of its rows
        out["length"] = float(a.sampled.response_mask.sum(-1).float().view(episodes, -1).sum(-1).mean())
        out["truncated"] = float(a.sampled.truncated.view(episodes, -1).any(-1).float().mean())
    out["failed"] = float(a.failed)
    return {f"eval/{name}/{k}": v for k, v in out.items()}


def heldout_metrics(a: Answers, reward: RewardFn, tool_parser: str) -> dict[str, float]:
    """The held-out split's metrics: accuracy (correct answers over every answer, a failed
    reward counting as not correct), mean reward (over the scorable answers only; NaN when none
    is) and the episodes' tool-call and agent metrics, greedy (``eval/greedy_*``, ``eval/tool_calls/*``)
    and sampled (``eval/sampled_*``), and ``eval/failed``."""
    out: dict[str, float] = {}
    modes = [(GREEDY_ACC, "eval/greedy_reward", "eval/", a.greedy, a.greedy_rewards)]
    if a.sampled is not None and a.sampled_rewards is not None:
        modes.append((SAMPLED_ACC, "eval/sampled_reward", "eval/sampled_", a.sampled, a.sampled_rewards))
    for acc_key, reward_key, prefix, batch, r in modes:
        out.update(tool_call_metrics(batch, tool_parser, prefix))
        out.update(agent_metrics(batch, prefix))
        out[acc_key] = float(reward.correct(r).float().mean())
        out[reward_key] = _mean_finite(r)
    out[EVAL_FAILED] = float(a.failed)
    return out


def heldout_task_metrics(a: Answers, reward: RewardFn, tasks: Sequence[str | None]) -> dict[str, float]:
    """The held-out split's accuracy and mean reward per task (``tasks[p]``: prompt p's task, None
    for a row of none), as :func:`heldout_metrics` names them for the whole split, under
    ``eval/heldout/<task>/``: ``greedy_acc``, ``greedy_reward`` and, sampled, ``sampled_acc``,
    ``sampled_reward``."""
    P = len(a.greedy_rewards)
    if len(tasks) != P:
        raise ValueError(f"{len(tasks)} tasks for {P} held-out prompts")
    n = len(a.sampled_rewards) // P if a.sampled_rewards is not None else 0
    out: dict[str, float] = {}
    for task in sorted({t for t in tasks if t is not None}):
        rows = [p for p, t in enumerate(tasks) if t == task]
        modes = [("greedy", a.greedy_rewards[rows])]
        if n:
            modes.append(("sampled", a.sampled_rewards[[p * n + j for p in rows for j in range(n)]]))
        for mode, r in modes:
            out[f"{HELDOUT_TASKS}/{task}/{mode}_acc"] = float(reward.correct(r).float().mean())
            out[f"{HELDOUT_TASKS}/{task}/{mode}_reward"] = _mean_finite(r)
    return out
