"""``sampling replay``: the buffer over 4 steps against a reference written from the semantics
(docs/replay.md), and against TRL's GRPOWithReplayBufferTrainer's substitution rule.

The rewards are scripted (real samples of a tiny model, rewards from a table), so which groups
enter, leave and are chosen is hand-computed below; the ratios and the loss of each step are
recomputed here from an unpadded forward of the policy and the replayed groups' recorded
behaviour logprobs, to 1e-6.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import rldsl
from rldsl.runtime.batch import group_rows
from rldsl.runtime.config import load_config
from rldsl.runtime.data.datasets import Example, PromptSource, rollout_prompts
from rldsl.runtime.records.metrics import LOSS
from rldsl.runtime.rewards.functions import RewardFn, RewardResult
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.rollout.replay import AGE, FRACTION, SIZE, ReplayBuffer
from rldsl.runtime.run import step_batch
from rldsl.runtime.train.optim import build_optimizer
from rldsl.runtime.train.trainer import Trainer
from rldsl.runtime.workers.base import Generation

G = 4


def _spec(replay: str) -> str:
    return f'''algorithm grpo_replay extends grpo
  kl            none
  aggregation   token_mean
  sampling      {replay}
'''


class ScriptedRollouts:
    """Real samples from a tiny model, rewards from a table (one step per call); the prompts of
    each call kept, to name the groups."""

    def __init__(self, model, tokenizer, steps):
        self.engine, self.steps, self.prompts = HFEngine(model, tokenizer), list(steps), []

    def generate(self, prompts, answers, params: SamplingParams, reward_prompts=None) -> Generation:
        batch = self.engine.generate(prompts, params)
        rewards = torch.tensor(self.steps[len(self.prompts)], dtype=torch.float32).reshape(-1)
        self.prompts.append(list(reward_prompts))
        return Generation(batch, RewardResult(rewards, {}, int(rewards.isnan().sum())), 0.0, 0.0)


def _run(model, tokenizer, replay: str, steps):
    cfg = load_config(None, ["rollout.prompts_per_step=4", f"rollout.n={G}", "rollout.max_new_tokens=5",
                             "rollout.temperature=1.0", "train.lr=0.05"])
    fn = rldsl.compile(rldsl.loads(_spec(replay), "replay.rl"), compile=False)
    policy = fn.data.replay_policy
    examples = [Example(id=i, prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(10, 40)]
    s = SimpleNamespace(cfg=cfg, fn=fn, prompts=PromptSource(examples, seed=0), tokenizer=tokenizer,
                        rollouts=ScriptedRollouts(model, tokenizer, steps), reward=RewardFn("exact"),
                        warn=print, multi_turn=False, rollout_prompts=lambda ex: rollout_prompts(ex, False),
                        replay=None if policy is None else ReplayBuffer(policy, tokenizer.pad_token_id))
    trainer = Trainer(fn, model, optimizer=build_optimizer(model.parameters(), cfg.train))
    return s, trainer


def _reference_loss(model, batch, rewards, unpadded_logits) -> tuple[float, torch.Tensor]:
    """GRPO's clipped token-mean loss written from the semantics: A = (r - mean_g) / (std_g + 1e-6),
    rho = pi_theta / mu on a replayed row (mu its recorded logprobs), 1 on a fresh row; and the
    replayed tokens' ratios."""
    with torch.no_grad():
        logits = unpadded_logits(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    r = rewards.double().view(-1, G)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    total, count, ratios = 0.0, 0, []
    for b, lg in enumerate(logits):
        n = lg.shape[0]
        tokens = batch.response_ids[b][batch.response_mask[b].bool()]
        logp = torch.log_softmax(lg.double(), -1).gather(1, tokens[:, None])[:, 0]
        if batch.replayed is not None and bool(batch.replayed[b]):
            rho = torch.exp(logp - batch.logprobs[b, :n].double())
            ratios.append(rho)
        else:
            rho = torch.ones(n, dtype=torch.float64)
        a = float(adv[b])
        total += float((-torch.minimum(rho * a, rho.clamp(0.8, 1.2) * a)).sum())
        count += n
    return total / count, torch.cat(ratios) if ratios else torch.zeros(0)


# which groups join (name: its prompt at that step), which leave, which are replayed where
STEPS = [
    [[0, 1, 0, 0], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]],  # a=g0, c=g2 join; [a, c]; slots 1, 3
    [[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]],  # e=g1 joins, a (oldest) leaves: [c, e]
    [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 0]],  # c older than max_age=1 leaves; f=g3: [e, f]
    [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],  # e leaves (age 2): [f]
]


