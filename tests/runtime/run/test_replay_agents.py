"""``sampling replay`` with an agent's episodes (``rollout.agent``, docs/replay.md "Agents"): an
episode may make several rows, a batch gives each of its episodes K rows (the missing ones
padding), so groups kept from batches of different K are padded to one batch's most.

The agent is tests/runtime/agent_helpers.py ``odd_answers_break`` on a tiny model behind the
agents' endpoint: an episode makes two rows when its row's answer is odd, one otherwise, so the
answers below set each step's K; the rewards come from a table (one per episode), so which groups
enter and are chosen is hand-computed; the ratios and the loss of each step are recomputed here
from each row run alone and the replayed rows' recorded behaviour logprobs, to 1e-6.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import rldsl
from rldsl.runtime.batch import AgentRow, Episode, RolloutBatch, StepRollout, TokenRow
from rldsl.runtime.config import load_config
from rldsl.runtime.data.datasets import Example
from rldsl.runtime.records.metrics import LOSS
from rldsl.runtime.rewards.functions import RewardFn, RewardResult
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.rollout.replay import AGE, FRACTION, SIZE, ReplayBuffer, episode_rewards, rows_per_episode
from rldsl.runtime.run import step_batch
from rldsl.runtime.train.optim import build_optimizer
from rldsl.runtime.train.trainer import Trainer
from rldsl.runtime.workers.base import Generation

pytest.importorskip("openai")

P, G = 3, 2  # prompts per step, episodes per prompt

# each step's answers (odd: two rows per episode) and rewards (one per episode), by prompt
ANSWERS = [[1, 2, 2], [2, 2, 2], [2, 2, 2], [3, 2, 2]]  # K = 2, 1, 1, 2
REWARDS = [
    [[0, 1], [1, 1], [0, 0]],  # a=g0 (K 2) joins: [a]; slots 1, 2 <- newest [a, a]
    [[1, 0], [0, 0], [1, 1]],  # b=g0 (K 1) joins: [a, b]; slots 1, 2 <- [b, a]: the batch padded to K 2
    [[0, 0], [1, 0], [0, 0]],  # a leaves (age 2), c=g1 (K 1) joins: [b, c]; slots 0, 2 <- [c, b]: K 1
    [[0, 1], [0, 0], [1, 1]],  # b leaves, d=g0 (K 2) joins: [c, d]; slots 1, 2 <- [d, c]: c padded to K 2
]


class Prompts:
    """The steps' prompts in order (no shuffle): the answers of ``answers`` (ANSWERS: step s asks
    prompts 3s .. 3s+2 with ANSWERS[s]), prompt i numbered i."""

    def __init__(self, answers=ANSWERS) -> None:
        flat = [a for step in answers for a in step]
        self.examples = [Example(id=i, prompt=f"{10 + i}+1=", answer=str(a)) for i, a in enumerate(flat)]
        self.at = 0

    def next_batch(self, n: int) -> list[Example]:
        out, self.at = self.examples[self.at:self.at + n], self.at + n
        return out


class AgentRollouts:
    """The agent's episodes through the real endpoint (rollout/agents/runner.py), rewards from the
    table (``rewards``, one list of groups per call): an episode's on each of its rows (and as its
    ``env`` term's)."""

    def __init__(self, model, tokenizer, rewards=REWARDS) -> None:
        from rldsl.runtime.rollout.agents.runner import AgentRunner, load_agent

        self.engine = HFEngine(model, tokenizer)
        self.runner = AgentRunner(load_agent("agent_helpers:odd_answers_break"), model_name="toy", context=128)
        self.rewards = rewards
        self.made = 0

    def generate(self, prompts, answers, params: SamplingParams, reward_prompts=None) -> Generation:
        batch = self.runner.run(self.engine, list(reward_prompts), answers, params)
        K = rows_per_episode(batch)
        rewards = torch.tensor(self.rewards[self.made], dtype=torch.float32).reshape(-1).repeat_interleave(K)
        self.made += 1
        return Generation(batch, RewardResult(rewards, {"env": rewards.double()}, 0), 0.0, 0.0)


