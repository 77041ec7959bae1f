"""One producer per optional input of ``estimate()`` / ``loss()`` (the table in rldsl/inputs.py).

Each input of the language's table has exactly one function here that makes it, keyed by the
input's name, in one of three tables by when it is made:

- ``ROLLOUT``: after a generation round is scored (the loop): ``(side, batch, scored, prompts)
  -> (batch with the input, seconds spent)``; only for inputs the algorithm reads.
- ``ESTIMATE``: for ``estimate()`` (the trainer): ``(trainer, rollout, forwards) -> value``,
  where ``forwards`` holds the no-grad forwards the trainer ran (old / reference logprobs,
  values, old-policy statistics).
- ``UPDATE``: for ``loss()`` on one micro-batch: ``(trainer, micro) -> value``.

The loop and the trainer ask the algorithm what it reads (``algo.needs(...)``) and call these;
they never test an input's name. ``wanted(stage, algo)`` is that question: the inputs the call
of ``stage`` always gets plus those an active component reads. A new input is one record in
rldsl/inputs.py and one producer here (docs/components.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import torch
from torch import Tensor

from rldsl import Algorithm, CompiledAlgorithm
from rldsl import inputs as table

from ..batch import RolloutBatch, repeat_each
from ..data.datasets import Example, rollout_prompts
from ..errors import ConfigError, DataError, RunError
from ..rewards.functions import RewardResult
from ..rewards.spec import gives_turn_rewards
from ..rollout.engines.base import SamplingParams
from ..rollout.tree import NAMES as TREE_INPUTS
from ..rollout.tree import Fork, tree_inputs
from .answers import answer_probabilities

class Trainer(Protocol):
    """What the estimate- and update-stage producers read of a trainer (train/trainer.py's
    ``Trainer``, which calls them): the compiled algorithm."""

    fn: CompiledAlgorithm


# ----------------------------------------------------------------------------- what producers read

@dataclass(frozen=True)
class RolloutSide:
    """What the rollout-stage producers use from the run (the loop builds it once per step)."""

    generate: Callable[..., Any]          # the rollout workers' generate(prompts, answers, params, reward_prompts)
    reward_terms: list[tuple[str, float]]  # the reward spec's (function name, weight) terms, in order
    max_new_tokens: int
    warn: Callable[[str], None]
    step: int  # the step's number in its warnings: as metrics.jsonl logs it (from 1)
    multi_turn: bool = False  # multi-turn episodes: generate starts from the rows' own prompts
    tokenizer: Any = None  # the policy's: where a process reward's steps end in its tokens
    group_by: str | None = None  # the data field a spec's group_by=FIELD names (Algorithm.group_by)
    prompt_stats: Any = None  # the run's PromptStats (records/prompt_stats.py) when the spec reads them
    # the reference model's rollouts' generate(prompts, answers, params, reward_prompts) and its sampling
    # (reward.reference, reward.reference_samples) when the spec reads ref_reward
    reference: Callable[..., Any] | None = None
    reference_params: SamplingParams | None = None
    # the policy's no-grad logprobs of a batch's responses ([B, Tr]) and the answer tags (reward.answer_tags)
    # when the spec reads answer_prob: the policy that sampled the step scores the reference answer
    score: Callable[[RolloutBatch], Tensor] | None = None
    answer_tags: tuple[str, str] = ("<answer>", "</answer>")


class Forwards(NamedTuple):
    """The no-grad forwards of ``Trainer.estimate`` over every row ([B, Tr] each, None when not run)."""

    old_logprobs: Tensor | None     # None: exactly on-policy, or bypass (pi_old is the engine's)
    ref_logprobs: Tensor | None
    values: Tensor | None
    sum_pi_squared: Tensor | None
    old_entropy: Tensor | None = None  # the old policy's entropy, from the old-logprob forward
    old_topk_logprobs: Tensor | None = None  # [B, Tr, K] its K largest logprobs (the spec's K)
    is_top1: Tensor | None = None  # [B, Tr] 1 where the sampled token is its most likely
    self_certainty: Tensor | None = None  # [B, Tr] logsumexp(z) - mean(z) of its logits
    old_topk_ids: Tensor | None = None  # [B, Tr, K] the token ids of old_topk_logprobs


@dataclass(frozen=True)
class Micro:
    """One micro-batch of an update step, what ``loss()``'s inputs are cut from."""

    batch: Any                   # the step's TrainBatch (rows indexed by ``rows``)
    sub: RolloutBatch            # the micro-batch's rollout rows, trimmed to ``tr`` columns
    rows: Tensor                 # [b] row indices into ``batch``
    tr: int                      # response columns of this micro-batch
    entropy: Tensor | None       # [b, tr] the update forward's entropy
    values: Tensor | None        # [b, tr] the current critic's values
    entropy_coef: Tensor | None  # [] this optimizer step's coefficient
    topk: Tensor | None = None   # [b, tr, J] the update forward's logprobs of the teacher's top-k tokens
    divergence: Tensor | None = None  # [b, tr] the update forward's JSD from the teacher (with gradient)
    router_aux: Tensor | None = None  # [b, tr] a MoE policy's per-token load-balancing loss (with gradient)
    policy_topk: Tensor | None = None  # [b, tr, K] the update forward's logprobs of the old top-K ids (with gradient)
    is_top1: Tensor | None = None  # [b, tr] the update forward's own is-top-1 (exactly on-policy only)

    def cols(self, t: Tensor | None) -> Tensor | None:
        """The micro-batch's rows and columns of a [B, Tr] tensor of the step."""
        return None if t is None else t[self.rows][:, :self.tr]