def test_four_steps_against_a_hand_computed_buffer(tokenizer, tiny_model_factory, unpadded_logits):
    model = tiny_model_factory(tokenizer, seed=3)
    s, trainer = _run(model, tokenizer, "replay(capacity=2, priority=newest, max_age=1)", STEPS)
    seen = []
    for step in range(4):
        r = step_batch.rollout_step(s, step)
        names = s.rollouts.prompts[step]
        seen.append((r, names))
        want_loss, want_rho = _reference_loss(model, r.batch, r.scored, unpadded_logits)
        tb = trainer.estimate(r.batch, r.scored)
        # pi_old: recorded behaviour logprobs on replayed rows (bit for bit), this policy's elsewhere
        rows = r.batch.replayed
        assert rows is not None
        assert torch.equal(tb.old_logprobs[rows] * r.batch.response_mask[rows],
                           r.batch.logprobs[rows] * r.batch.response_mask[rows])
        if want_rho.numel():
            # float32 ratios against float64 ones: 1e-6 relative
            assert tb.metrics["replay/ratio_mean"] == pytest.approx(float(want_rho.mean()), rel=1e-6), step
            assert tb.metrics["replay/ratio_max"] == pytest.approx(float(want_rho.max()), rel=1e-6), step
            assert tb.metrics["replay/ratio_min"] == pytest.approx(float(want_rho.min()), rel=1e-6), step
        um = trainer.update(tb)
        assert um[LOSS] == pytest.approx(want_loss, abs=1e-6), step
    p = [n for _, n in seen]
    a, c, e, f = p[0][0], p[0][2], p[1][1], p[2][3]
    expected = [  # (the batch's groups by prompt, replayed flags, size, fraction, age)
        ([a, c, c, a], [0, 1, 0, 1], 2, 2 / 4, 0.0),
        ([e, e, c, e], [1, 0, 1, 1], 2, 3 / 4, 1 / 3),
        ([f, e, f, f], [1, 1, 1, 0], 2, 3 / 4, 1 / 3),
        ([f, f, f, f], [1, 1, 1, 1], 1, 4 / 4, 1.0),
    ]
    for step, ((r, _), (groups, flags, size, fraction, age)) in enumerate(zip(seen, expected)):
        assert r.reward_prompts == groups, step
        assert r.batch.replayed.view(-1, G)[:, 0].tolist() == [bool(x) for x in flags], step
        assert r.metrics[SIZE] == size and r.metrics[FRACTION] == fraction, step
        assert r.metrics[AGE] == pytest.approx(age, abs=1e-12), step
    # a replayed group is its recorded rows and rewards, unchanged
    first = seen[0][0]
    assert torch.equal(first.scored.view(-1, G)[1], first.scored.view(-1, G)[2])
    assert torch.equal(first.batch.response_ids.view(G, G, -1)[1], first.batch.response_ids.view(G, G, -1)[2])


class TRLBuffer:
    """TRL GRPOWithReplayBufferTrainer's rule on 2-D groups (what its code intends), written here
    from its semantics: the groups with std > 0 enter with score sum_j |A_j| * std,
    A = (r - mean) / (std + 1e-4); a full buffer (a min-heap) takes a group only if its score
    beats the lowest one, which it replaces; the zero-std groups are replaced by draws with
    probability score / sum of scores (with replacement when more are needed than held)."""

    def __init__(self, size):
        self.size, self.items = size, []  # (score, tag)

    def step(self, rewards, tag):
        std = rewards.std(1)
        adv = (rewards - rewards.mean(1, keepdim=True)) / (std[:, None] + 1e-4)
        score = (adv.abs() * std[:, None]).sum(1)
        for g in range(rewards.shape[0]):
            if std[g] > 0:
                if len(self.items) < self.size:
                    self.items.append((float(score[g]), tag(g)))
                else:
                    low = min(range(len(self.items)), key=lambda i: self.items[i][0])
                    if score[g] > self.items[low][0]:
                        self.items[low] = (float(score[g]), tag(g))
        return [g for g in range(rewards.shape[0]) if not std[g] > 0]


def test_the_substitution_rule_is_trls(tokenizer, tiny_model_factory):
    steps = [
        [[0, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1]],
        [[0, 0.5, 1, 0], [0, 0, 0, 0], [1, 0.25, 1, 1], [0, 0, 0, 0]],
        [[2, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0.5, 0, 1, 0]],
        [[0, 0, 0, 0], [0, 1, 0, 1], [3, 3, 3, 3], [0, 0.1, 0, 0]],
    ]
    model = tiny_model_factory(tokenizer, seed=4)
    s, _ = _run(model, tokenizer, 'replay(capacity=3, priority="std * sum(abs(adv) / (std + 0.0001))")', steps)
    trl = TRLBuffer(3)
    for step, table in enumerate(steps):
        r = step_batch.rollout_step(s, step)
        names = s.rollouts.prompts[step]
        replaced = trl.step(torch.tensor(table, dtype=torch.float64), lambda g: (names[g], step))
        # the same groups held, with the same scores, and the same chance of each at a draw
        theirs = dict((tag, score) for score, tag in trl.items)
        ours = {(e.reward_prompt, e.version): e.priority for e in s.replay.entries}
        assert ours.keys() == theirs.keys(), step
        for k in ours:
            assert ours[k] == pytest.approx(theirs[k], abs=1e-6), (step, k)
        total = sum(theirs.values())
        chance = dict(zip([(e.reward_prompt, e.version) for e in s.replay.entries], s.replay.probabilities().tolist()))
        for k in ours:
            assert chance[k] == pytest.approx(theirs[k] / total, abs=1e-6), (step, k)
        # TRL's zero-std groups are the ones replaced, in place; the others stay as drawn
        flags = r.batch.replayed.view(-1, G)[:, 0].tolist() if r.batch.replayed is not None else [False] * 4
        assert [g for g, x in enumerate(flags) if x] == replaced, step
        assert [r.reward_prompts[g] for g in range(4) if g not in replaced] == \
            [names[g] for g in range(4) if g not in replaced]
        # each replayed group is one the buffer holds
        for g in replaced:
            assert r.reward_prompts[g] in {k[0] for k in ours}