def _reference(model, batch, rewards) -> tuple[float, torch.Tensor]:
    """GRPO's clipped token-mean loss from the semantics, over the batch's groups as the run's
    advantage reads them (G episodes x K rows, each row its episode's reward): A = (r - mean) /
    (std + 1e-6); each row run alone over its real tokens, rho = pi_theta / mu on a replayed row's
    model tokens, 1 on a fresh row's; padding rows train nothing. Also the replayed tokens' ratios."""
    r = rewards.double().view(-1, batch.group_size)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    total, count, ratios = 0.0, 0, []
    with torch.no_grad():
        for b in range(len(batch)):
            n = int(batch.attention[b].sum())
            own = batch.response_mask[b, :n].bool()
            if not bool(own.any()):
                continue
            prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()]
            response = batch.response_ids[b, :n]
            logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0].double()
            logp = torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + n], -1).gather(1, response[:, None])[:, 0]
            if batch.replayed is not None and bool(batch.replayed[b]):
                rho = torch.exp(logp[own] - batch.logprobs[b, :n][own].double())
                ratios.append(rho)
            else:
                rho = torch.ones(int(own.sum()), dtype=torch.float64)
            a = float(adv[b])
            total += float((-torch.minimum(rho * a, rho.clamp(0.8, 1.2) * a)).sum())
            count += int(own.sum())
    return total / count, torch.cat(ratios) if ratios else torch.zeros(0, dtype=torch.float64)


def _setup(model, tokenizer, replay: str, answers=ANSWERS, rewards=REWARDS, sampler=None):
    """The run's parts (``sampler``: the model the agent samples with; the trained one by default)."""
    cfg = load_config(None, [f"rollout.prompts_per_step={P}", f"rollout.n={G}", "rollout.max_new_tokens=3",
                             "rollout.temperature=1.0", "train.lr=0.05"])
    spec = f"algorithm grpo_replay extends grpo\n  kl  none\n  aggregation  token_mean\n  sampling  {replay}\n"
    fn = rldsl.compile(rldsl.loads(spec, "replay.rl"), compile=False)
    s = SimpleNamespace(cfg=cfg, fn=fn, prompts=Prompts(answers), tokenizer=tokenizer,
                        rollouts=AgentRollouts(model if sampler is None else sampler, tokenizer, rewards),
                        reward=RewardFn("exact"), warn=print,
                        multi_turn=True, rollout_prompts=lambda ex: [e.prompt for e in ex],
                        replay=ReplayBuffer(fn.data.replay_policy, tokenizer.pad_token_id))
    return s, Trainer(fn, model, optimizer=build_optimizer(model.parameters(), cfg.train))


def _episode(batch, g: int, e: int) -> list[int]:
    """The rows of episode ``e`` of group ``g`` (K each)."""
    K = rows_per_episode(batch)
    start = (g * G + e) * K
    return list(range(start, start + K))


def test_agents_episodes_are_replayed_whole_against_a_hand_computed_buffer(tokenizer, tiny_model_factory):
    model = tiny_model_factory(tokenizer, seed=3)
    s, trainer = _setup(model, tokenizer, "replay(capacity=2, priority=newest, max_age=1)")
    seen = []
    try:
        for step in range(4):
            r = step_batch.rollout_step(s, step)
            _train_exactly(model, trainer, r, step)
            seen.append(r)
    finally:
        s.rollouts.runner.close()
    a, b_, c, d = seen[0].generated, seen[1].generated, seen[2].generated, seen[3].generated
    name = {0: a.reward_prompts[0], 1: b_.reward_prompts[0], 2: c.reward_prompts[1], 3: d.reward_prompts[0]}
    expected = [  # (groups by prompt, replayed, K of the batch, size, fraction, age)
        ([name[0], name[0], name[0]], [0, 1, 1], 2, 1, 2 / 3, 0.0),
        ([name[1], name[1], name[0]], [0, 1, 1], 2, 2, 2 / 3, 0.5),
        ([name[2], name[2], name[1]], [1, 0, 1], 1, 2, 2 / 3, 0.5),
        ([name[3], name[3], name[2]], [0, 1, 1], 2, 2, 2 / 3, 0.5),
    ]
    for step, (r, (groups, flags, K, size, fraction, age)) in enumerate(zip(seen, expected)):
        assert r.reward_prompts == groups, step
        assert rows_per_episode(r.batch) == K and r.batch.group_size == G * K and len(r.batch) == P * G * K, step
        assert r.batch.replayed.view(P, -1)[:, 0].tolist() == [bool(x) for x in flags], step
        assert r.metrics[SIZE] == size and r.metrics[FRACTION] == fraction, step
        assert r.metrics[AGE] == pytest.approx(age, abs=1e-12), step
    # the groups the steps generated keep their own K (what the records read)
    assert [rows_per_episode(r.generated.batch) for r in seen] == [2, 1, 1, 2]
    # a replayed episode is its recorded rows, then padding: (sampled at step, group) -> (step, place)
    _assert_replayed_whole(seen, [((0, 0), (1, 2)), ((1, 0), (1, 1)), ((2, 1), (3, 2)), ((1, 0), (2, 2))])


