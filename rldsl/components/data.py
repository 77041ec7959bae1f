"""Declaration and data-level slots: ``rewards`` (what the verifier returns) and ``sampling``.

These have no tensor function; the checker uses ``rewards`` to validate other slots, and
the runtime carries out ``sampling`` through ``CompiledAlgorithm.data``.
"""
from __future__ import annotations

from ..registry import Int, declare

declare("rewards", "scalar", """Rewards are real numbers.

formula: r_i in R
source: -
""")

declare("rewards", "binary", """Rewards are 0 or 1 (a verifier's pass/fail).

formula: r_i in {0, 1}
source: needed by success_rate (MaxRL) whose p-normalisation assumes a success probability
""")

declare("sampling", "once", """Draw each group once.

formula: P prompts x G samples per step
source: -
""")

declare("sampling", "dynamic", """Resample until the batch has P groups with mixed outcomes.

formula: keep drawing prompts while #{g : max r_g != min r_g} < P and rounds < {max_rounds}
source: DAPO dynamic sampling (Yu et al. 2025); verl algorithm.filter_groups (max_num_gen_batches)
""", plan={"dynamic_rounds": "max_rounds"}, max_rounds=Int(3, "cap on generation rounds per step", ge=1))