REPLAY_SPEC = '''algorithm grpo_mix_replay extends grpo
  "GRPO with half of each step's groups replayed by priority."
  sampling      replay(capacity=4, use=mix, mix=0.5, priority="std * sum(abs(adv))", max_age=3)
'''


KEEP_SPEC = REPLAY_SPEC.replace("max_age=3)", "max_age=3, advantage=keep)\n  normalizer    batch_std")


@pytest.mark.slow
@pytest.mark.parametrize("text", [REPLAY_SPEC, KEEP_SPEC], ids=["recompute", "keep"])
def test_a_run_stopped_after_a_checkpoint_and_resumed_equals_its_uninterrupted_twin(model_dir, tmp_path, text):
    """The buffer is saved with the checkpoint (its groups, their versions and priorities, the
    arrival counter, with advantage=keep their kept advantages) and restored: the resumed steps
    draw and train what the uninterrupted run does."""
    from safetensors.torch import load_file

    from rldsl.runtime.records import checkpoint as ckpt
    from rldsl.runtime.run import loop
    from small_run import small_run, steps_of, without_timing

    spec = tmp_path / "replay.rl"
    spec.write_text(text, encoding="utf-8")
    full = loop.train(str(spec), small_run(model_dir, tmp_path / "full", **{"train.steps": 6, "checkpoint.every": 2}))
    cut = loop.train(str(spec), small_run(model_dir, tmp_path / "cut", **{"train.steps": 6, "checkpoint.every": 2}),
                     stop_after=3)
    assert ckpt.latest_checkpoint(cut).name == "step-3"
    saved = ckpt.load_checkpoint(ckpt.latest_checkpoint(cut)).extra["replay"]
    assert saved["entries"] and saved["seq"] >= len(saved["entries"])
    if text == KEEP_SPEC:
        assert all(e["advantages"] is not None for e in saved["entries"])
    loop.train(str(spec), resume=cut)
    records = steps_of(full)
    assert any(r[FRACTION] > 0 for r in records[3:]), "the steps after the cut replay groups"
    assert without_timing(steps_of(cut)) == without_timing(records)
    a = load_file(str(ckpt.latest_checkpoint(full) / "policy" / "model.safetensors"))
    b = load_file(str(ckpt.latest_checkpoint(cut) / "policy" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_replay_passes_the_settings_checks_with_every_tested_rollout():
    """Every combination docs/replay.md tests runs (resolve.check_settings refuses none), agents
    with use=mix included (tests/runtime/run/test_replay_agents.py; refused until it was tested)."""
    from rldsl.runtime.resolve import check_settings

    algo = rldsl.loads(REPLAY_SPEC, "replay.rl")
    substitute = rldsl.loads(REPLAY_SPEC.replace("use=mix, mix=0.5, ", ""), "replay.rl")
    agent = ["rollout.agent=agent_helpers:odd_answers_break"]
    ray = ["distributed.trainers=2", "distributed.rollout_workers=1"]
    for spec in (algo, substitute, rldsl.loads(KEEP_SPEC, "replay.rl")):
        for sets in ([], ["rollout.max_staleness=1"], ["rollout.env=episode_helpers:Nudge"], agent,
                     [*agent, "rollout.max_staleness=1"], ray):
            check_settings(spec, load_config(None, sets))


def test_without_replay_the_step_is_unchanged(tokenizer, tiny_model_factory, monkeypatch):
    """sampling once: no buffer, no replay/* metric, no `replayed` rows, and the trainer never
    enters the replayed rows' path (its pi_old is what it was)."""
    model = tiny_model_factory(tokenizer, seed=5)
    s, trainer = _run(model, tokenizer, "once", [[[0, 1, 0, 0], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]]])
    assert s.fn.data.replay_policy is None
    s.replay = None  # what build() gives a spec without replay
    monkeypatch.setattr(Trainer, "_replayed_old", lambda *a: pytest.fail("replay path taken without replay"))
    r = step_batch.rollout_step(s, 0)
    assert r.batch.replayed is None and not any(k.startswith("replay/") for k in r.metrics)
    assert r.batch.kept_advantages is None and r.fresh is None and r.replay_ages is None and r.generated is r
    tb = trainer.estimate(r.batch, r.scored)
    assert tb.old_logprobs is None and not any(k.startswith("replay/") for k in tb.metrics)


def _keep_run(tokenizer, tiny_model_factory, advantage: str):
    """The 4 hand-computed steps (STEPS) under ``normalizer batch_std`` (a group's advantage
    depends on the batch it is trained in), as train_step runs them: estimate, the buffer told
    the advantages, update. Returns each step's rollout, TrainBatch and the groups' names."""
    model = tiny_model_factory(tokenizer, seed=3)
    spec = _spec(f"replay(capacity=2, priority=newest, max_age=1, advantage={advantage})") + "  normalizer batch_std\n"
    cfg = load_config(None, ["rollout.prompts_per_step=4", f"rollout.n={G}", "rollout.max_new_tokens=5",
                             "rollout.temperature=1.0", "train.lr=0.05"])
    fn = rldsl.compile(rldsl.loads(spec, "replay.rl"), compile=False)
    examples = [Example(id=i, prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(10, 40)]
    s = SimpleNamespace(cfg=cfg, fn=fn, prompts=PromptSource(examples, seed=0), tokenizer=tokenizer,
                        rollouts=ScriptedRollouts(model, tokenizer, STEPS), reward=RewardFn("exact"),
                        warn=print, multi_turn=False, rollout_prompts=lambda ex: rollout_prompts(ex, False),
                        replay=ReplayBuffer(fn.data.replay_policy, tokenizer.pad_token_id))
    trainer = Trainer(fn, model, optimizer=build_optimizer(model.parameters(), cfg.train))
    out = []
    for step in range(4):
        r = step_batch.rollout_step(s, step)
        tb = trainer.estimate(r.batch, r.scored)
        s.replay.trained(tb.advantages, r.batch.replayed)
        trainer.update(tb)
        out.append((r, tb, s.rollouts.prompts[step]))
    return out


def _batch_std(rewards: torch.Tensor) -> torch.Tensor:
    """[B] batch_std's advantage written from its formula: (r - the group's mean) / (the batch's
    unbiased std + 1e-6)."""
    r = rewards.double().view(-1, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std() + 1e-6)).view(-1)


def test_advantage_keep_replays_the_advantage_of_the_first_training(tokenizer, tiny_model_factory):
    """replay(advantage=keep): a replayed group's rows train with the advantage they had the first
    time they were trained on (bit for bit), not the one the new batch's std gives; the other
    rows' are the estimator's for this batch (batch_std, from its formula, 1e-6). With
    advantage=recompute (the default) a replayed group gets this batch's."""
    first: dict[str, torch.Tensor] = {}  # group (its prompt) -> advantages [G] of its first training
    differs = 0
    for advantage in ("keep", "recompute"):
        for step, (r, tb, _) in enumerate(_keep_run(tokenizer, tiny_model_factory, advantage)):
            flags = r.batch.replayed.view(-1, G)[:, 0].tolist()
            mask = r.batch.response_mask > 0
            ref = _batch_std(r.scored)
            for g in sorted(range(4), key=lambda g: flags[g]):  # a fresh place first
                rows = range(g * G, (g + 1) * G)
                got = torch.stack([tb.advantages[b][mask[b]].double().unique() for b in rows])  # [G, 1]
                name = r.reward_prompts[g]
                if advantage == "keep" and flags[g] and name in first:
                    assert torch.equal(got[:, 0], first[name]), (step, name)
                    differs += int(not torch.allclose(got[:, 0], ref[rows.start:rows.stop], atol=1e-6))
                else:
                    assert torch.allclose(got[:, 0], ref[rows.start:rows.stop], atol=1e-6), (advantage, step, name)
                if advantage == "keep":
                    first.setdefault(name, got[:, 0])
            if advantage == "keep" and step == 0:
                assert r.batch.kept_advantages is None  # nothing is kept before a first training
    assert differs > 0, "under batch_std a kept advantage is not the recomputed one"


class LaggedRollouts(ScriptedRollouts):
    """ScriptedRollouts whose engine samples with an older copy of the policy: what an asynchronous
    run's producer hands the trainer (rollout.max_staleness = 1: step t's batch is version t - 1's)."""

    def __init__(self, model, tokenizer, steps):
        import copy

        self.sampler = copy.deepcopy(model)
        super().__init__(self.sampler, tokenizer, steps)

    def load(self, state):
        self.sampler.load_state_dict(state)


def test_asynchronous_rollouts_age_entries_in_the_trainers_versions(tokenizer, tiny_model_factory, unpadded_logits):
    """rollout.max_staleness = 1: step t trains on a batch sampled by version max(0, t - 1). The
    buffer is stepped where the step is assembled (step_batch.with_replay, as run/step.py does with
    the producer's batch and its version): an entry's version is the one that sampled it, its age
    this step's version minus that -- as async/staleness counts --, so max_age drops entries a
    synchronous run would keep. The ratio of a replayed row is against its recorded behaviour
    logprobs (the older sampler's), the loss the reference's (1e-6). Hand-computed from STEPS with
    capacity 2, newest, max_age 1:
      step 0 (sampled by v0): a, c enter; [a, c, c, a], ages 0
      step 1 (v0): e enters, a leaves; 3 places from [c, e]: e, c, e; ages 1 (sync: 1/3)
      step 2 (v1): c and e are 2 versions old and leave (sync keeps e); f enters; f, f, f, age 1
      step 3 (v2): f is 2 versions old and leaves: nothing to replay."""
    import copy

    model = tiny_model_factory(tokenizer, seed=3)
    s, trainer = _run(model, tokenizer, "replay(capacity=2, priority=newest, max_age=1)", STEPS)
    s.rollouts = LaggedRollouts(model, tokenizer, STEPS)
    s.cfg.rollout.max_staleness = 1  # rollout_step leaves the buffer to the trainer's side
    versions = [copy.deepcopy(model.state_dict())]  # the weights after v updates
    seen, ratios = [], []
    for step in range(4):
        version = max(0, step - 1)
        s.rollouts.load(versions[version])
        made = step_batch.rollout_step(s, step)
        assert made.batch.replayed is None and SIZE not in made.metrics  # the producer's side: fresh only
        r = step_batch.with_replay(s, made, step, version)
        want_loss, want_rho = _reference_loss(model, r.batch, r.scored, unpadded_logits)
        tb = trainer.estimate(r.batch, r.scored)
        if r.batch.replayed is not None:
            rows = r.batch.replayed
            assert torch.equal(tb.old_logprobs[rows] * r.batch.response_mask[rows],
                               r.batch.logprobs[rows] * r.batch.response_mask[rows])
            assert tb.metrics["replay/ratio_mean"] == pytest.approx(float(want_rho.mean()), rel=1e-6), step
        um = trainer.update(tb)
        assert um.get(LOSS, 0.0) == pytest.approx(want_loss, abs=1e-6), step  # step 3: every A = 0, no update
        ratios.append(tb.metrics.get("replay/ratio_mean"))
        versions.append(copy.deepcopy(model.state_dict()))
        seen.append((r, s.rollouts.prompts[step]))
    p = [n for _, n in seen]
    a, c, e, f = p[0][0], p[0][2], p[1][1], p[2][3]
    expected = [  # (groups, replayed flags, size, fraction, age)
        ([a, c, c, a], [0, 1, 0, 1], 2, 2 / 4, 0.0),
        ([e, e, c, e], [1, 0, 1, 1], 2, 3 / 4, 1.0),
        ([f, f, f, f], [1, 1, 1, 0], 1, 3 / 4, 1.0),
        (p[3], None, 0, 0.0, 0.0),
    ]
    for step, ((r, _), (groups, flags, size, fraction, age)) in enumerate(zip(seen, expected)):
        assert r.reward_prompts == groups, step
        if flags is None:
            assert r.batch.replayed is None, step
        else:
            assert r.batch.replayed.view(-1, G)[:, 0].tolist() == [bool(x) for x in flags], step
        assert (r.metrics[SIZE], r.metrics[FRACTION]) == (size, fraction), step
        assert r.metrics[AGE] == pytest.approx(age, abs=1e-12), step
    # step 0 replays what v0 sampled to v0 (ratio 1); later steps replay older samples (ratio != 1)
    assert ratios[0] == pytest.approx(1.0, abs=1e-5) and abs(ratios[1] - 1) > 1e-4 and ratios[3] is None


# use=mix, mix=0.5 of P = 4 with rollout.max_staleness = 1: the producer makes 2 fresh groups a step
MIX_STEPS = [
    [[0, 1, 0, 0], [0, 0, 1, 1]],  # a, b join: [a, b]; the 2 newest replayed (b, a)
    [[1, 1, 1, 1], [1, 0, 0, 0]],  # c joins, a (oldest) leaves: [b, c]; c, b replayed (ages 1)
    [[0, 0, 0, 0], [0, 1, 1, 0]],  # b, c (v0) 2 versions old leave; d joins: [d], the only one replayed
    [[0, 0, 0, 0], [0, 0, 0, 0]],  # d (v1) 2 versions old leaves: nothing to replay
]


def test_asynchronous_mix_draws_the_share_at_the_step(tokenizer, tiny_model_factory, unpadded_logits):
    """use=mix with rollout.max_staleness = 1: the producer, which makes batches ahead and never
    reads the buffer, generates P - round(mix P) = 2 groups a step (a synchronous run's step 0 would
    generate 4: its buffer is empty before the step); the trainer's step (step_batch.with_replay)
    drops the entries older than max_age versions against the version it trains, lets the step's
    groups join, then takes the mix share -- 2 groups, or all the buffer holds when it holds fewer.
    Hand-computed from MIX_STEPS with capacity 2, newest, max_age 1 (step t sampled by v max(0, t - 1)):
      step 0 (v0): a, b join; [a, b, b, a], ages 0, fraction 2/4
      step 1 (v0): c joins, a leaves; [x, c, c, b], ages 1, fraction 2/4
      step 2 (v1): b, c are 2 versions old and leave, d joins; [y, d, d]: one left, fraction 1/3
      step 3 (v2): d leaves; the 2 fresh groups alone
    The ratios of the replayed rows are against their recorded behaviour logprobs, the losses the
    reference's (1e-6)."""
    import copy

    model = tiny_model_factory(tokenizer, seed=3)
    s, trainer = _run(model, tokenizer, "replay(capacity=2, use=mix, mix=0.5, priority=newest, max_age=1)",
                      MIX_STEPS)
    s.rollouts = LaggedRollouts(model, tokenizer, MIX_STEPS)
    s.cfg.rollout.max_staleness = 1
    versions = [copy.deepcopy(model.state_dict())]
    seen = []
    for step in range(4):
        version = max(0, step - 1)
        s.rollouts.load(versions[version])
        made = step_batch.rollout_step(s, step)
        assert len(made.prompt_ids) == 2 and made.batch.replayed is None  # the producer: P - mix P fresh
        r = step_batch.with_replay(s, made, step, version)
        want_loss, want_rho = _reference_loss(model, r.batch, r.scored, unpadded_logits)
        tb = trainer.estimate(r.batch, r.scored)
        if r.batch.replayed is not None:
            rows = r.batch.replayed
            assert torch.equal(tb.old_logprobs[rows] * r.batch.response_mask[rows],
                               r.batch.logprobs[rows] * r.batch.response_mask[rows])
            assert tb.metrics["replay/ratio_mean"] == pytest.approx(float(want_rho.mean()), rel=1e-6), step
        um = trainer.update(tb)
        assert um.get(LOSS, 0.0) == pytest.approx(want_loss, abs=1e-6), step
        versions.append(copy.deepcopy(model.state_dict()))
        seen.append((r, s.rollouts.prompts[step]))
    p = [n for _, n in seen]
    a, b, c, d = p[0][0], p[0][1], p[1][1], p[2][1]
    expected = [  # (groups, replayed flags, size, fraction, age)
        ([a, b, b, a], [0, 0, 1, 1], 2, 2 / 4, 0.0),
        ([p[1][0], c, c, b], [0, 0, 1, 1], 2, 2 / 4, 1.0),
        ([p[2][0], d, d], [0, 0, 1], 1, 1 / 3, 1.0),
        (p[3], None, 0, 0.0, 0.0),
    ]
    for step, ((r, _), (groups, flags, size, fraction, age)) in enumerate(zip(seen, expected)):
        assert r.reward_prompts == groups, step
        if flags is None:
            assert r.batch.replayed is None, step
        else:
            assert r.batch.replayed.view(-1, G)[:, 0].tolist() == [bool(x) for x in flags], step
        assert (r.metrics[SIZE], r.metrics[FRACTION]) == (size, fraction), step
        assert r.metrics[AGE] == pytest.approx(age, abs=1e-12), step


@pytest.mark.slow
@pytest.mark.parametrize("use", ["substitute", "mix"])
def test_an_asynchronous_run_with_replay_resumes_as_its_uninterrupted_twin(model_dir, tmp_path, use):
    """rollout.max_staleness = 1 with replay: the producer makes fresh batches only, the trainer's
    step passes them through the buffer with the version that sampled them; the buffer and the
    batches generated ahead are saved with the checkpoint, so the resumed steps equal the whole run's."""
    from rldsl.runtime.records import checkpoint as ckpt
    from rldsl.runtime.run import loop
    from small_run import small_run, steps_of, without_timing

    spec = tmp_path / "replay.rl"
    spec.write_text(REPLAY_SPEC if use == "mix" else REPLAY_SPEC.replace("use=mix, mix=0.5, ", ""), encoding="utf-8")
    over = {"train.steps": 6, "checkpoint.every": 2, "rollout.max_staleness": 1}
    full = loop.train(str(spec), small_run(model_dir, tmp_path / "full", **over))
    cut = loop.train(str(spec), small_run(model_dir, tmp_path / "cut", **over), stop_after=3)
    assert ckpt.latest_checkpoint(cut).name == "step-3"
    loop.train(str(spec), resume=cut)
    records = steps_of(full)
    assert [r["async/staleness_max"] for r in records] == [0.0] + [1.0] * 5
    assert any(r[FRACTION] > 0 for r in records[3:]), "the steps after the cut replay groups"
    assert all(r[AGE] >= 1.0 for r in records[1:] if r[FRACTION] > 0)  # sampled a version or more ago
    assert without_timing(steps_of(cut)) == without_timing(records)


class EpisodeRollouts(ScriptedRollouts):
    """Multi-turn episodes of a tiny model (rollout/episodes/runner.py ``run_episodes``) against
    the Nudge environment (tests/runtime/episode_helpers.py: a user message after each turn, 3
    turns): one row per episode, the environment's tokens attended but masked out of the loss;
    rewards from the table. Each turn is the model's max_new_tokens sampled tokens, ended there as
    if it had stopped (a random tiny model rarely samples its EOS), so every episode has 3 turns."""

    def generate_ids(self, prompt_ids, params, prompts=None):
        import dataclasses

        out = self.engine.generate_ids(prompt_ids, params, prompts)
        return dataclasses.replace(out, finish_reason=["stop"] * len(out))

    def generate(self, prompts, answers, params: SamplingParams, reward_prompts=None) -> Generation:
        from episode_helpers import Nudge

        from rldsl.runtime.rollout.episodes.runner import run_episodes

        rows = [{"prompt": p, "answer": a} for p, a in zip(reward_prompts, answers)]
        self.tokenizer = self.engine.tokenizer
        batch = run_episodes(self, self.engine.tokenizer, rows, [Nudge() for _ in range(len(rows) * params.n)],
                             params, max_turns=3)
        rewards = torch.tensor(self.steps[len(self.prompts)], dtype=torch.float32).reshape(-1)
        self.prompts.append(list(reward_prompts))
        return Generation(batch, RewardResult(rewards, {}, 0), 0.0, 0.0)


def _episode_reference(model, batch, rewards) -> tuple[float, torch.Tensor]:
    """_reference_loss for episodes: each row run alone over every real token (model and
    environment: ``attention``), the loss and the ratios over the model's tokens only
    (``response_mask``)."""
    r = rewards.double().view(-1, G)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    total, count, ratios = 0.0, 0, []
    with torch.no_grad():
        for b in range(len(batch)):
            prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()]
            n = int(batch.attention[b].sum())
            response = batch.response_ids[b, :n]
            logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0].double()
            logp = torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + n], -1).gather(1, response[:, None])[:, 0]
            own = batch.response_mask[b, :n].bool()
            if bool(batch.replayed[b]):
                rho = torch.exp(logp[own] - batch.logprobs[b, :n][own].double())
                ratios.append(rho)
            else:
                rho = torch.ones(int(own.sum()), dtype=torch.float64)
            a = float(adv[b])
            total += float((-torch.minimum(rho * a, rho.clamp(0.8, 1.2) * a)).sum())
            count += int(own.sum())
    return total / count, torch.cat(ratios) if ratios else torch.zeros(0)