def wanted(stage: str, algo: Algorithm) -> list[str]:
    """The inputs a call of ``stage`` gets: those it always takes, and those the algorithm reads."""
    reads = set(algo.needs())
    return [i.name for i in table.of_stage(stage) if stage in i.always or i.name in reads]


def reads_history(algo: Algorithm) -> bool:
    """The algorithm reads the run's per-prompt statistics across steps: the run keeps them."""
    return any(table.INPUTS[x].source == "history" for x in algo.needs())


def reads_answers(algo: Algorithm) -> bool:
    """The algorithm reads the policy's probability of the reference answer (``answer_prob``): the
    rollout stage scores the reference answers with the trainer's policy."""
    return any(table.INPUTS[x].source == "answer" for x in algo.needs())


def reads_engine(algo: Algorithm) -> bool:
    """The algorithm reads the inference engine's own numbers (a train/inference correction)."""
    return any(table.INPUTS[x].source == "engine" for x in algo.needs())


def advantages_read_old_policy(algo: Algorithm) -> bool:
    """estimate() reads the old policy's forward (its logprobs, e.g. an advantage formula's
    ``old_logp``, or a statistic of it): that forward must run before the update."""
    return any(table.INPUTS[x].source == "policy" for x in algo.needs("advantage"))


def whole_groups(needs: tuple[str, ...]) -> bool:
    """A component reading these compares a prompt's samples: micro-batches keep whole groups."""
    return any(table.INPUTS[x].whole_groups for x in needs)


#: the statistics of the old policy beyond its logprobs that the old-logprob forward also returns:
#: input -> the field of ``LogprobOut`` that holds it (train/logprobs.py); ``LogprobOptions`` asks for
#: it under the same name (``True``), but for the top-K logprobs, which it asks as ``topk = K`` (the
#: spec's K) and which come with their ids (``top_ids``, kept for the update forward to gather at)
OLD_POLICY_STATISTICS = {"sum_pi_squared": "sum_pi_squared", "old_entropy": "entropy",
                         "old_topk_logprobs": "top_logprobs", "is_top1": "sampled_is_top",
                         "self_certainty": "self_certainty"}


