"""filter slot (rows masked from the loss) and the data-level plan (dynamic sampling, pass-rate cap)."""
from __future__ import annotations

import pytest
import torch

from component_refs import adv_batch, lists, spec_fn


def test_overlong_filter_masks_truncated_rows():
    fn = spec_fn("baseline group_mean\nfilter overlong")
    mask = torch.ones(4, 3)
    trunc = torch.tensor([False, True, False, False])
    est = fn.estimate(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, mask, truncated=trunc)
    assert lists(est.mask.sum(-1)) == [3.0, 0.0, 3.0, 3.0]
    # TRL mask_truncated_completions: the advantage is still computed from every reward
    assert lists(est.advantages[:, 0]) == [0.5, -0.5, -0.5, 0.5]
    assert est.metrics["filtered_rows"] == 1.0
    with pytest.raises(ValueError, match="truncated"):
        fn.estimate(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, mask)


def test_zero_variance_filter_uses_raw_rewards():
    # a constant-outcome group stays filtered although the length penalty makes its shaped
    # rewards differ
    fn = spec_fn("baseline group_mean\nshaping overlong_penalty(max_len=8, cache=4)\nfilter zero_variance")
    lengths = [2, 8, 2, 3, 1, 1]
    mask = (torch.arange(8).expand(6, 8) < torch.tensor(lengths).unsqueeze(-1)).float()
    est = fn.estimate(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.1, 0.1]), 2, mask)
    assert lists(est.mask.sum(-1)) == [0.0, 0.0, 2.0, 3.0, 0.0, 0.0]
    assert lists(est.rewards) == pytest.approx([1.0, 0.0, 1.0, 0.0, 0.1, 0.1])  # L=8 -> -1
    assert est.metrics["zero_variance_groups"] == pytest.approx(2 / 3)


def test_pass_rate_cap_keeps_rows_and_sets_the_plan():
    from rldsl.components import filter as fl
    batch = adv_batch([1.0, 1.0, 1.0, 0.0], 4)
    assert lists(fl.pass_rate_cap(batch, max=0.5)) == [1.0] * 4
    fn = spec_fn("filter zero_variance, pass_rate_cap(max=0.9)")
    assert fn.data.pass_rate_cap == 0.9


def test_dynamic_sampling_plan_of_dapo(eager_algorithm):
    fn = eager_algorithm("dapo")
    assert fn.data.dynamic_rounds == 10
    r = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.3, 0.3]])
    assert fn.data.informative(r).tolist() == [False, True, False, False]
    assert eager_algorithm("grpo").data.dynamic_rounds == 1