def test_a_replayed_episode_keeps_its_per_token_mask(tiny_model_factory):
    """Multi-turn episodes (the environment's tokens masked): the buffer over the 4 hand-computed
    steps keeps and replays the same groups as single-turn completions; a replayed episode is its
    recorded rows -- token ids, loss mask (environment tokens 0), attention, logprobs, messages --
    and its ratio is pi_theta / mu over the model's tokens only; the loss is the reference's (1e-6)."""
    from rldsl.runtime.toy.tool_model import build_tool_tokenizer

    tok = build_tool_tokenizer()
    model = tiny_model_factory(tok, seed=3)
    s, trainer = _run(model, tok, "replay(capacity=2, priority=newest, max_age=1)", STEPS)
    s.rollouts = EpisodeRollouts(model, tok, STEPS)
    seen = []
    for step in range(4):
        r = step_batch.rollout_step(s, step)
        b = r.batch
        assert b.response_attention is not None and len(b.episodes) == len(b)
        env_tokens = (b.response_attention > 0) & (b.response_mask == 0)
        assert bool(env_tokens.any()), "the environment's tokens are in the rows, masked"
        want_loss, want_rho = _episode_reference(model, b, r.scored)
        tb = trainer.estimate(b, r.scored)
        rows = b.replayed
        assert torch.equal(tb.old_logprobs[rows] * b.response_mask[rows], b.logprobs[rows] * b.response_mask[rows])
        assert tb.metrics["replay/ratio_mean"] == pytest.approx(float(want_rho.mean()), rel=1e-6), step
        assert tb.metrics["replay/ratio_min"] == pytest.approx(float(want_rho.min()), rel=1e-6), step
        um = trainer.update(tb)
        assert um.get(LOSS, 0.0) == pytest.approx(want_loss, abs=1e-6), step
        seen.append((r, s.rollouts.prompts[step]))
    p = [n for _, n in seen]
    a, c, e, f = p[0][0], p[0][2], p[1][1], p[2][3]
    expected = [[a, c, c, a], [e, e, c, e], [f, e, f, f], [f, f, f, f]]  # as test_four_steps_...
    assert [r.reward_prompts for r, _ in seen] == expected
    # a replayed episode is its recorded rows: group c sampled at step 0 (place 2), replayed at
    # step 0 (place 1) and step 1 (place 2); group f sampled at step 2 (place 3), replayed at step 3
    for (s0, g0), (s1, g1) in [((0, 2), (0, 1)), ((0, 2), (1, 2)), ((2, 3), (3, 0))]:
        x, y = seen[s0][0].batch, seen[s1][0].batch
        rx, ry = group_rows([g0], G), group_rows([g1], G)
        n = int(x.attention[rx].sum(1).max())
        for field in ("response_ids", "response_mask", "response_attention", "logprobs"):
            assert torch.equal(getattr(x, field)[rx, :n], getattr(y, field)[ry, :n]), field
            assert not getattr(y, field)[ry, n:].any(), field  # only padding after
        assert [x.episodes[i].messages for i in rx.tolist()] == [y.episodes[i].messages for i in ry.tolist()]
        assert not bool(x.replayed[rx].any()) and bool(y.replayed[ry].all())


