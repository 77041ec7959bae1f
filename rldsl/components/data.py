"""Declaration and data-level slots: ``rewards`` (what the verifier returns) and ``sampling``.

These have no tensor function; the checker uses ``rewards`` to validate other slots, and
the runtime carries out ``sampling`` through ``CompiledAlgorithm.data``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..ops import scorable_stats
from ..registry import Int, declare

if TYPE_CHECKING:
    from torch import Tensor

declare("rewards", "scalar", """Rewards are real numbers.

formula: r_i in R
source: -
""")

declare("rewards", "binary", """Rewards are 0 or 1 (a verifier's pass/fail).

formula: r_i in {0, 1}
source: needed by success_rate (MaxRL) whose p-normalisation assumes a success probability
""")

declare("rewards", "dense", """Rewards per turn or per step, each on the response token that ends its turn or step.

formula: r_it = dense_it + [t = last token of i] (r_i - sum_t' dense_it') - beta kl_it   (the token rewards every baseline that reads them gets)
source: environment step rewards of a multi-turn episode (the `env` reward term: each step's
  reward on the last model token of its turn) and a process reward model's step scores
  (rm:PATH(step_separator=...): on the token where the step ends); verl's token_level_rewards [B, T] as
  compute_gae_advantage_return and compute_reinforce_plus_plus_outcome_advantage read them
edge cases: r_i is the sequence reward (the sum of its turns' rewards and the other terms,
  after shaping): what the dense rewards do not account for (other reward terms, shaping) lands
  on the last token, so sum_t r_it = r_i as with outcome rewards; baselines that read only the
  sequence reward (group_mean, ...) see that sum. Rows whose reward failed get none.
""", needs=("dense_rewards",))

declare("sampling", "once", """Draw each group once.

formula: P prompts x G samples per step
source: -
""")

declare("sampling", "dynamic", """Resample until the batch has P groups with mixed outcomes.

formula: keep drawing prompts while #{g : informative(g)} < P and rounds < {max_rounds};
  informative(g) = max r_g != min r_g over the group's scorable rewards (a failed reward,
  NaN, is not there: [1, 1, 1, NaN] is constant; fewer than 2 scorable: not informative)
source: DAPO dynamic sampling (Yu et al. 2025); verl algorithm.filter_groups (max_num_gen_batches)
edge cases: informative() takes the raw rewards, NaN included (never NaN replaced by 0).
""", plan={"dynamic_rounds": "max_rounds"}, max_rounds=Int(3, "cap on generation rounds per step", ge=1))


def informative(rewards: Tensor) -> Tensor:
    """[P, G] rewards (NaN = failed) -> [P] bool: the group's scorable rewards are not all equal.

    The rule of ``sampling dynamic`` (formula above); also what ``zero_variance_groups`` counts
    the complement of.
    """
    hi, lo, _, count = scorable_stats(rewards)
    return (count >= 2) & (hi != lo)
