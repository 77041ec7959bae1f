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


# ---------------------------------------------------------------- failed rewards (NaN) and the data plan

NAN = float("nan")


def test_informative_leaves_failed_rewards_out():
    fn = spec_fn("sampling dynamic(max_rounds=4)")
    r = torch.tensor([[1.0, 1.0, 1.0, NAN],    # constant among the scorable: no signal
                      [1.0, 0.0, 1.0, NAN],    # mixed
                      [NAN, NAN, NAN, NAN],    # nothing scorable
                      [0.0, NAN, NAN, NAN],    # one scorable sample: no baseline, no signal
                      [0.0, 0.0, 0.0, 0.0]])
    assert fn.data.informative(r).tolist() == [False, True, False, False, False]


def test_zero_variance_groups_metric_leaves_failed_rewards_out():
    fn = spec_fn("baseline group_mean\nnormalizer group_std")
    r = torch.tensor([1.0, 1.0, 1.0, NAN, 1.0, 0.0, 1.0, NAN, NAN, NAN, NAN, NAN])
    est = fn.estimate(r, 4, torch.ones(12, 2))
    # [1,1,1,NaN] has zero variance (its advantages are all 0), [1,0,1,NaN] does not,
    # [NaN x 4] has no signal either
    assert est.metrics["zero_variance_groups"] == pytest.approx(2 / 3)
    assert torch.count_nonzero(est.advantages[:4]) == 0 and torch.count_nonzero(est.advantages[4:7, 0]) == 3


@pytest.mark.parametrize(("rewards", "retire"), [
    ([1.0] * 9 + [0.0], True),              # 0.9 >= 0.9: ScaleRL retires it
    ([1.0] * 8 + [0.0] * 2, False),         # 0.8
    ([1.0] * 10, True),
    ([1.0] * 9 + [NAN], True),              # 9 / 9 scorable: a failure is not a 0
    ([1.0] * 8 + [0.0, NAN], False),        # 8 / 9 = 0.889
    ([NAN] * 10, False),                    # no pass rate
])
def test_pass_rate_cap_retires_at_or_above_the_cap(rewards, retire):
    fn = spec_fn("filter pass_rate_cap(max=0.9)")
    r = torch.tensor([rewards])
    assert fn.data.retire(r).tolist() == [retire]
    finite = [x for x in rewards if x == x]
    want = sum(finite) / len(finite) if finite else None
    got = fn.data.pass_rates(r).item()
    assert (got != got) if want is None else got == pytest.approx(want)


def test_no_cap_retires_nothing():
    assert spec_fn("baseline group_mean").data.retire(torch.ones(3, 4)).tolist() == [False] * 3
