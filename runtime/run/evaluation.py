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
evaluated by the same :func:`answer_set`, its metrics named as :func:`heldout_metrics` says.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..batch import RolloutBatch, repeat_each
from ..config import EvalSetConfig, RunConfig
from ..data.datasets import Example, load_examples, render_prompt, rollout_prompts
from ..rollout.engines.base import SamplingParams
from ..rollout.tool_metrics import tool_call_metrics
from ..rollout.agents.runner import agent_metrics
from ..records.metrics import EVAL_FAILED, GREEDY_ACC, SAMPLED_ACC
from ..rewards.functions import RewardFn
from ..data import reasoning_gym as rg
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


@dataclass
class EvalSet:
    """A named evaluation set: its prompts (rendered for the model) and the reward scoring it.
    ``own_reward``: scored by a reward other than the run's (the rollouts then only generate)."""

    name: str
    examples: list[Example]
    reward: RewardFn
    own_reward: bool = False


def set_name(path: str | Path, taken: Sequence[str] = ()) -> str:
    """A metric-friendly name for a set from its file name (``data/gsm8k_test.jsonl`` -> ``gsm8k_test``)."""
    p = Path(path)
    base = p.stem if p.suffix else p.name
    name = "".join(ch if ch.isalnum() or ch in "_-." else "_" for ch in base) or "set"
    out, i = name, 2
    while out in taken:
        out, i = f"{name}_{i}", i + 1
    return out


#: (prompts as ``data.rollout_prompts`` gives them, the rows' answers, params) -> the samples
Generate = Callable[[list[str | tuple], list[str], SamplingParams], RolloutBatch]
#: (examples, params) -> (the samples, [P * n] their rewards, NaN where the reward failed)
Answer = Callable[[Sequence[Example], SamplingParams], tuple[RolloutBatch, torch.Tensor]]


def score_rows(reward: RewardFn, batch: RolloutBatch, examples: Sequence[Example], n: int) -> torch.Tensor:
    """[P * n] rewards of ``batch`` (n rows per example), NaN where the reward failed."""
    batch.answers = repeat_each([e.answer for e in examples], n)
    return reward.score(batch, repeat_each([e.reward_prompt for e in examples], n)).rewards


def scored_here(generate: Generate, reward: RewardFn, episodes: bool = False) -> Answer:
    """Answers sampled by ``generate`` and scored in this process by ``reward``. ``episodes``:
    ``generate`` runs multi-turn episodes, which start from the rows' own prompts
    (``data.rollout_prompts``)."""
    def answer(examples: Sequence[Example], params: SamplingParams) -> tuple[RolloutBatch, torch.Tensor]:
        answers = [e.answer for e in examples]  # an environment's reset reads them
        batch = generate(rollout_prompts(examples, episodes), answers, params)
        return batch, score_rows(reward, batch, examples, params.n)
    return answer


def unscored_by(rollouts: Rollouts) -> Generate:
    """Samples of the run's rollout workers, not scored (a set's own reward scores them)."""
    def generate(prompts: list[str | tuple], answers: list[str], params: SamplingParams) -> RolloutBatch:
        return rollouts.generate(prompts, answers, params, score=False).batch
    return generate


def scored_by(rollouts: Rollouts, episodes: bool = False) -> Answer:
    """Answers sampled and scored by the run's rollout workers (with the run's reward)."""
    def answer(examples: Sequence[Example], params: SamplingParams) -> tuple[RolloutBatch, torch.Tensor]:
        g = rollouts.generate(rollout_prompts(examples, episodes), [e.answer for e in examples], params,
                              [e.reward_prompt for e in examples])
        return g.batch, g.scored.rewards
    return answer


@dataclass
class Answers:
    """A set's answers in one evaluation: one greedy answer per prompt and, when asked, n
    sampled ones, each with its reward ([P] and [P * n], NaN where the reward failed)."""

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
    if sampled is None:
        return Answers(greedy, greedy_rewards)
    batch, rewards = answer(examples, sampled)
    return Answers(greedy, greedy_rewards, batch, rewards)


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
        out["length"] = float(a.sampled.response_mask.sum(-1).float().mean())
        out["truncated"] = float(a.sampled.truncated.float().mean())
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


def evaluate_set(generate: Generate, s: EvalSet, *, n: int, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int | None, episodes: bool = False) -> dict[str, float]:
    """The metrics of one set (module doc) under ``eval/<name>/``, its answers scored here.
    ``episodes``: ``generate`` runs multi-turn episodes (:func:`scored_here`)."""
    sampled = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                             seed=seed) if n >= 1 else None
    a = answer_set(scored_here(generate, s.reward, episodes), s.examples, max_new_tokens=max_new_tokens,
                   sampled=sampled)
    return set_metrics(s.name, a, s.reward)