def old_policy_statistics(algo: Algorithm, topk: int | None = None) -> list[str]:
    """The statistics of the old policy beyond its logprobs that the algorithm reads, in any stage
    (keys of ``OLD_POLICY_STATISTICS``, in its order): the old-logprob forward also returns them,
    from the same logits (e.g. ``sum_pi_squared`` of `baseline optimal_token`, ``old_entropy`` of
    a formula reading ``old_ent``). With ``topk`` (the spec's K, ``fn.data.policy_topk``) the old
    top-K always: it picks the K ids every top-K input is taken at (the current policy's too)."""
    reads = set(algo.needs())
    return [x for x, field in OLD_POLICY_STATISTICS.items() if x in reads or (topk and field == "top_logprobs")]


def reads_router_aux(algo: Algorithm) -> bool:
    """The loss reads the routers' load-balancing loss (``router balance``): the update forward
    keeps it per token (models/moe.py)."""
    return "router_aux" in algo.needs("loss")


def entropy_grad(algo: Algorithm) -> bool:
    """The update's entropy carries its gradient into the loss: the entropy slot is on, or a
    formula of the loss reads ``ent`` (it may use it as a value, not only in a comparison)."""
    return algo.uses_entropy or any(v.formula is not None and "entropy" in v.spec.facts.needs
                                    for v in algo.active("loss"))


# ----------------------------------------------------------------------------- rollout stage

def greedy_baselines(side: RolloutSide, batch: RolloutBatch, scored: RewardResult,
                     prompts: list[Example]) -> tuple[RolloutBatch, float]:
    """``reward_baselines`` [B]: one greedy response per prompt, scored by the run's reward.

    What verl's ReMax trainer does (do_sample=False on a copy of the prompts, the same reward
    function, the reward repeated over the group). Returns the batch and the seconds it took.
    """
    gen = side.generate(rollout_prompts(prompts, side.multi_turn), [e.answer for e in prompts],
                        SamplingParams.greedy(side.max_new_tokens),
                        [e.reward_prompt for e in prompts])
    r = gen.scored.rewards.to(torch.float32)  # [P]
    if gen.scored.num_errors:
        side.warn(f"step {side.step}: the greedy baseline's reward failed for {gen.scored.num_errors} "
                  f"prompt(s): their samples get advantage 0; first:\n{gen.scored.first_error}")
    base = r.repeat_interleave(batch.group_size).to(batch.response_ids.device)  # [B]
    return _with(batch, reward_baselines=base), gen.generate_s + gen.reward_s


def per_function_rewards(side: RolloutSide, batch: RolloutBatch, scored: RewardResult,
                         prompts: list[Example]) -> tuple[RolloutBatch, float]:
    """``reward_components`` [B, K] (one column per term of the reward spec, in its order) and
    ``reward_weights`` [K]: what GDPO (`baseline per_reward_group`) normalises."""
    dev = batch.response_ids.device
    comps = torch.stack([scored.components[n].to(torch.float32) for n, _ in side.reward_terms],
                        dim=1).to(dev)  # [B, K]
    w = torch.tensor([wt for _, wt in side.reward_terms], dtype=torch.float32, device=dev)  # [K]
    return _with(batch, reward_components=comps, reward_weights=w), 0.0


