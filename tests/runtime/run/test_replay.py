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


@pytest.mark.slow
def test_a_run_stopped_after_a_checkpoint_and_resumed_equals_its_uninterrupted_twin(model_dir, tmp_path):
    """The buffer is saved with the checkpoint (its groups, their versions and priorities, the
    arrival counter) and restored: the resumed steps draw and train what the uninterrupted run does."""
    from safetensors.torch import load_file

    from rldsl.runtime.records import checkpoint as ckpt
    from rldsl.runtime.run import loop
    from small_run import small_run, steps_of, without_timing

    spec = tmp_path / "replay.rl"
    spec.write_text(REPLAY_SPEC, encoding="utf-8")
    full = loop.train(str(spec), small_run(model_dir, tmp_path / "full", **{"train.steps": 6, "checkpoint.every": 2}))
    cut = loop.train(str(spec), small_run(model_dir, tmp_path / "cut", **{"train.steps": 6, "checkpoint.every": 2}),
                     stop_after=3)
    assert ckpt.latest_checkpoint(cut).name == "step-3"
    saved = ckpt.load_checkpoint(ckpt.latest_checkpoint(cut)).extra["replay"]
    assert saved["entries"] and saved["seq"] >= len(saved["entries"])
    loop.train(str(spec), resume=cut)
    records = steps_of(full)
    assert any(r[FRACTION] > 0 for r in records[3:]), "the steps after the cut replay groups"
    assert without_timing(steps_of(cut)) == without_timing(records)
    a = load_file(str(ckpt.latest_checkpoint(full) / "policy" / "model.safetensors"))
    b = load_file(str(ckpt.latest_checkpoint(cut) / "policy" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_replay_is_refused_where_it_is_not_tested_yet():
    from rldsl.runtime.errors import RunError
    from rldsl.runtime.resolve import check_replay

    algo = rldsl.loads(REPLAY_SPEC, "replay.rl")
    check_replay(algo, load_config(None, []))
    with pytest.raises(RunError, match="rollout.max_staleness > 0"):
        check_replay(algo, load_config(None, ["rollout.max_staleness=1"]))
    check_replay(rldsl.load("grpo"), load_config(None, ["rollout.max_staleness=1"]))


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
    tb = trainer.estimate(r.batch, r.scored)
    assert tb.old_logprobs is None and not any(k.startswith("replay/") for k in tb.metrics)


def test_the_checks_see_a_built_in_tasks_own_tools(tmp_path):
    """The plan settles what the config leaves to its source before any check: the calculator
    task's tools (its episodes) are the run's tools for check_replay too, so sampling replay on it
    is refused before any model loads (it passed the check, the tools being filled in later)."""
    from rldsl.runtime.errors import RunError
    from rldsl.runtime.run.plan import plan_run

    algo = rldsl.loads(REPLAY_SPEC, "replay.rl")
    with pytest.raises(RunError, match="rollout.tools / rollout.env / rollout.agent"):
        plan_run(algo, load_config(None, ["data.task=calculator", f"out={tmp_path}"]))