def _real_routing(batch, b: int) -> torch.Tensor:
    """Row b's recorded experts over its real tokens (prompt padding dropped): [n, Y, K]."""
    from rldsl.runtime.batch import model_inputs

    _, attn, _ = model_inputs(batch)
    return batch.routed_experts[b][attn[b].bool()]


def test_a_replayed_group_keeps_its_routed_experts(moe_model):
    """A mixture-of-experts policy (rollout.routing_replay): a replayed group's rows carry the
    experts the engine routed them to when they were sampled, re-laid to the new batch's columns,
    and the trainer's forward replays those: after an update moved the routers, the replayed
    rows' ratio is the one of each row run alone under its recorded experts (moe_helpers
    ``forced_logprobs``, 1e-6)."""
    from moe_helpers import forced_logprobs
    from transformers import AutoModelForCausalLM

    from rldsl.runtime.models.loading import load_tokenizer

    folder = moe_model("qwen3_moe")
    tok = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    s, _ = _run(model, tok, "replay(capacity=2, priority=newest, max_age=1)", STEPS)
    trainer = Trainer(s.fn, model, optimizer=build_optimizer(model.parameters(), s.cfg.train), routing_replay=True)
    r0 = step_batch.rollout_step(s, 0)
    trainer.update(trainer.estimate(r0.batch, r0.scored))  # the routers move
    r1 = step_batch.rollout_step(s, 1)
    tb1 = trainer.estimate(r1.batch, r1.scored)
    assert r0.batch.routed_experts is not None and r1.batch.routed_experts is not None
    # group c: sampled at step 0 (place 2), replayed at step 1 (place 2) -- its recorded experts
    assert r1.reward_prompts[2] == r0.reward_prompts[2] and bool(r1.batch.replayed[2 * G])
    for i in range(2 * G, 3 * G):
        assert torch.equal(_real_routing(r0.batch, i), _real_routing(r1.batch, i)), i
    # the replayed rows' ratio (places 0, 2, 3) under their recorded experts, at step 1's weights
    valid = (r1.batch.response_mask > 0) & r1.batch.replayed[:, None]
    forced = forced_logprobs(model, r1.batch)
    rho = torch.exp(forced.double() - r1.batch.logprobs.double())[valid]
    assert tb1.metrics["replay/ratio_mean"] == pytest.approx(float(rho.mean()), rel=1e-6)
    assert tb1.metrics["replay/ratio_max"] == pytest.approx(float(rho.max()), rel=1e-6)
    assert tb1.metrics["moe/routing_mismatch"] == 0.0  # every forward routed as recorded


