"""shaping slot: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl DAPORewardManager)."""
from __future__ import annotations

import pytest
import torch

from component_refs import adv_batch, lists
from rldsl.components import shaping as sh


def dapo_eq13(L: int, L_max: int, L_cache: int) -> float:
    if L <= L_max - L_cache:
        return 0.0
    if L <= L_max:
        return ((L_max - L_cache) - L) / L_cache
    return -1.0


def verl_dapo(L: int, max_resp_len: int, buffer: int, factor: float) -> float:
    """verl: expected = max_resp_len - buffer; r += min(-(L - expected) / buffer * factor, 0)."""
    return min(-(L - (max_resp_len - buffer)) / buffer * factor, 0.0)


LENGTHS = [1, 16000, 16384, 16385, 18432, 20480, 20481]


def shaped(lengths, factor=1.0, rewards=None):
    T = max(lengths)
    mask = (torch.arange(T).expand(len(lengths), T) < torch.tensor(lengths).unsqueeze(-1)).float()
    r = torch.zeros(len(lengths)) if rewards is None else torch.tensor(rewards)
    batch = adv_batch(r, 1, mask=mask)
    return lists(sh.overlong_penalty(r, batch, max_len=20480, cache=4096, factor=factor))


def test_overlong_penalty_dapo_eq13_numbers():
    # L_max 20480, L_cache 4096: free up to 16384, linear to -1 at 20480, -1 beyond
    want = [0.0, 0.0, 0.0, -1 / 4096, -0.5, -1.0, -1.0]
    assert shaped(LENGTHS) == pytest.approx(want)
    assert shaped(LENGTHS) == pytest.approx([dapo_eq13(L, 20480, 4096) for L in LENGTHS])


def test_overlong_penalty_factor_and_verl_reward_manager():
    got = shaped(LENGTHS[:-1], factor=0.5, rewards=[1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    want = [r + verl_dapo(L, 20480, 4096, 0.5) for r, L in zip([1.0, 1.0, 0.0, 1.0, 0.0, 1.0], LENGTHS[:-1])]
    assert got == pytest.approx(want)
    assert got[4] == pytest.approx(-0.25)


def test_dapo_library_shapes_before_the_group_advantage(eager_algorithm):
    fn = eager_algorithm("dapo")
    lengths = [100, 18432, 100, 20480]
    mask = (torch.arange(20480).expand(4, 20480) < torch.tensor(lengths).unsqueeze(-1)).float()
    est = fn.estimate(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2, mask)
    assert lists(est.rewards) == pytest.approx([1.0, 0.5, 0.0, 0.0])
    # group 0: [1, .5] -> +-0.25 / (std .35355 + 1e-6); group 1: [0, 0] -> 0
    a = lists(est.advantages[:, 0])
    assert a[:2] == pytest.approx([0.25 / (0.3535534 + 1e-6), -0.25 / (0.3535534 + 1e-6)], rel=1e-5)
    assert a[2:] == [0.0, 0.0]