def _train_exactly(model, trainer, r, step: int) -> None:
    """Trains on the step's batch ``r``: pi_old of its replayed rows is their recorded logprobs, their
    ratios and the loss the reference's (1e-6)."""
    b = r.batch
    want_loss, want_rho = _reference(model, b, r.scored)
    tb = trainer.estimate(b, r.scored)
    if b.replayed is None:
        assert not any(k.startswith("replay/ratio") for k in tb.metrics), step
    else:
        rows = b.replayed
        assert torch.equal(tb.old_logprobs[rows] * b.response_mask[rows], b.logprobs[rows] * b.response_mask[rows])
        assert tb.metrics["replay/ratio_mean"] == pytest.approx(float(want_rho.mean()), rel=1e-6), step
        assert tb.metrics["replay/ratio_min"] == pytest.approx(float(want_rho.min()), rel=1e-6), step
        assert tb.metrics["replay/ratio_max"] == pytest.approx(float(want_rho.max()), rel=1e-6), step
    um = trainer.update(tb)
    assert um[LOSS] == pytest.approx(want_loss, abs=1e-6), step


def _assert_replayed_whole(seen, pairs, replayed: bool = True) -> None:
    """Each pair ((s0, g0), (s1, g1)): group g0 that step s0 generated is at place g1 of step s1's
    batch (replayed there, or, ``replayed`` False, fresh), each of its episodes its recorded rows,
    then padding rows with its reward."""
    for (s0, g0), (s1, g1) in pairs:
        x, y = seen[s0].generated.batch, seen[s1].batch
        kx = rows_per_episode(x)
        for e in range(G):
            rx, ry = _episode(x, g0, e), _episode(y, g1, e)
            for i, j in zip(rx, ry):  # the episode's own rows
                n = int(x.attention[i].sum())
                for field in ("response_ids", "response_mask", "response_attention", "logprobs"):
                    assert torch.equal(getattr(x, field)[i, :n], getattr(y, field)[j, :n]), field
                    assert not getattr(y, field)[j, n:].any(), field
                assert x.episodes[i].messages == y.episodes[j].messages
                assert y.episodes[j].agent.row == x.episodes[i].agent.row
            reward = float(seen[s0].generated.scored[rx[0]])
            for j in ry[kx:]:  # padding added: nothing trained or attended, the episode's reward
                assert not y.response_mask[j].any() and not y.attention[j].any() and y.finish_reason[j] == "length"
                assert y.episodes[j].agent.padding and y.episodes[j].agent.row == ry.index(j)
                assert y.episodes[j].env_reward == x.episodes[rx[0]].env_reward is not None  # the agent's return
                assert y.episodes[j].agent.calls == x.episodes[rx[0]].agent.calls
                assert float(seen[s1].scored[j]) == reward and float(y.reward_terms["env"][j]) == reward
            assert bool(y.replayed[ry].all()) if replayed else not bool(y.replayed[ry].any())