class ImageRollouts(ScriptedRollouts):
    """ScriptedRollouts whose rows each name an image of their own (as a vision-language policy's
    rows do: ``RolloutBatch.images``)."""

    def generate(self, prompts, answers, params: SamplingParams, reward_prompts=None) -> Generation:
        import dataclasses

        gen = super().generate(prompts, answers, params, reward_prompts)
        k = len(self.prompts) - 1
        images = [[f"data/step{k}-row{i}.png"] for i in range(len(gen.batch))]
        # the model kind's processed inputs, made once on the rollout side (a tag per row here)
        processed = [{"pixel_values": torch.tensor([100.0 * k + i])} for i in range(len(gen.batch))]
        return dataclasses.replace(gen, batch=dataclasses.replace(gen.batch, images=images, image_inputs=processed))


def test_a_replayed_group_keeps_its_images(tokenizer, tiny_model_factory):
    """The images of a replayed group's rows travel with them, and so do their kind's processed
    inputs (what the trainer's forwards read: models/kinds/); the fresh rows keep theirs, in place."""
    model = tiny_model_factory(tokenizer, seed=3)
    s, _ = _run(model, tokenizer, "replay(capacity=2, priority=newest, max_age=1)", STEPS)
    s.rollouts = ImageRollouts(model, tokenizer, STEPS)
    batches = [step_batch.rollout_step(s, step).batch for step in range(2)]
    # each place's group as (the step, the place) it was sampled at: step 0 is [a, c, c, a] (a = 0's
    # place 0, c = its place 2), step 1 is [e, e, c, e] (e = 1's place 1) -- test_four_steps_...
    sampled = [[(0, 0), (0, 2), (0, 2), (0, 0)], [(1, 1), (1, 1), (0, 2), (1, 1)]]
    for step, b in enumerate(batches):
        for g, (k, place) in enumerate(sampled[step]):
            assert [b.images[g * G + j] for j in range(G)] == \
                [[f"data/step{k}-row{place * G + j}.png"] for j in range(G)], (step, g)
            assert [float(b.image_inputs[g * G + j]["pixel_values"]) for j in range(G)] == \
                [100.0 * k + place * G + j for j in range(G)], (step, g)


