"""The replay buffer of ``sampling replay(...)`` (rldsl/priority.py ``ReplayPolicy``, docs/replay.md).

A group that enters keeps what it was sampled with: its rows (token ids, masks, the engine's
logprobs of the behaviour policy, episodes), its prompt, its recorded rewards and the policy
version that sampled it. When it is replayed, those rows join a later step's batch marked
``RolloutBatch.replayed``: the trainer takes their recorded logprobs as pi_old, so the ratio is
pi_theta / mu and every correction and trust region acts on it unchanged (train/trainer.py).

One step (:meth:`ReplayBuffer.step`), in this order -- TRL's GRPOWithReplayBufferTrainer's order:
entries older than ``max_age`` versions leave; the step's groups that pass ``enter`` join (full:
a formula priority replaces the lowest entry if its own is higher, else the oldest entry
leaves); then the groups to replay are drawn from the whole buffer (``use=substitute``: in place
of the step's non-informative groups; ``use=mix``: after the step's fresh ones). Draws use a
generator seeded by the step, and the buffer is saved with checkpoints (:meth:`state_dict`):
a resumed run draws what its uninterrupted twin draws.

An agent's episode (``rollout.agent``) may make several rows, and its batch gives every episode
K rows (its own, then empty padding rows): a group is G episodes x K rows. An entry keeps its
group as it was (its K); a batch that holds groups of different K pads every episode to the most
(:func:`padded`), as the runner pads a batch's episodes. A group's statistics read one reward per
episode (:func:`episode_rewards`), so a group's priority does not depend on its K.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from rldsl.priority import GroupFormula, ReplayPolicy

from rldsl.inputs import INPUTS

from ..batch import AgentRow, Episode, RolloutBatch, StepRollout, group_rows
from ..models.vision import prompt_alone

#: the step's metrics (docs/runtime.md, "Metrics")
SIZE, FRACTION, AGE = "replay/size", "replay/fraction", "replay/age"


@dataclass(eq=False)
class Entry:
    """One kept group: its G rows as sampled, its prompt, its rewards [G], the version that
    sampled it, its priority and its place in the order of arrival (``seq``)."""

    batch: RolloutBatch
    prompt_id: Any
    reward_prompt: str
    rewards: torch.Tensor
    version: int
    priority: float
    seq: int
    # replay(advantage=keep): [G, Tr] the advantage of the group's first training (None: not yet)
    advantages: torch.Tensor | None = None


def _enters(policy: ReplayPolicy, rewards: torch.Tensor, informative: bool) -> bool:
    """``enter=nonzero_std``: scorable rewards not all equal; ``success``: some scorable reward > 0."""
    if policy.enter == "nonzero_std":
        return informative
    r = rewards[~torch.isnan(rewards)]
    return bool((r > 0).any())


def rows_per_episode(batch: RolloutBatch) -> int:
    """K: the rows each episode of an agent's batch has (``AgentRow.row`` 0..K-1); 1 otherwise."""
    eps = batch.episodes
    if not eps or eps[0].agent is None:
        return 1
    return max(e.agent.row for e in eps if e.agent is not None) + 1


def episode_rewards(rewards: torch.Tensor, K: int) -> torch.Tensor:
    """[E] one reward per episode of the rows' ``rewards`` [E*K]: an episode's rows carry its reward
    (or, rewarded per role, each row its role's and a padding row their mean): the rows' value when
    they agree, else their mean (NaN when one is: a failed episode)."""
    if K == 1:
        return rewards
    v = rewards.view(-1, K)
    return torch.where((v == v[:, :1]).all(1), v[:, 0], v.mean(1))


