"""Declaration and data-level slots: ``rewards`` (what the verifier returns) and ``sampling``.

These have no tensor function; the checker uses ``rewards`` to validate other slots, and
the runtime carries out ``sampling`` through ``CompiledAlgorithm.data``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..ops import scorable_stats
from ..registry import Choice, Float, Formula, Int, declare

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

declare("sampling", "replay", """Keep informative groups in a buffer and train on them again in later steps.

formula: after each step's groups are drawn, those that pass `enter` join the buffer (at most
  {capacity} groups; full, a group with a formula priority replaces the lowest one if its own is higher,
  else the oldest leaves); entries older than max_age policy versions leave; then
  use=substitute: the step's non-informative groups (at most per_step) are replaced by entries
  chosen by `priority`; use=mix: round({mix} P) groups of the step come from the buffer and
  only P - that many are generated (asynchronous rollouts: always P - round({mix} P), the share
  drawn at the trainer's step from what the buffer holds). A replayed group's pi_old is the behaviour policy's recorded
  logprobs (the engine's at its version): rho = pi_theta / mu; its advantage is recomputed from its
  recorded rewards with the step's batch (advantage=recompute), or kept (advantage=keep): the one
  its rows had the first time they were trained on.
  priority: uniform (each entry equally likely), newest (the newest entries, no draw), or a
  formula of the language "..." over one group's rows (docs/formulas.md, "A formula as an
  argument": r [B], adv = r - mean [B], mean, std, n []; sum mean std max min (x) reduce the group;
  one number per group): entries drawn with probability priority / sum, without replacement
  unless more are needed than held.
source: TRL GRPOWithReplayBufferTrainer (substitutes zero-variance groups from a buffer ranked by
  sum |A| x std); ARPO's replay of successful trajectories (Lu et al. 2025); PER (Schaul et al. 2016)
edge cases: enter=nonzero_std: informative() (scorable rewards not all equal); enter=success: some
  scorable reward > 0. A priority that is not finite or <= 0 counts as 0 (never drawn while
  others are > 0). An empty buffer replays nothing.
""", plan={"replay_policy": "capacity"},
        capacity=Int(64, "groups the buffer holds", ge=1),
        enter=Choice(("nonzero_std", "success"), "nonzero_std", "which groups enter the buffer"),
        priority=Formula(("uniform", "newest"), "uniform", "how entries are chosen"),
        use=Choice(("substitute", "mix"), "substitute", "when replayed groups are used"),
        mix=Float(0.25, "fraction of each step's groups taken from the buffer", gt=0, lt=1, when=("use", "mix")),
        per_step=Int(None, "at most this many replayed groups per step", ge=1),
        max_age=Int(None, "entries older than this many policy versions leave", ge=0),
        advantage=Choice(("recompute", "keep"), "recompute", "a replayed group's advantage: recomputed, or kept"))


declare("sampling", "tree", """Sample a tree per prompt: answers forked at their least likely tokens (TreeRL's EPTree).

formula: M answers per prompt; then L times, in each of a prompt's trees (an answer and its forks)
  the N tokens with the highest -log pi (the engine's logprob of the sampled token, an entropy
  proxy) among all its generations are fork points, and T continuations are sampled from each
  prefix (prompt + the tokens before it). Each generation ends in a leaf; the leaves are the
  prompt's rows (G = M (1 + L N T)), each holding its whole path, so shared prefixes appear in
  several rows (the authors train on every path in full). node_value, parent_value, root_value,
  node_leaves, parent_leaves describe the tree to advantage formulas.
source: TreeRL (Hou et al. 2025, arXiv 2506.11902), github.com/THUDM/TreeRL
  openrlhf/trainer/ppo_utils/entropy_chain_local_manager.py (entropy_guided_chain) and tree_node.py
edge cases: a generation's token can be chosen again in a later iteration (the authors do not
  exclude it): it is forked again. Fewer than N tokens in a tree: its fork points repeat (the
  authors' padding). The rollout engine must be rollout.engine=hf and the run synchronous.
""", plan={"tree_shape": "M"},
        M=Int(4, "answers sampled from each prompt (trees)", ge=1),
        N=Int(2, "fork points per tree per iteration", ge=1),
        L=Int(1, "forking iterations", ge=1),
        T=Int(2, "continuations sampled from each fork point", ge=1))


def informative(rewards: Tensor) -> Tensor:
    """[P, G] rewards (NaN = failed) -> [P] bool: the group's scorable rewards are not all equal.

    The rule of ``sampling dynamic`` (formula above); also what ``zero_variance_groups`` counts
    the complement of.
    """
    hi, lo, _, count = scorable_stats(rewards)
    return (count >= 2) & (hi != lo)