# use=mix (mix=0.67 of P=3: 2 groups a step from the buffer), capacity 2, newest, max_age 2; the
# answers and rewards of the groups each step generates (a synchronous run generates P less the
# share the buffer can give before the step; an asynchronous run's producer P - 2 = 1 always)
MIX = "replay(capacity=2, use=mix, mix=0.67, priority=newest, max_age=2)"
MIX_RUNS = {
    "synchronous": ([[1, 2, 2], [2], [2], [3]],  # K = 2, 1, 1, 2 generated
                    [[[0, 1], [1, 0], [0, 0]], [[1, 0]], [[0, 1]], [[1, 1]]]),
    "async K=1": ([[1], [2], [2], [3]],
                  [[[0, 1]], [[1, 0]], [[1, 0]], [[1, 1]]]),
}
# per step: (prompt ids of the batch's groups, replayed flags, the batch's K, size, fraction, age),
# and ((sampled at step, group) -> (step, place)) for the replayed groups and the fresh ones padded
MIX_EXPECTED = {
    # 0: buffer empty before the step: 3 fresh (K 2); a=0, b=1 join
    # 1: 1 fresh (K 1); c=3 joins, a leaves: [b, c]; newest 2: c, b -> padded to b's K 2
    # 2: 1 fresh (K 1); d=4 joins, b leaves: [c, d]; d, c: K 1 all
    # 3: 1 fresh (K 2); c (age 2) and d stay; d, c: both padded to K 2
    "synchronous": ([([0, 1, 2], None, 2, 2, 0.0, 0.0), ([3, 3, 1], [0, 1, 1], 2, 2, 2 / 3, 0.5),
                     ([4, 4, 3], [0, 1, 1], 1, 2, 2 / 3, 0.5), ([5, 4, 3], [0, 1, 1], 2, 2, 2 / 3, 1.5)],
                    [((0, 1), (1, 2)), ((1, 0), (1, 1)), ((2, 0), (2, 1)), ((1, 0), (2, 2)), ((2, 0), (3, 1)),
                     ((1, 0), (3, 2))],
                    [((1, 0), (1, 0)), ((3, 0), (3, 0))]),
    # step t sampled by version max(0, t - 1); the share drawn at the step, after the step's groups join
    # 0 (v0): a=0 (K 2) joins: [a]; 1 of 2: a
    # 1 (v0): b=1 (K 1) joins: [a, b]; b, a -> padded to a's K 2; ages 1, 1
    # 2 (v1): a and b 2 versions old stay; c=2 joins, a leaves: [b, c]; c, b: K 1; ages 1, 2
    # 3 (v2): b (3 versions old) leaves: [c]; 1 of 2: c, padded to the fresh K 2; age 2
    "async K=1": ([([0, 0], [0, 1], 2, 1, 1 / 2, 0.0), ([1, 1, 0], [0, 1, 1], 2, 2, 2 / 3, 1.0),
                   ([2, 2, 1], [0, 1, 1], 1, 2, 2 / 3, 1.5), ([3, 2], [0, 1], 2, 1, 1 / 2, 2.0)],
                  [((0, 0), (0, 1)), ((1, 0), (1, 1)), ((0, 0), (1, 2)), ((2, 0), (2, 1)), ((1, 0), (2, 2)),
                   ((2, 0), (3, 1))],
                  [((1, 0), (1, 0))]),
}


@pytest.mark.parametrize("run", list(MIX_RUNS))
def test_agents_groups_mixed_in_against_a_hand_computed_buffer(tokenizer, tiny_model_factory, run):
    """``use=mix`` with an agent: the step generates its fresh groups of episodes and the share
    drawn from the buffer follows them, every episode padded to the batch's most rows (a kept group
    of K=2 among fresh K=1 ones pads the fresh ones, a kept K=1 group among K=2 ones is padded).
    Synchronous: the step generates P less the share the buffer holds before it. Asynchronous
    (rollout.max_staleness=1, as test_replay.py's mix test): the producer generates P - 2 groups,
    sampled by the version before, and the trainer's step (step_batch.with_replay) draws the share
    after the staleness rule and the step's groups, as many as the buffer holds. Which groups, the
    batch's K and rows, the replayed episodes' rows, ratios and the losses are the reference's."""
    import copy

    answers, rewards = MIX_RUNS[run]
    expected, replays, padded_fresh = MIX_EXPECTED[run]
    lagged = run != "synchronous"
    model = tiny_model_factory(tokenizer, seed=3)
    sampler = copy.deepcopy(model) if lagged else None
    s, trainer = _setup(model, tokenizer, MIX, answers, rewards, sampler)
    s.cfg.rollout.max_staleness = int(lagged)
    versions = [copy.deepcopy(model.state_dict())]
    seen = []
    try:
        for step in range(4):
            if lagged:
                version = max(0, step - 1)
                sampler.load_state_dict(versions[version])
                made = step_batch.rollout_step(s, step)
                assert made.batch.replayed is None and made.fresh is None  # the producer's: fresh groups only
                r = step_batch.with_replay(s, made, step, version)
            else:
                r = step_batch.rollout_step(s, step)
            _train_exactly(model, trainer, r, step)
            versions.append(copy.deepcopy(model.state_dict()))
            seen.append(r)
    finally:
        s.rollouts.runner.close()
    assert [len(r.generated.prompt_ids) for r in seen] == [len(a) for a in answers]
    assert [rows_per_episode(r.generated.batch) for r in seen] == [2, 1, 1, 2]
    for step, (r, (groups, flags, K, size, fraction, age)) in enumerate(zip(seen, expected)):
        n = len(groups)
        assert r.prompt_ids == groups, step
        assert rows_per_episode(r.batch) == K and r.batch.group_size == G * K and len(r.batch) == n * G * K, step
        assert len(r.scored) == len(r.batch) and r.replay_ages is not None and len(r.replay_ages) == n, step
        if flags is None:
            assert r.batch.replayed is None, step
        else:
            assert r.batch.replayed.view(n, -1)[:, 0].tolist() == [bool(x) for x in flags], step
        assert r.metrics[SIZE] == size and r.metrics[FRACTION] == pytest.approx(fraction, abs=1e-12), step
        assert r.metrics[AGE] == pytest.approx(age, abs=1e-12), step
    _assert_replayed_whole(seen, replays)
    _assert_replayed_whole(seen, padded_fresh, replayed=False)