def padded(batch: RolloutBatch, rewards: torch.Tensor, K: int, pad_id: int) -> tuple[RolloutBatch, torch.Tensor]:
    """An agent's group (``batch``, its row ``rewards``) with every episode given ``K`` rows: its
    own, then empty ones as the runner makes them (rollout/agents/runner.py): no response token
    (loss mask and attention 0, nothing trained), finish ``length``, the episode's reward (its
    rows' mean when rewarded per role), its prompt and calls, ``AgentRow.padding``. A new row is a
    copy of the episode's last row when that is padding already, else of its first row, emptied;
    a vision-language policy's keeps its prompt's images only (the first row's response may hold a
    tool's pictures), as the runner's padding rows do."""
    k = rows_per_episode(batch)
    if k >= K:
        return batch, rewards
    src: list[int] = []
    new: list[int] = []
    for e in range(len(batch) // k):
        first, last = e * k, e * k + k - 1
        agent = batch.episodes[last].agent
        pad_row = last if agent is not None and agent.padding else first
        src += range(first, last + 1)
        for _ in range(k, K):
            new.append(len(src))
            src.append(pad_row)
    out = batch.select(torch.tensor(src))
    x = torch.tensor(new)
    out.response_ids[x] = pad_id
    out.response_mask[x] = 0
    out.logprobs[x] = 0.0
    for name in ("response_attention", "token_versions", "routed_experts"):
        t = getattr(out, name)
        if t is not None:
            t[x.to(t.device)] = 0 if name == "response_attention" else -1
    for name, t in out.inputs.items():
        if INPUTS[name].dims[:2] == ("B", "T"):  # per-token inputs: nothing on an empty response
            t[x.to(t.device)] = 0
    ep_reward = episode_rewards(rewards, k)
    terms = {name: episode_rewards(t, k) for name, t in batch.reward_terms.items()}
    for j in new:
        e, row = j // K, j % K
        out.finish_reason[j] = "length"
        prompt_alone(out.prompts, out.images, out.image_inputs, j)  # a vision-language policy's: its prompt's images
        out.episodes[j] = _padding_episode(out.episodes[j], row, batch.episodes[e * k:(e + 1) * k])
        for name, t in out.reward_terms.items():
            t[j] = terms[name][e]
    out.group_size = len(src) // len(batch) * batch.group_size
    r = rewards[torch.tensor(src)].clone()
    r[x] = ep_reward.repeat_interleave(K - k).to(r.dtype)
    return out, r


def _padding_episode(episode: Episode, row: int, rows: list[Episode]) -> Episode:
    """Row ``row`` of an episode (``rows``: its rows' episodes) as a padding row, copied from
    ``episode`` (one of them): the episode's opening messages (before the model's first turn), its
    calls and error, and the agent's reward as the runner gives a padding row (rewarded per role:
    the mean of the rows' rewards; None when one is)."""
    a = episode.agent
    assert a is not None
    messages = episode.messages
    if not a.padding:
        turn = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        messages = messages[:turn]
    values = [x.env_reward for x in rows]
    env = None if any(v is None for v in values) else values[0] if len(set(values)) == 1 else \
        sum(values) / len(values)  # type: ignore[arg-type]
    return Episode(list(messages), env, error=episode.error,
                   agent=AgentRow(row, a.rows, True, a.prefix_breaks, a.calls))


def _weight(p: float) -> float:
    return p if math.isfinite(p) and p > 0 else 0.0


class ReplayBuffer:
    """The kept groups of a run and the rule that replays them (module docstring)."""

    def __init__(self, policy: ReplayPolicy, pad_id: int) -> None:
        self.policy, self.pad_id = policy, pad_id
        self.entries: list[Entry] = []
        self.seq = 0
        # the entry at each group place of the last step's batch (None: a fresh group not kept)
        self.placed: list[Entry | None] = []

    def __len__(self) -> int:
        return len(self.entries)

    # -- what a step asks

    def fresh_groups(self, P: int) -> int:
        """How many groups a step generates: P, less what ``use=mix`` takes from the buffer as it is
        now (a synchronous run; an asynchronous one generates P - ``ReplayPolicy.mixed(P)``)."""
        return P - self._mix_count(P)

    def _mix_count(self, P: int) -> int:
        return min(self.policy.mixed(P), len(self.entries))

    def step(self, made: StepRollout, version: int, informative: torch.Tensor, P: int,
             generator: torch.Generator, now: int | None = None,
             ahead: bool = False) -> tuple[StepRollout, dict[str, float]]:
        """The step's batch with replayed groups, and its ``replay/*`` metrics; ``informative`` [P']
        is the fresh groups' (``DataPlan.informative``), ``version`` the policy that sampled them,
        ``now`` the policy this step trains (an asynchronous run's is newer: the ages count the
        versions between, as its staleness does; synchronous: ``version``). ``ahead``: the fresh
        groups were generated ahead by a producer that never reads the buffer (``use=mix``: it made
        P - ``policy.mixed(P)``); the mix share is then drawn here, at the step, from the entries
        left after the staleness rule against ``now`` and the step's own groups joined -- as many
        as the policy takes, or all the buffer holds when it holds fewer."""
        p = self.policy
        now = version if now is None else now
        mixed = self._mix_count(P)  # decided on the buffer before this step's groups join (fresh_groups)
        self.entries = [e for e in self.entries if p.max_age is None or now - e.version <= p.max_age]
        G, K = made.batch.group_size, rows_per_episode(made.batch)
        rewards = made.scored.view(-1, G)
        ok = informative.tolist()  # the rows' (the advantage's): for an agent, its episodes' rewards not all equal
        self.placed = [self._add(made, g, version) if _enters(p, episode_rewards(rewards[g], K), ok[g])
                       else None
                       for g in range(rewards.shape[0])]
        if p.use == "mix":
            slots, k = [], (min(p.mixed(P), len(self.entries)) if ahead else mixed)
        else:
            slots = [g for g, good in enumerate(ok) if not good]
            if p.per_step:
                slots = slots[: p.per_step]
            k = len(slots) if self.entries else 0
            slots = slots[:k]
        chosen = self.choose(k, generator)
        out = self._batch(made, slots, chosen, now)
        n = len(out.prompt_ids)
        m = {SIZE: float(len(self.entries)), FRACTION: len(chosen) / n if n else 0.0,
             AGE: sum(now - e.version for e in chosen) / len(chosen) if chosen else 0.0}
        return out, m

    # -- the rule

    def _add(self, made: StepRollout, g: int, version: int) -> Entry | None:
        """Group ``g`` of ``made`` into the buffer by the rule; the entry, or None when not kept."""
        p = self.policy
        G = made.batch.group_size
        r = made.scored[g * G:(g + 1) * G]
        # a formula reads one reward per episode (an agent's K rows are one episode)
        prio = p.priority(episode_rewards(r, rows_per_episode(made.batch))) \
            if isinstance(p.priority, GroupFormula) else 1.0
        entry = Entry(made.batch.select(group_rows([g], G)), made.prompt_ids[g], made.reward_prompts[g]
                      if made.reward_prompts else "", r.clone(), version, prio, self.seq)
        self.seq += 1
        if len(self.entries) < p.capacity:
            self.entries.append(entry)
            return entry
        if isinstance(p.priority, GroupFormula):  # TRL's rule: replace the lowest if higher
            low = min(range(len(self.entries)), key=lambda i: (_weight(self.entries[i].priority), self.entries[i].seq))
            if _weight(prio) > _weight(self.entries[low].priority):
                del self.entries[low]
                self.entries.append(entry)
                return entry
            return None
        self.entries.pop(0)  # uniform / newest: the oldest leaves (entries are kept in arrival order)
        self.entries.append(entry)
        return entry

    def probabilities(self) -> torch.Tensor:
        """[len] float64: the chance of each entry (in arrival order) at one draw."""
        p = self.policy
        w = torch.tensor([_weight(e.priority) if isinstance(p.priority, GroupFormula) else 1.0
                          for e in self.entries], dtype=torch.float64)
        if float(w.sum()) <= 0:
            w = torch.ones_like(w)
        return w / w.sum()

    def choose(self, k: int, generator: torch.Generator) -> list[Entry]:
        """``k`` entries: the newest ones (``newest``), or drawn by priority (or uniformly),
        without replacement unless ``k`` is more than the buffer holds."""
        if k <= 0 or not self.entries:
            return []
        if self.policy.priority == "newest":
            newest = self.entries[::-1]
            return [newest[i % len(newest)] for i in range(k)]
        idx = torch.multinomial(self.probabilities(), k, replacement=k > len(self.entries), generator=generator)
        return [self.entries[i] for i in idx.tolist()]

    def _batch(self, made: StepRollout, slots: list[int], chosen: list[Entry], now: int) -> StepRollout:
        """The fresh groups with ``chosen`` in ``slots`` (substitute) or after them (mix); the
        result keeps ``made`` as its ``fresh`` groups and each place's age (None: fresh). An
        agent's groups of different K (rows per episode) are padded to the most: the batch may
        have more rows than its fresh groups had."""
        G = made.batch.group_size
        P = len(made.prompt_ids)
        if not chosen:  # the batch is the fresh groups (samples.jsonl still says so)
            return dataclasses.replace(made, replay_ages=[None] * P)
        fresh = [(made.batch.select(group_rows([g], G)), made.prompt_ids[g],
                  made.reward_prompts[g] if made.reward_prompts else "", made.scored[g * G:(g + 1) * G], False)
                 for g in range(P)]
        replayed = [(self._kept(e), e.prompt_id, e.reward_prompt, e.rewards, True) for e in chosen]
        ages: list[int | None] = [None] * P
        if slots:
            for s, r, e in zip(slots, replayed, chosen):
                fresh[s] = r
                self.placed[s] = e
                ages[s] = now - e.version
            parts = fresh
        else:
            parts = fresh + replayed
            self.placed += chosen
            ages += [now - e.version for e in chosen]
        K = max(rows_per_episode(x[0]) for x in parts)
        laid = [padded(b, r, K, self.pad_id) for b, _, _, r, _ in parts]
        batch = RolloutBatch.concat([dataclasses.replace(b, replayed=torch.full((len(b),), x[4], dtype=torch.bool))
                                     for (b, _), x in zip(laid, parts)], self.pad_id)
        return StepRollout(made.step, batch, [x[1] for x in parts], [x[2] for x in parts],
                           torch.cat([r.to(made.scored.dtype) for _, r in laid]), made.metrics,
                           fresh=made, replay_ages=ages)

    # -- advantage=keep

    def _kept(self, e: Entry) -> RolloutBatch:
        """The entry's rows, with the advantage it keeps (``advantage=keep``, once it has one)."""
        if not self.keeps_advantages or e.advantages is None:
            return e.batch
        return dataclasses.replace(e.batch, kept_advantages=e.advantages)

    @property
    def keeps_advantages(self) -> bool:
        """``advantage=keep``: the step tells :meth:`trained` the advantages it trained with."""
        return self.policy.advantage == "keep"

    def trained(self, advantages: torch.Tensor, replayed: torch.Tensor | None) -> None:
        """The advantages [B, Tr] the step's batch was trained with (``replayed``: its rows'
        ``RolloutBatch.replayed``): each entry placed in it that keeps none yet keeps its rows'
        -- its first training, as a fresh group in the step that sampled it, or at its first
        replay when its own place went to a replayed group (a fresh place counts first)."""
        if not self.keeps_advantages:
            return
        G = advantages.shape[0] // max(1, len(self.placed))
        was = [False] * len(self.placed) if replayed is None else replayed.view(-1, G)[:, 0].tolist()
        for g in sorted(range(len(self.placed)), key=lambda g: was[g]):  # a fresh place before a replayed one
            e = self.placed[g]
            if e is not None and e.advantages is None:
                width = e.batch.response_ids.shape[1]
                group = advantages[g * G:(g + 1) * G, :width]
                k = rows_per_episode(e.batch)  # an agent's: the entry's K rows of each episode (the batch may pad more)
                group = group.reshape(len(e.batch) // k, -1, width)[:, :k].reshape(-1, width)
                e.advantages = group.detach().float().cpu().clone()

    # -- checkpoints

    def state_dict(self, plain_batch: Any) -> dict[str, Any]:
        """The buffer as plain values (``plain_batch``: run/checkpointing.py's batch writer)."""
        return {"seq": self.seq, "entries": [
            {"batch": plain_batch(e.batch), "prompt_id": e.prompt_id, "reward_prompt": e.reward_prompt,
             "rewards": e.rewards, "version": e.version, "priority": e.priority, "seq": e.seq,
             "advantages": e.advantages}
            for e in self.entries]}

    def load_state_dict(self, state: dict[str, Any], batch_of: Any) -> None:
        self.seq = int(state["seq"])
        self.entries = [Entry(batch_of(e["batch"]), e["prompt_id"], e["reward_prompt"], e["rewards"],
                              int(e["version"]), float(e["priority"]), int(e["seq"]), e.get("advantages"))
                        for e in state["entries"]]