def per_turn_rewards(side: RolloutSide, batch: RolloutBatch, scored: RewardResult,
                     prompts: list[Example]) -> tuple[RolloutBatch, float]:
    """``dense_rewards`` [B, Tr]: each per-turn reward of the reward's terms, times the term's
    weight, on the response token that ends its turn or step -- the ``env`` term's step rewards on
    the last token of the model's turn each answered (the episode's ``step_rewards``), a process
    reward model's step scores on the token where the step's text ends; 0 elsewhere and on rows
    whose reward failed (they leave the loss). A row without turns (a single-turn sample, an
    agent's episode) has no environment step rewards: an error, never a row of zeros."""
    B, T = batch.response_ids.shape
    out = torch.zeros(B, T, dtype=torch.float32)
    for name, w in side.reward_terms:
        kind = gives_turn_rewards(name)
        for i in range(B):
            if kind == "turns":
                steps = batch.episodes[i].step_rewards if i < len(batch.episodes) else None
                if steps is None:
                    raise RunError(
                        f"step {side.step}: the spec reads per-turn rewards (rewards dense) but sample {i} has "
                        "no turns with rewards of their own (" + ("an agent's episode gives one reward"
                                                                  if i < len(batch.episodes) else "a single-turn sample")
                        + "): dense rewards come from the `env` term of multi-turn episodes (rollout.env or "
                        "rollout.tools)")
                placed = [(int(p), float(r)) for p, r in steps]
            elif kind == "steps":
                detail = scored.steps[name][i]
                if detail is None:
                    continue  # the sample's reward failed: it leaves the loss
                placed = list(zip(step_tokens(side.tokenizer, batch, i, [int(e) for e, _ in detail]),
                                  [float(v) for _, v in detail]))
            else:
                continue
            if not bool(torch.isfinite(scored.rewards[i])):
                continue
            for pos, r in placed:
                out[i, pos] += w * r
    return _with(batch, dense_rewards=out.to(batch.response_ids.device)), 0.0


