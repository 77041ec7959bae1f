"""``sampling replay`` parameters that the hand-computed buffers of test_replay.py leave at their
defaults or out: ``enter=success`` (ARPO's rule: a group with some reward > 0 enters, all-equal
ones included), ``priority=uniform`` (each entry equally likely; a full buffer drops its oldest)
and ``per_step`` (at most that many replayed groups a step), over three scripted steps whose
buffer is computed by hand from docs/replay.md ("One step, in order")."""
from __future__ import annotations

import torch

from rldsl.runtime.rollout.replay import FRACTION, SIZE
from rldsl.runtime.run import step_batch

from test_replay import G, _run

STEPS = [
    # b = g1 (all right: not informative, yet a success) and c = g2 join; places 0, 1, 3 are
    # non-informative, per_step=1 replaces place 0 only, by b or c
    [[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]],
    # d = g0 joins a full buffer: the oldest, b, leaves -> [c, d]; place 1 replaced
    [[1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
    # nothing joins (no reward > 0); place 0 replaced from [c, d]
    [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
]


def test_enter_success_uniform_and_per_step_against_a_hand_computed_buffer(tokenizer, tiny_model_factory):
    model = tiny_model_factory(tokenizer, seed=5)
    s, _ = _run(model, tokenizer, "replay(capacity=2, enter=success, priority=uniform, per_step=1)", STEPS)
    held, replaced_at = [], [0, 1, 0]
    for step in range(3):
        r = step_batch.rollout_step(s, step)
        names = s.rollouts.prompts[step]
        if step == 0:
            b, c = names[1], names[2]
            held = [b, c]
        elif step == 1:
            held = [c, names[0]]
        assert [e.reward_prompt for e in s.replay.entries] == held, step
        torch.testing.assert_close(s.replay.probabilities(), torch.full((2,), 0.5, dtype=torch.float64))
        flags = r.batch.replayed.view(-1, G)[:, 0].tolist()
        assert [g for g, x in enumerate(flags) if x] == [replaced_at[step]], step
        place = replaced_at[step]
        assert r.reward_prompts[place] in held, step  # drawn from what the buffer holds now
        assert [r.reward_prompts[g] for g in range(4) if g != place] == [names[g] for g in range(4) if g != place]
        assert r.metrics[SIZE] == 2 and r.metrics[FRACTION] == 1 / 4, step