def test_a_groups_priority_reads_one_reward_per_episode():
    """An agent's group of K rows per episode gets the priority of its episodes' rewards: the same
    group laid out with K = 1 or K = 3 has one priority (a formula over the rows would count each
    episode K times); rewards per role (rows of an episode differ) read the episode's mean."""
    fn = rldsl.compile(rldsl.loads("algorithm r extends grpo\n  sampling  replay(priority=\"std * sum(abs(adv))\")\n",
                                   "r.rl"), compile=False)
    formula = fn.data.replay_policy.priority
    episodes = torch.tensor([0.0, 1.0, 1.0, 0.5])
    three = episodes.repeat_interleave(3)
    assert torch.equal(episode_rewards(three, 3), episodes)
    assert formula(episode_rewards(three, 3)) == formula(episodes) != formula(three)
    # the buffer's entry: a group of two episodes of three rows (rewards 0 and 1)
    rows = [TokenRow([5], [6], [-0.5], "stop", "p", "c", mask=[1],
                     episode=Episode([], float(e), agent=AgentRow(k, 3, False))) for e in (0, 1) for k in range(3)]
    made = StepRollout(0, RolloutBatch.from_rows(rows, 6, 0), [0], ["p"], torch.tensor([0.0] * 3 + [1.0] * 3))
    buffer = ReplayBuffer(fn.data.replay_policy, 0)
    buffer.step(made, 0, torch.tensor([True]), 1, torch.Generator().manual_seed(0))
    assert [e.priority for e in buffer.entries] == [formula(torch.tensor([0.0, 1.0]))]
    roles = torch.tensor([0.2, 0.8, 0.5, 1.0, 0.0, 0.5])  # two roles and a padding row (their mean) per episode
    assert torch.allclose(episode_rewards(roles, 3), torch.tensor([0.5, 0.5]))
    assert torch.isnan(episode_rewards(torch.tensor([float("nan")] * 2 + [1.0] * 2), 2)[0])


def test_advantage_keep_replays_each_episodes_rows_advantages(tokenizer, tiny_model_factory):
    """``advantage=keep`` with an agent: a replayed group's rows train with the advantages its
    episodes' rows had at its first training (a fresh place; for c, replayed in its own step, its
    fresh place's), bit for bit on their trained tokens, even where its K differs from the batch's."""
    model = tiny_model_factory(tokenizer, seed=3)
    s, trainer = _setup(model, tokenizer, "replay(capacity=2, priority=newest, max_age=1, advantage=keep)")
    seen = []
    try:
        for step in range(4):
            r = step_batch.rollout_step(s, step)
            tb = trainer.estimate(r.batch, r.scored)
            s.replay.trained(tb.advantages, r.batch.replayed)
            trainer.update(tb)
            seen.append((r, tb.advantages.detach().clone()))
    finally:
        s.rollouts.runner.close()
    # (first training: step, place) -> its replays (step, place); the table of the first test
    first = {(0, 0): [(0, 1), (0, 2), (1, 2)], (1, 0): [(1, 1), (2, 2)], (2, 1): [(2, 0), (3, 2)], (3, 0): [(3, 1)]}
    for (s0, g0), replays in first.items():
        x, ax = seen[s0][0].batch, seen[s0][1]
        k = rows_per_episode(seen[s0][0].generated.batch)  # the group's own rows per episode
        for s1, g1 in replays:
            y, ay = seen[s1][0].batch, seen[s1][1]
            assert bool(y.replayed[_episode(y, g1, 0)[0]])
            for e in range(G):
                for i, j in zip(_episode(x, g0, e)[:k], _episode(y, g1, e)[:k]):
                    m = x.response_mask[i].bool()
                    assert bool(m.any()) and torch.equal(ay[j][:m.shape[0]][m], ax[i][m]), (s0, g0, s1, g1)