def field_key(value: Any) -> int:
    """A stable int64 key of a data field's value: the same in every step, run and process (not
    Python's salted ``hash``); 1 and "1" differ, 1 and 1.0 and True as JSON does."""
    text = json.dumps(value, sort_keys=True)
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def field_keys(side: RolloutSide, batch: RolloutBatch, scored: RewardResult,
               prompts: list[Example]) -> tuple[RolloutBatch, float]:
    """``group_keys`` [B] int64: the key of each row's value of the field the spec's
    ``group_by=FIELD`` names. An agent's row takes it from its model calls' request ``metadata``
    (``metadata={"role": "solver"}``: every call of the row must agree); any other row -- and an
    agent's row whose calls carry no such key -- from the column FIELD of the dataset row its
    prompt came from. A padding row of an agent's episode (nothing trained) without either gets
    the key of no value (null)."""
    if side.group_by is None:
        raise RunError("the spec reads group_keys but names no group_by field")
    B = batch.response_ids.shape[0]
    if len(prompts) * batch.group_size != B:
        raise RunError(f"group_keys: {B} rows are not {len(prompts)} prompts x "
                       f"{batch.group_size} rows each")
    name = side.group_by
    keys = []
    for i in range(B):
        example = prompts[i // batch.group_size]
        episode = batch.episodes[i] if batch.episodes else None
        agent = episode.agent if episode is not None else None
        tagged = sorted({c["metadata"][name] for c in (agent.calls if agent is not None else [])
                         if c.get("row") == agent.row and name in c.get("metadata", {})}) if agent else []
        if len(tagged) > 1:
            raise RunError(f"group_by={name}: sample {i} (prompt {example.id}) is one sequence of model calls "
                           f"tagged {name}={' and '.join(map(repr, tagged))} in their metadata; a row has one "
                           f"value: give calls of different {name}s different prompts (each starts its own row)")
        if tagged:
            value = tagged[0]
        elif agent is not None and agent.padding and name not in dict(example.fields):
            value = None
        else:
            try:
                value = example.column(name)
            except DataError as e:
                if agent is None:
                    raise
                raise DataError(f"{e}; or tag the agent's model calls with metadata={{{name!r}: ...}}") from None
        keys.append(field_key(value))
    return _with(batch, group_keys=torch.tensor(keys, dtype=torch.int64).to(batch.response_ids.device)), 0.0

def step_tokens(tokenizer: Any, batch: RolloutBatch, row: int, ends: list[int]) -> list[int]:
    """The response position of the token where each step's text ends (``ends``: character
    offsets into the row's completion): the first of its model tokens whose decoded prefix
    reaches that offset."""
    cols = torch.nonzero(batch.response_mask[row] > 0).reshape(-1).tolist()
    ids = batch.response_ids[row, cols].tolist()
    if not ids or tokenizer.decode(ids, skip_special_tokens=True) != batch.completions[row]:
        raise RunError(f"sample {row}: its completion is not the decoded text of its tokens, so the process "
                       "reward's step scores cannot be placed on them")
    decoded: dict[int, int] = {}

    def reach(k: int) -> int:  # characters of the first k + 1 tokens' text
        if k not in decoded:
            decoded[k] = len(tokenizer.decode(ids[:k + 1], skip_special_tokens=True))
        return decoded[k]

    out = []
    for e in ends:  # the first token whose prefix reaches e: a binary search (log T decodes a step)
        lo, hi = 0, len(ids) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if reach(mid) >= e else (mid + 1, hi)
        out.append(cols[lo])
    return out


def check_per_turn_rewards(reward_terms: list[tuple[str, float]], multi_turn: bool) -> None:
    """Before any model loads: a spec reading per-turn rewards has a reward term that gives them
    (the `env` term with multi-turn episodes, or a process reward model on single-turn ones)."""
    kinds = {gives_turn_rewards(n) for n, _ in reward_terms} - {None}
    if not kinds:
        raise ConfigError(f"the spec reads per-turn rewards (rewards dense, or a formula reading r_dense) but "
                          f"no term of the reward {','.join(n for n, _ in reward_terms)!r} gives any: the `env` "
                          "term does (each environment step's reward), e.g. --reward env, and a reward model with "
                          "a step separator (rm:PATH(step_separator=...))")
    if "turns" in kinds and not multi_turn:
        raise ConfigError("the spec reads per-turn rewards (rewards dense) but the rollout is single-turn: a "
                          "row without turns has no per-turn reward (nor has an agent's episode, rollout.agent: "
                          "it returns one reward); run multi-turn episodes (rollout.env or rollout.tools), or "
                          "use an outcome spec")
    if "steps" in kinds and multi_turn:
        raise ConfigError("a process reward model's step scores are placed on single-turn completions only "
                          "(in an episode it scores the last assistant message): drop step_separator or the "
                          "multi-turn rollout")


def prompt_statistics(side: RolloutSide, batch: RolloutBatch, scored: RewardResult,
                      prompts: list[Example]) -> tuple[RolloutBatch, float]:
    """``prompt_mean``, ``prompt_var``, ``prompt_count``, ``prompt_steps``, ``prompt_step_var`` [B]:
    the statistics of each row's prompt's finite rewards over every step (every sampling round) it
    was seen in, this one's folded in first (records/prompt_stats.py); the run's state, on the
    driver, saved in checkpoints."""
    if side.prompt_stats is None:
        raise RunError("the spec reads per-prompt statistics but the run keeps none")
    keys = [side.prompt_stats.key(e.prompt) for e in prompts]
    side.prompt_stats.update(keys, scored.rewards)
    made = side.prompt_stats.read(keys, batch.group_size)
    return _with(batch, **{k: v.to(batch.response_ids.device) for k, v in made.items()}), 0.0


def reference_rewards(side: RolloutSide, batch: RolloutBatch, scored: RewardResult,
                      prompts: list[Example]) -> tuple[RolloutBatch, float]:
    """``ref_reward`` [B]: the reference model's answers to each prompt (``reward.reference_samples``
    of them, sampled as the rollout samples), scored by the run's reward; each row gets the mean
    over its prompt's answers whose reward did not fail, NaN where every one failed (estimate()
    then takes the row out of the loss). Each reward term's mean per prompt joins the batch's
    reward terms as ``ref/<term>`` (metrics ``rewards/ref/<term>/mean``, samples.jsonl ``rewards``)."""
    if side.reference is None or side.reference_params is None:
        raise RunError("the spec reads ref_reward but the run samples no reference model (reward.reference)")
    gen = side.reference(rollout_prompts(prompts, side.multi_turn), [e.answer for e in prompts],
                         side.reference_params, [e.reward_prompt for e in prompts])
    if gen.scored.num_errors:
        side.warn(f"step {side.step}: the reward of {gen.scored.num_errors} reference answer(s) failed: each "
                  "prompt's ref_reward is the mean of the others (a prompt with none leaves the loss); first:\n"
                  f"{gen.scored.first_error}")
    n, G, dev = side.reference_params.n, batch.group_size, batch.response_ids.device

    def per_row(values: Tensor) -> Tensor:  # [P * n] -> [B]: each prompt's finite mean, on its G rows
        v = values.to(torch.float64).view(-1, n)
        ok = torch.isfinite(v)
        mean = torch.where(ok, v, torch.zeros_like(v)).sum(-1) / ok.sum(-1)  # 0 / 0: NaN
        return mean.repeat_interleave(G)

    terms = {f"ref/{label}": per_row(v) for label, v in gen.scored.labelled_terms().items()}
    batch = dataclasses.replace(batch, reward_terms={**batch.reward_terms, **terms})
    return _with(batch, ref_reward=per_row(gen.scored.rewards).to(torch.float32).to(dev)), \
        gen.generate_s + gen.reward_s


def reference_answer_probs(side: RolloutSide, batch: RolloutBatch, scored: RewardResult,
                           prompts: list[Example]) -> tuple[RolloutBatch, float]:
    """``answer_prob`` and ``bare_answer_prob`` [B]: the mean per-token probability the policy that
    sampled the step gives each row's reference answer (its prompt's data answer) after the row's
    own reasoning and right after the prompt (train/answers.py); two no-grad forwards."""
    if side.score is None:
        raise RunError("the spec reads answer_prob but the run scores no reference answers")
    t0 = time.perf_counter()
    answers = [prompts[i // batch.group_size].answer for i in range(len(batch))]
    after, alone = answer_probabilities(side.score, side.tokenizer, batch, answers, side.answer_tags)
    dev = batch.response_ids.device
    return _with(batch, answer_prob=after.to(dev), bare_answer_prob=alone.to(dev)), time.perf_counter() - t0


def tree_values(side: RolloutSide, batch: RolloutBatch, scored: RewardResult,
                prompts: list[Example]) -> tuple[RolloutBatch, float]:
    """``node_value``, ``parent_value``, ``node_leaves``, ``parent_leaves`` [B, Tr] and ``root_value``
    [B]: each group's tree (``batch.tree``, made by ``sampling tree``) and its leaves' rewards
    (rollout/tree.py). A failed reward has no place in a tree's means: it reads its group's mean
    finite reward there (estimate() takes its row out of the loss), 0 when none is finite."""
    if not batch.tree:
        raise RunError("the spec reads the tree inputs (node_value, parent_value, ...) but the rows are no "
                       "tree: add `sampling tree(...)` to the spec")
    G, T = batch.group_size, batch.response_ids.shape[1]
    r = scored.rewards.detach().to(torch.float64).cpu().view(-1, G)
    ok = torch.isfinite(r)
    fill = torch.where(ok, r, torch.zeros_like(r)).sum(-1, keepdim=True) / ok.sum(-1, keepdim=True).clamp(min=1)
    r = torch.where(ok, r, fill.expand_as(r))
    made = [tree_inputs([Fork(*f) for f in batch.tree[g * G:(g + 1) * G]], r[g], T) for g in range(r.shape[0])]
    dev = batch.response_ids.device
    return _with(batch, **{k: torch.cat([m[k] for m in made]).to(torch.float32).to(dev) for k in TREE_INPUTS}), 0.0


def _with(batch: RolloutBatch, **made: Tensor) -> RolloutBatch:
    """``batch`` with inputs added to its ``inputs``."""
    return dataclasses.replace(batch, inputs={**batch.inputs, **made})


@dataclass(frozen=True)
class RolloutInputMaker:
    """The producer of a rollout-stage input (one may make several inputs at once)."""

    make: Callable[[RolloutSide, RolloutBatch, RewardResult, list[Example]], tuple[RolloutBatch, float]]
    time_metric: str | None = None  # the step metric its seconds add to (None: not timed)
    # what the run must have for it, checked at start: (reward terms, multi-turn episodes) -> raises
    check: Callable[[list[tuple[str, float]], bool], None] | None = None


_GREEDY = RolloutInputMaker(greedy_baselines, "time/greedy_s")
_PER_FUNCTION = RolloutInputMaker(per_function_rewards)
_PROMPT_STATS = RolloutInputMaker(prompt_statistics)
_REFERENCE = RolloutInputMaker(reference_rewards, "time/reference_s")
_ANSWER = RolloutInputMaker(reference_answer_probs, "time/answer_s")
_TREE = RolloutInputMaker(tree_values)

ROLLOUT: dict[str, RolloutInputMaker] = {
    "reward_baselines": _GREEDY,
    "reward_components": _PER_FUNCTION,
    "reward_weights": _PER_FUNCTION,  # made together with the components
    "dense_rewards": RolloutInputMaker(per_turn_rewards, check=check_per_turn_rewards),
    "group_keys": RolloutInputMaker(field_keys),
    "prompt_mean": _PROMPT_STATS,  # the five made together
    "prompt_var": _PROMPT_STATS,
    "prompt_count": _PROMPT_STATS,
    "prompt_steps": _PROMPT_STATS,
    "prompt_step_var": _PROMPT_STATS,
    "ref_reward": _REFERENCE,
    "answer_prob": _ANSWER,  # the two made together
    "bare_answer_prob": _ANSWER,
    **{name: _TREE for name in TREE_INPUTS},  # the five made together
}


def check_rollout_inputs(algo: Algorithm, reward_terms: list[tuple[str, float]], multi_turn: bool) -> None:
    """The run-start checks of the rollout-stage producers the algorithm uses."""
    for p in rollout_producers(algo):
        if p.check is not None:
            p.check(reward_terms, multi_turn)


def rollout_producers(algo: Algorithm) -> list[RolloutInputMaker]:
    """The rollout-stage producers of the inputs the algorithm reads, each once, in table order."""
    reads = set(algo.needs())
    out: list[RolloutInputMaker] = []
    for name, p in ROLLOUT.items():
        if name in reads and p not in out:
            out.append(p)
    return out


# ----------------------------------------------------------------------------- estimate stage

ESTIMATE: dict[str, Callable[[Trainer, RolloutBatch, Forwards], Any]] = {
    "values": lambda tr, r, f: f.values,
    "truncated": lambda tr, r, f: r.truncated,
    # bypass: pi_old is the engine's (for a KL in the reward and the rejections too)
    "old_logprobs": lambda tr, r, f: (r.logprobs.to(r.response_mask.device)
                                      if f.old_logprobs is None and tr.fn.algorithm.old_from_rollout
                                      else f.old_logprobs),
    "ref_logprobs": lambda tr, r, f: f.ref_logprobs,
    "rollout_logprobs": lambda tr, r, f: r.logprobs,
    "reward_baselines": lambda tr, r, f: r.inputs.get("reward_baselines"),
    "sum_pi_squared": lambda tr, r, f: f.sum_pi_squared,
    "self_certainty": lambda tr, r, f: f.self_certainty,
    "reward_components": lambda tr, r, f: r.inputs.get("reward_components"),
    "reward_weights": lambda tr, r, f: r.inputs.get("reward_weights"),
    "dense_rewards": lambda tr, r, f: r.inputs.get("dense_rewards"),
    "group_keys": lambda tr, r, f: r.inputs.get("group_keys"),
    "prompt_mean": lambda tr, r, f: r.inputs.get("prompt_mean"),
    "prompt_var": lambda tr, r, f: r.inputs.get("prompt_var"),
    "prompt_count": lambda tr, r, f: r.inputs.get("prompt_count"),
    "prompt_steps": lambda tr, r, f: r.inputs.get("prompt_steps"),
    "prompt_step_var": lambda tr, r, f: r.inputs.get("prompt_step_var"),
    "ref_reward": lambda tr, r, f: r.inputs.get("ref_reward"),
    "answer_prob": lambda tr, r, f: r.inputs.get("answer_prob"),
    "bare_answer_prob": lambda tr, r, f: r.inputs.get("bare_answer_prob"),
    **{name: (lambda tr, r, f, name=name: r.inputs.get(name)) for name in TREE_INPUTS},
}


def estimate_inputs(trainer: Trainer, rollout: RolloutBatch, forwards: Forwards) -> dict[str, Any]:
    """The keywords of ``estimate()`` for a rollout: one producer per wanted input."""
    return {name: ESTIMATE[name](trainer, rollout, forwards)
            for name in wanted("advantage", trainer.fn.algorithm)}


# ----------------------------------------------------------------------------- update stage

UPDATE: dict[str, Callable[[Trainer, Micro], Any]] = {
    "group_size": lambda tr, m: m.batch.group_size,
    "values": lambda tr, m: m.values,
    "returns": lambda tr, m: m.cols(m.batch.returns),
    "old_values": lambda tr, m: m.cols(m.batch.old_values),
    "ref_logprobs": lambda tr, m: m.cols(m.batch.ref_logprobs),
    "entropy": lambda tr, m: m.entropy,
    # exactly on-policy (no old forward ran): the old policy is the current one at this forward
    "old_entropy": lambda tr, m: (m.cols(m.batch.old_entropy) if m.batch.old_entropy is not None
                                  else m.entropy.detach()),
    "rollout_logprobs": lambda tr, m: m.sub.logprobs[:, :m.tr],
    "entropy_coef": lambda tr, m: m.entropy_coef,
    "teacher_logprobs": lambda tr, m: m.cols(m.batch.teacher.logprobs),
    "teacher_topk_logprobs": lambda tr, m: m.cols(m.batch.teacher.topk_logprobs),
    "topk_logprobs": lambda tr, m: m.topk,
    "divergence": lambda tr, m: m.divergence,
    "sequence_rewards": lambda tr, m: torch.nan_to_num(m.batch.rewards[m.rows], nan=0.0),
    "router_aux": lambda tr, m: m.router_aux,
    # 0 where the reference's answers all failed: estimate() took that row out of the loss
    "ref_reward": lambda tr, m: torch.nan_to_num(m.sub.inputs["ref_reward"], nan=0.0),
    "policy_topk_logprobs": lambda tr, m: m.policy_topk,
    # exactly on-policy (no old forward ran): the update's own forward picked the top-K ids
    "old_topk_logprobs": lambda tr, m: (m.cols(m.batch.old_topk_logprobs) if m.batch.old_topk_logprobs is not None
                                        else m.policy_topk.detach()),
    "is_top1": lambda tr, m: m.cols(m.batch.is_top1) if m.batch.is_top1 is not None else m.is_top1,
}


def loss_inputs(trainer: Trainer, micro: Micro, device: torch.device) -> dict[str, Any]:
    """The input keywords of ``loss()`` for one micro-batch: one producer per wanted input."""
    out = {}
    for name in wanted("loss", trainer.fn.algorithm):
        v = UPDATE[name](trainer, micro)
        out[name] = v.to(device) if isinstance(v, Tensor) else v
    return out


def teacher_prompts(cfg: Any, tokenizer: Any, batch: RolloutBatch, examples: Sequence[Example]) -> None:
    """A privileged teacher's prompts (``teacher.context_key``) on ``batch``: each row's example's
    ``teacher_prompt`` (its prompt with the context column, rendered as the policy's is),
    tokenized as the engines tokenize a prompt; nothing without ``teacher.context_key``."""
    if cfg.teacher.context_key is None:
        return
    missing = [e.id for e in examples if not e.teacher_prompt]
    if missing:
        raise RunError(f"teacher.context_key={cfg.teacher.context_key}: the prompts of rows {missing[:5]} have "
                       "no teacher prompt (their source has no such column)")
    ids = tokenizer([e.teacher_prompt for e in examples])["input_ids"]
    batch.teacher_prompt_ids = repeat_each([list(map(int, i)) for i in ids], batch.group_size)
