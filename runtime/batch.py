"""``TokenRow``: one sampled row as its producer made it (an engine, the episode runner, an
agent's runner); ``RolloutBatch``: what the engines return and the trainer consumes, the rows
padded by :meth:`RolloutBatch.from_rows`, and its operations; ``Episode``: one row's multi-turn episode (``RolloutBatch.episodes``); ``StepRollout``: one
training step's batch with its rewards, from generation to the optimizer.

Shapes: P prompts x G samples per prompt, B = P*G rows, groups contiguous
(rows g*G .. g*G+G-1 answer prompt g). Tp = prompt length (left padded),
Tr = response length (right padded), L = Tp + Tr.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

from rldsl.inputs import INPUTS


@dataclass
class AgentRow:
    """What an agent's episode (``rollout.agent``, ``rollout.env = verifiers:|openenv:``) adds to
    a row's :class:`Episode`: an agent's episode is made of its recorded model calls, which make
    one training row or several (runtime/rollout/agents/calls.py).

    row             which of the episode's rows this one is (0-based); the metrics count an
                    episode once, on its row 0
    rows            the rows the episode's calls made (0 when no call was answered)
    padding         an empty row added so that every episode of the batch has as many rows
                    (loss mask 0: nothing trained)
    prefix_breaks   the episode's calls that could not continue an earlier call's ids
    calls           each model call of the episode, in order, as samples.jsonl keeps it:
                    ``route`` ("chat" | "completions" | "generate"), ``row`` (the row holding
                    it; None when none does), ``prompt_tokens``, ``completion_ids``,
                    ``finish_reason``, ``version`` (the policy version that sampled it),
                    ``bridged`` (a chat call whose prompt continued an earlier call's ids)
    """

    row: int = 0
    rows: int = 0
    padding: bool = False
    prefix_breaks: int = 0
    calls: list[dict] = field(default_factory=list)

    @property
    def versions(self) -> list[int]:
        """The policy versions that sampled the episode's calls, ascending."""
        return sorted({c["version"] for c in self.calls})


@dataclass
class Episode:
    """One row's multi-turn episode (``RolloutBatch.episodes``: one per row, in row order):
    built by the episode runner (runtime/rollout/episodes/runner.py: tools, ``rollout.env``) or
    an agent's runner (runtime/rollout/agents/runner.py: ``rollout.agent``, verifiers, OpenEnv);
    read by the ``env`` reward term (rewards/functions.py), per-turn rewards (train/inputs.py),
    the tool-call and agent metrics, and samples.jsonl (records/samples.py).

    messages        the conversation as samples.jsonl keeps it: the opening messages, then the
                    model's turns (``assistant``) and what the environment answered (``tool``,
                    ``user``; an agent's text calls: ``environment``)
    env_reward      the environment's reward: the sum of its steps' rewards (None: it gave
                    none), an agent's return value (None: it returned None, or failed; a
                    reward per role: this row's role's)
    step_rewards    [position, reward] of each turn the environment rewarded, the position the
                    response token that ended the turn (``rewards dense``); None for an agent's
                    episode, which has one reward and no turns of its own
    error           why an agent's episode failed (None: it did not): the ``env`` term reports
                    it to ``reward.on_error``
    agent           an agent's episode: which of its rows this is, its calls; None otherwise
    """

    messages: list[dict] = field(default_factory=list)
    env_reward: float | None = None
    step_rewards: list[list[float]] | None = None
    error: str | None = None
    agent: AgentRow | None = None

    def plain(self) -> dict[str, Any]:
        """The episode as plain values (what a checkpoint keeps; ``torch.load(weights_only=True)``
        reads only those): the dict an episode was before it had a type, read back by
        :meth:`from_plain`."""
        if self.agent is None:
            return {"messages": self.messages, "env_reward": self.env_reward, "step_rewards": self.step_rewards}
        a = self.agent
        return {"env_reward": self.env_reward, "error": self.error, "calls": a.calls, "messages": self.messages,
                "row": a.row, "agent": {"calls": len(a.calls), "prefix_breaks": a.prefix_breaks, "rows": a.rows,
                                        "error": self.error, "versions": a.versions},
                **({"padding": True} if a.padding else {})}

    @classmethod
    def from_plain(cls, d: dict[str, Any]) -> "Episode":
        """The episode of :meth:`plain`'s dict."""
        agent = d.get("agent")
        return cls(list(d.get("messages", [])), d.get("env_reward"), d.get("step_rewards"), d.get("error"),
                   None if agent is None else AgentRow(d.get("row", 0), agent.get("rows", 0),
                                                       bool(d.get("padding")), agent.get("prefix_breaks", 0),
                                                       list(d.get("calls", []))))


@dataclass
class TokenRow:
    """One sampled row, as every producer makes it: both engines (engines/hf.py,
    engines/vllm/convert.py), the episode runner (rollout/episodes/runner.py) and the agents'
    runner (rollout/agents/runner.py). :meth:`RolloutBatch.from_rows` pads rows into a batch, the
    one place that does: a new per-token field is a field here and a line there.

    prompt_ids      [p] the prompt's token ids (no padding)
    response_ids    [n] the response's token ids: the model's, and a multi-turn episode's
                    environment tokens between its turns
    logprobs        [n] the engine's logprob of each sampled token, 0 on the environment's
    finish_reason   "stop" | "length"
    prompt          the prompt's text (``RolloutBatch.prompts``)
    completion      the completion's text (``RolloutBatch.completions``)
    mask            [n] the loss mask: 1 on the model's tokens, 0 on the environment's; None = every
                    response token is the model's (an engine's row: the batch then has no
                    ``response_attention``)
    routed_experts  [p + fed, Y, K] the experts of each fed token from the prompt's first one (-1:
                    none recorded); None = not recorded (a mixture-of-experts policy's,
                    runtime/models/moe.py)
    episode         the row's multi-turn episode; None = single-turn
    images          the images its ids hold (a vision-language policy's: their references, data:
                    URLs or paths), in token order
    """

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    logprobs: Sequence[float]
    finish_reason: str
    prompt: str
    completion: str
    mask: Sequence[int] | None = None
    routed_experts: torch.Tensor | None = None
    episode: Episode | None = None
    images: Sequence[str] = ()


@dataclass
class RolloutBatch:
    """What a rollout engine returns for P prompts x G samples (B = P*G rows).

    prompt_ids      [B, Tp]  left padded with the pad id
    prompt_mask     [B, Tp]  1 on real prompt tokens
    response_ids    [B, Tr]  right padded with the pad id
    response_mask   [B, Tr]  1 on generated tokens up to and including the first EOS
    logprobs        [B, Tr]  engine's logprob of each sampled token under the sampling
                             distribution (temperature applied), 0 on padding; kept to
                             measure the train/inference mismatch, never used as policy
                             logprobs
    finish_reason   B x "stop" (EOS produced) | "length" (max_new_tokens reached)
    prompts         B x prompt text (repeated G times)
    completions     B x decoded completion text (without special tokens)
    group_size      G
    inputs          optional inputs of estimate() made at rollout time, by name (the table
                    in rldsl/inputs.py, made by runtime/train/inputs.py ROLLOUT), only when
                    the spec reads them: e.g. reward_baselines [B] (ReMax's greedy reward),
                    reward_components [B, K] and reward_weights [K] (GDPO), dense_rewards
                    [B, Tr]. Rows are selected and concatenated for the inputs whose shape
                    starts with B ([B, T] ones padded on the right with 0).
    episodes        B x :class:`Episode`, each row's multi-turn episode (empty: single-turn)
    reward_terms    each reward term's value [B] by its label (``rewards.functions.term_labels``;
                    NaN where that term failed), set where the batch is scored: the step's
                    ``rewards/<term>/mean|std`` metrics and samples.jsonl read them
    teacher_prompt_ids  B x the token ids of the row's privileged teacher prompt
                    (``teacher.context_key``: its prompt with a data column in it), set where the
                    batch is made (run/step_batch.py); the teacher scores the same response tokens
                    after it (train/teachers.py ``privileged``); empty = the row's own prompt
    routed_experts  [B, Tp + Tr, Y, K] int16 (a mixture-of-experts policy): the experts the engine
                    routed each token to in each of the Y sparse layers, aligned with
                    ``model_inputs``' columns; -1 where nothing was recorded (padding, a response's
                    last token, an engine that cannot record); None = not recorded
                    (runtime/models/moe.py, ``rollout.routing_replay``)
    images          B x the images each row's ids hold (references: data: URLs or paths), in token
                    order (a vision-language policy's, docs/vlm.md); empty = no row has one
    image_inputs    B x each row's images as its model kind processed them once, on the rollout side
                    (models/kinds/: a Qwen2-VL policy's ``pixel_values`` [P, D] and ``image_grid_thw``
                    [g, 3], plain tensors), None for a row without images; the trainer's forwards read
                    them. Empty = not made (a batch of an older checkpoint: the kind processes ``images``)
    replayed        [B] bool (``sampling replay``, rollout/replay.py): the rows of groups replayed
                    from earlier steps; the trainer takes their ``logprobs`` as pi_old; None = none
    tree            B x (parent, split) (``sampling tree``, rollout/tree.py): the row of its group
                    each row forked from (-1: sampled from the prompt) and the response position
                    where its own tokens start; empty = the rows are no tree
    kept_advantages [B, Tr] float (``replay(advantage=keep)``): the advantage a replayed row keeps,
                    which the trainer's estimate puts in place of the recomputed one; NaN on the
                    rows that keep none (fresh rows); None = no row keeps one
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: list[str]
    prompts: list[str]
    completions: list[str]
    group_size: int
    answers: list[str] = field(default_factory=list)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    # multi-turn episodes (runtime/rollout/episodes/, agents/): 1 on every real response token, model and
    # environment (response_mask stays the loss mask: the model's tokens); None = response_mask
    response_attention: torch.Tensor | None = None
    episodes: list[Episode] = field(default_factory=list)  # multi-turn: each row's episode
    # partial rollouts (runtime/rollout/partial.py): the policy version that sampled each response token,
    # -1 on padding; None = one version for the whole batch
    token_versions: torch.Tensor | None = None
    reward_terms: dict[str, torch.Tensor] = field(default_factory=dict)
    # a privileged teacher's prompt of each row (teacher.context_key), as token ids; empty = none
    teacher_prompt_ids: list[list[int]] = field(default_factory=list)
    routed_experts: torch.Tensor | None = None
    images: list[list[str]] = field(default_factory=list)
    image_inputs: list[dict[str, torch.Tensor] | None] = field(default_factory=list)

    # sampling replay (rollout/replay.py): [B] bool, True on the rows of a replayed group, whose
    # ``logprobs`` (the behaviour policy's, recorded) are their pi_old; None = no replayed row
    replayed: torch.Tensor | None = None
    kept_advantages: torch.Tensor | None = None
    # sampling tree (rollout/tree.py): each row's (parent, split) in its group's tree -- the row of its
    # group it forked from (-1: sampled from the prompt) and the response position its own tokens
    # start at; empty = the rows are no tree
    tree: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def from_rows(cls, rows: Sequence[TokenRow], group_size: int, pad_id: int, width: int = 1) -> "RolloutBatch":
        """The batch of ``rows`` (B of them, groups of ``group_size`` contiguous): prompts left padded
        with ``pad_id`` to the longest (Tp), responses right padded to the longest or ``width``
        columns, whichever is more (Tr; an engine keeps the columns it sampled); logprobs and the
        masks with 0, routing with -1 (:func:`routing_columns`). ``response_attention`` (1 on every
        response token) when a row has a loss mask of its own; ``episodes`` when every row has one."""
        Tp = max(len(r.prompt_ids) for r in rows)
        Tr = max(width, max(len(r.response_ids) for r in rows))

        def left(xs: Sequence, fill: Any) -> list:
            return [fill] * (Tp - len(xs)) + list(xs)

        def right(xs: Sequence, fill: Any) -> list:
            return list(xs) + [fill] * (Tr - len(xs))

        # one tensor per field from padded lists: a row's tensor operations cost more than its tokens
        p_ids = torch.tensor([left(r.prompt_ids, pad_id) for r in rows], dtype=torch.long)  # [B, Tp]
        p_mask = torch.tensor([left([1] * len(r.prompt_ids), 0) for r in rows], dtype=torch.long)  # [B, Tp]
        r_ids = torch.tensor([right(r.response_ids, pad_id) for r in rows], dtype=torch.long)  # [B, Tr]
        r_mask = torch.tensor([right([1] * len(r.response_ids) if r.mask is None else r.mask, 0) for r in rows],
                              dtype=torch.long)  # [B, Tr]
        r_attn = torch.tensor([right([1] * len(r.response_ids), 0) for r in rows], dtype=torch.long)  # [B, Tr]
        logprobs = torch.tensor([right(r.logprobs, 0.0) for r in rows], dtype=torch.float32)  # [B, Tr]
        routed = routing_columns([r.routed_experts for r in rows], [len(r.prompt_ids) for r in rows], Tp, Tr)
        return cls(p_ids, p_mask, r_ids, r_mask, logprobs, [r.finish_reason for r in rows],
                   [r.prompt for r in rows], [r.completion for r in rows], group_size,
                   response_attention=None if all(r.mask is None for r in rows) else r_attn,
                   episodes=[r.episode for r in rows] if all(r.episode is not None for r in rows) else [],
                   routed_experts=routed, images=_optional_rows([list(r.images) for r in rows]))

    @property
    def attention(self) -> torch.Tensor:
        """[B, Tr] the response tokens attended to: ``response_attention``, else ``response_mask``."""
        return self.response_mask if self.response_attention is None else self.response_attention

    @property
    def truncated(self) -> torch.Tensor:
        """[B] bool: the sample hit max_new_tokens without an EOS."""
        return torch.tensor([f == "length" for f in self.finish_reason], dtype=torch.bool,
                            device=self.response_ids.device)

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "RolloutBatch":
        """The batch of the given rows, in that order (callers keep groups whole)."""
        keep = rows.tolist()
        return RolloutBatch(self.prompt_ids[rows], self.prompt_mask[rows], self.response_ids[rows],
                            self.response_mask[rows], self.logprobs[rows],
                            [self.finish_reason[i] for i in keep], [self.prompts[i] for i in keep],
                            [self.completions[i] for i in keep], self.group_size,
                            _picked(self.answers, keep),
                            {k: v[rows] if _per_row(k) else v for k, v in self.inputs.items()},
                            None if self.response_attention is None else self.response_attention[rows],
                            _picked(self.episodes, keep),
                            None if self.token_versions is None else self.token_versions[rows],
                            {k: v[rows] for k, v in self.reward_terms.items()},
                            _picked(self.teacher_prompt_ids, keep),
                            None if self.routed_experts is None else self.routed_experts[rows.to(
                                self.routed_experts.device)],
                            _picked(self.images, keep), _picked(self.image_inputs, keep),
                            replayed=None if self.replayed is None else self.replayed[rows.to(self.replayed.device)],
                            kept_advantages=None if self.kept_advantages is None else
                            self.kept_advantages[rows.to(self.kept_advantages.device)],
                            tree=_picked(self.tree, keep))

    def select_groups(self, groups: Sequence[int]) -> "RolloutBatch":
        """The batch of whole prompt groups (group g = rows g*G .. g*G+G-1)."""
        return self.select(group_rows(groups, self.group_size))

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """The batch with its tensors on ``device`` (itself when they are there already)."""
        device = torch.device(device)
        if self.response_ids.device == device:
            return self
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                            for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)},
                                   inputs={k: v.to(device) for k, v in self.inputs.items()})

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"], pad_id: int) -> "RolloutBatch":
        """Stack batches of the same G (prompts padded on the left, responses on the right)."""
        if len(batches) == 1:
            return batches[0]
        sizes = sorted({b.group_size for b in batches})
        if len(sizes) > 1:  # an agent's episodes broke into a different number of rows per batch
            raise ValueError(f"cannot stack batches of group sizes {sizes}: each prompt's rows must "
                             "be one group of one size")
        Tp = max(b.prompt_ids.shape[1] for b in batches)
        Tr = max(b.response_ids.shape[1] for b in batches)

        def left(t: torch.Tensor, n: int, v: int) -> torch.Tensor:
            return torch.nn.functional.pad(t, (n - t.shape[1], 0), value=v)

        def right(t: torch.Tensor, n: int, v: float) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, n - t.shape[1]), value=v)

        return RolloutBatch(
            prompt_ids=torch.cat([left(b.prompt_ids, Tp, pad_id) for b in batches]),
            prompt_mask=torch.cat([left(b.prompt_mask, Tp, 0) for b in batches]),
            response_ids=torch.cat([right(b.response_ids, Tr, pad_id) for b in batches]),
            response_mask=torch.cat([right(b.response_mask, Tr, 0) for b in batches]),
            logprobs=torch.cat([right(b.logprobs, Tr, 0.0) for b in batches]),
            finish_reason=sum((b.finish_reason for b in batches), []),
            prompts=sum((b.prompts for b in batches), []),
            completions=sum((b.completions for b in batches), []),
            group_size=batches[0].group_size,
            answers=sum((b.answers for b in batches), []),
            inputs={k: torch.cat([right(b.inputs[k], Tr, 0.0) if _per_token(k) else b.inputs[k] for b in batches])
                    if _per_row(k) else v
                    for k, v in batches[0].inputs.items() if all(k in b.inputs for b in batches)},
            response_attention=None if all(b.response_attention is None for b in batches) else
            torch.cat([right(b.attention, Tr, 0) for b in batches]),
            episodes=sum((b.episodes for b in batches), []) if all(b.episodes for b in batches) else [],
            token_versions=None if any(b.token_versions is None for b in batches) else
            torch.cat([right(b.token_versions, Tr, -1) for b in batches]),
            reward_terms={k: torch.cat([b.reward_terms[k] for b in batches]) for k in batches[0].reward_terms
                          if all(k in b.reward_terms for b in batches)},
            teacher_prompt_ids=sum((b.teacher_prompt_ids for b in batches), [])
            if all(b.teacher_prompt_ids for b in batches) else [],
            routed_experts=None if any(b.routed_experts is None for b in batches) else
            torch.cat([_pad_routing(b, Tp, Tr) for b in batches]),
            images=_optional_rows(sum((b.images or [[] for _ in range(len(b))] for b in batches), [])),
            image_inputs=_joined([b.image_inputs for b in batches]),
            replayed=None if all(b.replayed is None for b in batches) else
            torch.cat([torch.zeros(len(b), dtype=torch.bool) if b.replayed is None else b.replayed.cpu()
                       for b in batches]),
            kept_advantages=None if all(b.kept_advantages is None for b in batches) else
            torch.cat([right(torch.full(b.response_ids.shape, float("nan")) if b.kept_advantages is None
                             else b.kept_advantages.cpu(), Tr, float("nan")) for b in batches]),
            tree=_joined([b.tree for b in batches]),
        )


@dataclass
class StepRollout:
    """The rollout batch of one training step, the one record that carries it from generation
    through the asynchronous producer's queue and scoring to the trainer (run/step.py).

    step            the training step (0-based) it is for
    batch           B = P*G rows, groups contiguous
    prompt_ids      P ids of the prompts in their source (the pass-rate cap retires them)
    reward_prompts  P texts the reward reads for each prompt (``Example.reward_prompt``)
    rewards         [B] each row's reward, NaN where it failed; None until scored
    metrics         the rollout's own metrics: ``time/rollout_s``, ``time/reward_s``,
                    ``sampling_rounds``, ``reward_errors``, ...
    fresh           ``sampling replay`` (rollout/replay.py): the step's generated groups before
                    replayed ones took places in it or joined it (what the rollout metrics, the
                    curriculum and the pass-rate cap read: :attr:`generated`); None: no group
                    of the batch is replayed
    replay_ages     ``sampling replay``: P entries, a replayed group's age in policy versions,
                    None for a fresh one (samples.jsonl); None: no group is replayed
    """

    step: int
    batch: RolloutBatch
    prompt_ids: list[int]
    reward_prompts: list[str]
    rewards: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    fresh: "StepRollout | None" = None
    replay_ages: list[int | None] | None = None

    @property
    def generated(self) -> "StepRollout":
        """The groups this step generated (``fresh``; the batch itself when nothing is replayed)."""
        return self if self.fresh is None else self.fresh

    @property
    def scored(self) -> torch.Tensor:
        """[B] the rewards, which must be there (an error names the step's missing stage)."""
        if self.rewards is None:
            raise ValueError("this rollout is not scored yet")
        return self.rewards


def _pad_routing(b: RolloutBatch, Tp: int, Tr: int) -> torch.Tensor:
    """``b.routed_experts`` [b, Tp_b + Tr_b, Y, K] padded (with -1) to [b, Tp + Tr, Y, K]: on the
    left of the prompt columns, the right of the response ones."""
    r = b.routed_experts
    assert r is not None
    tp, tr = b.prompt_ids.shape[1], b.response_ids.shape[1]
    return torch.nn.functional.pad(r, (0, 0, 0, 0, Tp - tp, Tr - tr), value=-1)


def sequence_routing(batch: RolloutBatch, row: int, fed: int, sampled: int) -> "torch.Tensor | None":
    """[fed + sampled, Y, K] the recorded experts of row ``row`` of an engine's batch as one
    sequence: its ``fed`` prompt tokens (left padded) then its first ``sampled`` response tokens;
    None when the batch carries no routing. Multi-turn episodes and agents stitch these per turn
    (:func:`first_records`) and lay them out with :func:`routing_columns`."""
    if batch.routed_experts is None:
        return None
    Tp = batch.prompt_ids.shape[1]
    rec = batch.routed_experts[row]  # [Tp + Tr, Y, K]
    return torch.cat([rec[Tp - fed:Tp], rec[Tp:Tp + sampled]])


def first_records(before: "torch.Tensor | None", now: "torch.Tensor") -> "torch.Tensor":
    """A sequence's routing after one more engine call on it: ``now`` [n, Y, K] (the call's
    prefill and samples), whose first tokens keep the record ``before`` [k <= n, Y, K] gave them
    where it has one -- the routing under which the following tokens were sampled; the rest (the
    environment's tokens since, the previous call's last token, no forward fed it) take ``now``'s."""
    if before is None:
        return now
    k = before.shape[0]
    kept = (before >= 0).all(-1).all(-1)  # [k]
    out = now.clone()
    out[:k] = torch.where(kept[:, None, None], before, now[:k])
    return out


def routing_columns(records: Sequence["torch.Tensor | None"], prompt_lengths: Sequence[int], Tp: int,
                    Tr: int) -> "torch.Tensor | None":
    """``routed_experts`` [B, Tp + Tr, Y, K] of rows whose sequences' records (prompt then response
    tokens, [n_b, Y, K]; None: a row nothing was sampled for, all -1) start at column Tp -
    prompt_lengths[b]; None when no row has a record."""
    known = [r for r in records if r is not None]
    if not known:
        return None
    Y, K = known[0].shape[1:]
    out = torch.full((len(records), Tp + Tr, Y, K), -1, dtype=known[0].dtype)
    for b, (rec, p) in enumerate(zip(records, prompt_lengths)):
        if rec is not None:
            out[b, Tp - p:Tp - p + rec.shape[0]] = rec
    return out


def _picked(items: list, keep: list[int]) -> list:
    """An optional per-row list field (empty: none) of the rows ``keep``."""
    return [items[i] for i in keep] if items else []


def _joined(fields: list[list]) -> list:
    """An optional per-row list field of several batches joined; [] (none) unless every batch has it."""
    return sum(fields, []) if all(fields) else []


def _optional_rows(items: list[list]) -> list[list]:
    """A per-row list field of B rows, or [] when every row's is empty (the field's "none")."""
    return items if any(items) else []


def _per_row(name: str) -> bool:
    """Input ``name`` has one entry per row (its shape starts with B): select and concat it by rows."""
    return INPUTS[name].dims[:1] == ("B",)


def _per_token(name: str) -> bool:
    """Input ``name`` is [B, T, ...]: responses of several batches are padded to one T (with 0)."""
    return INPUTS[name].dims[1:2] == ("T",)


def group_rows(groups: Sequence[int] | torch.Tensor, group_size: int) -> torch.Tensor:
    """Row indices [len(groups) * G] of whole prompt groups, group by group."""
    g = torch.as_tensor(groups, dtype=torch.long).reshape(-1, 1)  # [n, 1]
    return (g * group_size + torch.arange(group_size)).reshape(-1)


def repeat_each(items: Sequence, times: int) -> list:
    """``[a, a, b, b]`` for ``[a, b]`` and 2: one entry per sample, groups contiguous."""
    return [x for x in items for _ in range(times)]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions counting only real tokens: ``cumsum(mask) - 1`` clamped at 0.

    What ``generate`` uses for left-padded prompts, so a recompute sees the positions
    sampling saw (without them, padded rows were off by up to 3.6 nats: docs/toy.md).
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def model_inputs(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, L], attention_mask [B, L], position_ids [B, L] of prompt + response."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)  # [B, L]
    attn = torch.cat([batch.prompt_mask, batch.attention], dim=1).long()  # [B, L]
    return ids, attn, position_ids_from_mask(attn)