def evaluate_sets(generate: Generate, sets: Sequence[EvalSet], **kwargs: Any) -> dict[str, float]:
    """Every set's metrics, one dict."""
    out: dict[str, float] = {}
    for s in sets:
        out.update(evaluate_set(generate, s, **kwargs))
    return out


# ------------------------------------------------------------------------ reading a set
def load_eval_set(path: str | Path, reward: RewardFn, tokenizer: Any, *, prompt_key: str = "prompt",
                  answer_key: str | None = "answer", chat_template: str = "auto",
                  chat_template_kwargs: dict[str, Any] | None = None, system_prompt: str | None = None,
                  name: str | None = None, taken: Sequence[str] = ()) -> EvalSet:
    """An evaluation set from a data file, its prompts rendered for ``tokenizer`` as training renders them."""
    examples = load_examples(path, prompt_field=prompt_key, answer_field=answer_key)
    rendered = [render_prompt(e, tokenizer, mode=chat_template, kwargs=chat_template_kwargs,
                              system_prompt=system_prompt) for e in examples]
    return EvalSet(name or set_name(path, taken), rendered, reward)


def load_generated_sets(path: str, reward: RewardFn, tokenizer: Any, *, options: dict[str, Any], seed: int,
                        count: int, exclude: Sequence[str] = (), chat_template: str = "auto",
                        chat_template_kwargs: dict[str, Any] | None = None, system_prompt: str | None = None,
                        name: str | None = None, taken: Sequence[str] = (),
                        note: Callable[[str], None] | None = None) -> list[EvalSet]:
    """The evaluation sets of ``reasoning_gym:`` data: one set per task (a mix gives a row per task;
    a single task is named ``name`` or after the path), rendered as training renders them."""
    by_task, line = rg.generate_eval(path, options, run_seed=seed, count=count, exclude=exclude)
    if note is not None:
        note(line)
    if system_prompt is None:
        system_prompt = rg.default_system_prompt()
    sets: list[EvalSet] = []
    for task, rows in by_task.items():
        label = (name or set_name(path.replace(":", "_"), taken)) if len(by_task) == 1 else task
        rendered = [render_prompt(e, tokenizer, mode=chat_template, kwargs=chat_template_kwargs,
                                  system_prompt=system_prompt) for e in rows]
        sets.append(EvalSet(label, rendered, reward))
    return sets


def eval_sets_of(cfg: RunConfig, tokenizer: Any, run_reward: RewardFn,
                 training: Sequence[str] = ()) -> list[EvalSet]:
    """The run's ``eval.data`` sets, read and rendered (a missing file or column fails here,
    before any model loads), each with its reward (the run's unless it names its own)."""
    d = cfg.data
    sets: list[EvalSet] = []
    for entry in cfg.eval.data:
        entry = EvalSetConfig(path=entry) if isinstance(entry, str) else entry
        own = entry.reward is not None and entry.reward != run_reward.spec
        reward = RewardFn(entry.reward, on_error=cfg.reward.on_error) if own else run_reward
        if rg.is_reasoning_gym(entry.path):
            options = dict(d.options) if entry.path == d.path else {}  # the training data's options
            for s in load_generated_sets(entry.path, reward, tokenizer, options=options, seed=cfg.seed,
                                         count=200 if d.eval_size is None else max(d.eval_size, 1),
                                         exclude=training, chat_template=d.chat_template,
                                         chat_template_kwargs=d.chat_template_kwargs,
                                         system_prompt=d.system_prompt, name=entry.name,
                                         taken=[x.name for x in sets]):
                if s.name in [x.name for x in sets]:
                    raise ValueError(f"eval.data: two sets are named {s.name!r}; give them different names")
                s.own_reward = own
                sets.append(s)
            continue
        s = load_eval_set(entry.path, reward, tokenizer, prompt_key=d.prompt_key, answer_key=d.answer_key,
                          chat_template=d.chat_template, chat_template_kwargs=d.chat_template_kwargs,
                          system_prompt=d.system_prompt, name=entry.name, taken=[x.name for x in sets])
        if s.name in [x.name for x in sets]:
            raise ValueError(f"eval.data: two sets are named {s.name!r}; give them different names")
        s.own_reward = own
        sets.append(s)
    return sets