class Observed(PromptSource):
    """A PromptSource that keeps what each step's observe() was given (the curriculum's input)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    def observe(self, prompt_ids, rewards):
        self.seen.append((list(prompt_ids), rewards.clone()))
        return {}


def test_the_records_count_replayed_groups_apart(tokenizer, tiny_model_factory, tmp_path):
    """The 4 hand-computed steps through run/step.train_step: reward_mean and accuracy are the
    step's generated groups' (the table's row of the step, replaced groups included), not the
    trained batch's; the curriculum observes those same groups; samples.jsonl marks each replayed
    row ``"replayed": true, "age": k`` (k its age in versions) and the others ``"replayed": false``."""
    import json

    from rldsl.runtime.records.metrics import ACCURACY, REWARD
    from rldsl.runtime.run import step as run_step
    from rldsl.runtime.workers.local_trainers import LocalTrainers

    model = tiny_model_factory(tokenizer, seed=3)
    s, trainer = _run(model, tokenizer, "replay(capacity=2, priority=newest, max_age=1)", STEPS)
    s.cfg.log.samples_per_step = 4
    s.prompts = Observed(s.prompts.examples, seed=0)
    s.rollouts.load_weights = lambda weights, version: None  # the engine samples with the trained model itself
    s.trainers, s.run_dir = LocalTrainers(trainer), tmp_path
    metrics = [run_step.train_step(s, step) for step in range(4)]
    for step, (m, table) in enumerate(zip(metrics, STEPS)):
        fresh = torch.tensor(table, dtype=torch.float32)
        assert m[REWARD] == pytest.approx(float(fresh.mean()), abs=1e-7), step
        assert m[ACCURACY] == pytest.approx(float((fresh > 0.5).float().mean()), abs=1e-7), step
        ids, rewards = s.prompts.seen[step]
        assert [f"{i}+{i}=" for i in ids] == s.rollouts.prompts[step]  # the prompts drawn this step
        assert torch.equal(rewards.float(), fresh), step
    assert metrics[0][REWARD] == 7 / 16  # the trained batch [a, c, c, a] would say 6 / 16
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    ages = [  # each place's age, None = fresh (test_four_steps_against_a_hand_computed_buffer's batches)
        [None, 0, None, 0],  # [a, c, c, a]: a and c entered this step
        [0, None, 1, 0],     # [e, e, c, e]: e entered this step, c at step 0
        [0, 1, 0, None],     # [f, e, f, f]
        [1, 1, 1, 1],        # [f, f, f, f]
    ]
    for step, want in enumerate(ages):
        got = [(r["replayed"], r.get("age")) for r in rows if r["step"] == step + 1]
        assert got == [(a is not None, a) for a in want for _ in range(G)], step
