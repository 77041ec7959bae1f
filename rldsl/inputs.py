"""The optional inputs of ``estimate()`` / ``loss()`` / ``denominator()``: one record each.

Every value a component may read beyond what every call passes (rewards, mask, logprobs,
old logprobs and advantages of the loss) is an :class:`Input` here: its keyword, the stages
it reaches, its shape and dtype, what it means, where it comes from and which slots receive
it. Components declare the ones they read (``register(..., needs=...)``); everything else
reads this table:

- the code generator builds the generated functions' signatures from it (``arg``, ``always``)
  and the ``AdvantageBatch`` fields an advantage-stage component finds filled (``batch``);
- ``CompiledAlgorithm`` checks and forwards what a call gives (shape, default);
- the formula language lets a formula in a slot read an input where ``slots`` lists that
  slot, under the name ``formula``;
- the runtime makes each input with one producer (``runtime/train/inputs.py``), keyed by
  ``name``.

No other module tests an input's name: it asks a record (``source``, ``whole_groups``, ...).
docs/components.md says how to add one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

#: the stages of the generated code an input reaches: the eager ``advantages()`` behind
#: ``estimate()``, and the compiled ``loss()`` (with ``denominator()``)
STAGES = ("advantage", "loss")

#: where the runtime gets an input (what its producer runs)
SOURCES = {
    "policy": "a no-grad forward of the policy (old logprobs and statistics of the old policy)",
    "update": "the update's own forward of the policy (with gradient)",
    "reference": "a forward of the reference model (or of the policy with its adapter off)",
    "critic": "a forward of the value model, or the values saved at rollout time",
    "engine": "the inference engine's own numbers for the sampled tokens",
    "rollout": "the rollout batch: generation and reward results",
    "estimate": "what estimate() returned for the batch (value targets)",
    "algorithm": "the compiled algorithm's own state at this optimizer step",
    "run": "the run's configuration",
    "teacher": "a no-grad forward of the teacher model (run config `teacher`) over the rollout",
    "history": "the run's per-prompt statistics of the rewards of every step so far (kept across steps, "
               "saved in checkpoints)",
    "tree": "the rollout's trees (sampling tree): each prompt's leaves, where they fork, and their rewards",
    "reference_rollout": "the reference model's own answers to the step's prompts (run config `reward.reference`: "
                         "the policy as the run started, or a model folder), scored by the run's reward",
    "answer": "a no-grad forward of the policy that sampled the step over each row's prompt, its own reasoning up "
              "to the answer tag (reward.answer_tags) and the data's reference answer (data.answer_key) in "
              "place of its answer",
    "replay": "a prompt group as the replay buffer receives it: its recorded rewards (sampling replay's "
              "priority formula reads them, one group at a time: B is the group's samples)",
}


@dataclass(frozen=True)
class Input:
    """One optional input.

    name     the keyword of estimate()/loss()/denominator() and the runtime producer's key
    stages   the stages whose call takes it as a keyword (see STAGES)
    shape    e.g. ``[B, T]``: B rows, T response tokens, K reward functions; ``[]`` a number
    dtype    ``float32``, ``bool`` or ``int``
    meaning  one sentence for docs and messages
    source   where the runtime gets it (a key of SOURCES)
    arg      its name in the generated ``advantages()``/``loss()`` and in slot signatures
    always   stages whose generated function always takes it (None when absent); in the
             others it is an argument only when an active component reads it
    batch    advantage stage: the ``AdvantageBatch`` attribute it fills when a component of a
             slot that receives the batch reads it ("" for none, or a field always filled);
             a name that is not a field of its own goes to ``batch.inputs`` (read the same way)
    formula  the name a formula reads it by (None: formulas cannot read it)
    slots    the slots whose formulas may read it (the slots that receive it)
    default  what an absent value means ("ones": all 1, shaped like the rest); "" none: a
             component that reads it fails without it
    whole_groups  its readers compare a prompt's samples: micro-batches keep whole groups
    finite   every value must be finite (a call with inf or NaN fails)
    teacher  made from a teacher model's outputs: a spec that reads it needs a teacher (``teacher.path``
             or ``teacher.url``)
    fails_row  a non-finite value marks its row failed, as a non-finite reward does: estimate() takes
             the row out of the loss and reads its group's mean finite value in its place
    """

    name: str
    stages: tuple[str, ...]
    shape: str
    dtype: str
    meaning: str
    source: str
    arg: str = ""
    always: tuple[str, ...] = ()
    batch: str = ""
    formula: str | None = None
    slots: tuple[str, ...] = ()
    default: str = ""
    whole_groups: bool = False
    finite: bool = False
    teacher: bool = False
    fails_row: bool = False

    def __post_init__(self) -> None:
        if not self.arg:
            object.__setattr__(self, "arg", self.name)
        bad = [s for s in self.stages + self.always if s not in STAGES]
        if bad or self.source not in SOURCES or self.default not in ("", "ones"):
            raise ValueError(f"input {self.name}: stages/always from {STAGES}, source from "
                             f"{', '.join(SOURCES)}, default '' or 'ones'")
        if not re.fullmatch(r"\[(?:[A-Z](?:, [A-Z])*)?\]", self.shape):
            raise ValueError(f"input {self.name}: shape {self.shape!r} is not like [B, T] or []")

    @property
    def dims(self) -> tuple[str, ...]:
        """The shape's dimension letters: ``[B, T]`` -> ("B", "T")."""
        return tuple(d for d in self.shape[1:-1].split(", ") if d)

    @property
    def rank(self) -> int:
        return len(self.dims)

    def describe(self) -> str:
        """``[B, T] float32: <meaning>`` (docs/components.md, messages)."""
        return f"{self.shape} {self.dtype}: {self.meaning}"


_LOSS_SLOTS = ("ratio", "trust_region", "objective", "selection")
#: the loss slots whose formulas run inside loss() on the policy's per-token values (the
#: aggregation's also runs in denominator(), which has only the mask)
_POLICY_SLOTS = ("ratio", "trust_region", "objective", "kl", "selection", "entropy")

#: the advantage-stage slots whose formulas may read the sampled tokens' log-probabilities
_ADVANTAGE_SLOTS = ("shaping", "baseline", "normalizer", "filter")
# The order of this table is the order of the extra arguments of the generated functions.
INPUTS: dict[str, Input] = {i.name: i for i in [
    Input("group_size", ("loss",), "[]", "int", "G, samples per prompt (rows g*G .. g*G+G-1 answer prompt g)",
          "run", always=("advantage", "loss"), whole_groups=True),
    Input("values", ("advantage", "loss"), "[B, T]", "float32",
          "critic values (estimate: rollout-time values for GAE; loss: the current critic's)",
          "critic", always=("advantage", "loss"), formula="V", slots=("baseline",)),
    Input("returns", ("loss",), "[B, T]", "float32", "value targets (estimate()'s returns)",
          "estimate", always=("loss",)),
    Input("old_values", ("loss",), "[B, T]", "float32", "values at rollout time (the critic's clip reference)",
          "critic", always=("loss",)),
    Input("truncated", ("advantage",), "[B]", "bool", "the sample hit max_new_tokens without ending",
          "rollout", always=("advantage",)),
    Input("old_logprobs", ("advantage",), "[B, T]", "float32",
          "rollout-time policy logprobs of the sampled tokens (always given to loss())",
          "policy", arg="old_logp", always=("advantage", "loss"), batch="old_logprobs"),
    Input("ref_logprobs", ("advantage", "loss"), "[B, T]", "float32", "reference-policy logprobs",
          "reference", arg="ref_logp", always=("advantage", "loss"), formula="ref_logp", slots=("kl",)),
    Input("entropy", ("loss",), "[B, T]", "float32", "per-token entropy of the policy",
          "update", arg="ent", always=("loss",), formula="ent", slots=_POLICY_SLOTS),
    Input("old_entropy", ("loss",), "[B, T]", "float32",
          "per-token entropy of the old policy (from the forward that makes the old logprobs)",
          "policy", arg="old_ent", formula="old_ent", slots=_POLICY_SLOTS),
    Input("rollout_logprobs", ("advantage", "loss"), "[B, T]", "float32",
          "the inference engine's logprobs of the sampled tokens (estimate: a correction's rejections)",
          "engine", arg="rollout_logp", formula="rollout_logp",
          slots=("correction",) + _LOSS_SLOTS + _ADVANTAGE_SLOTS),
    Input("entropy_coef", ("loss",), "[]", "float32",
          "the entropy coefficient of this optimizer step (entropy adaptive): runtime state",
          "algorithm"),
    Input("reward_baselines", ("advantage",), "[B]", "float32",
          "reward of a greedy rollout of each row's prompt, same reward function",
          "rollout", batch="reward_baselines"),
    Input("sum_pi_squared", ("advantage",), "[B, T]", "float32",
          "sum over the vocabulary of the old policy's squared probabilities at each response token",
          "policy", batch="sum_pi_squared"),
    Input("self_certainty", ("advantage",), "[B, T]", "float32",
          "the old policy's self-certainty at each response position: logsumexp_v z_v - mean_v z_v of the "
          "logits z (divided by the sampling temperature) that predict the token, i.e. the KL from the uniform "
          "distribution to pi plus log V (from the forward that makes the old logprobs, no gradient)",
          "policy", formula="self_certainty", slots=_ADVANTAGE_SLOTS),
    Input("reward_components", ("advantage",), "[B, K]", "float32",
          "each reward function's own reward, unweighted", "rollout", batch="reward_components"),
    Input("reward_weights", ("advantage",), "[K]", "float32",
          "each reward function's weight (rewards are the weighted sum of reward_components)",
          "rollout", batch="reward_weights", default="ones", finite=True),
    Input("group_keys", ("advantage",), "[B]", "int",
          "each row's key for a component's group_by=FIELD: equal for rows whose data field FIELD has "
          "equal values, the same value in every step (a stable hash of the value)", "rollout",
          batch="group_keys"),
    Input("dense_rewards", ("advantage",), "[B, T]", "float32",
          "each turn's (or step's) reward on the response token that ends it, weighted as its reward "
          "term; 0 elsewhere", "rollout", formula="r_dense", slots=("shaping", "baseline", "normalizer", "filter")),
    Input("prompt_mean", ("advantage",), "[B]", "float32",
          "the mean of the finite rewards of the row's prompt over every step it was seen in, this one "
          "included (0 while it has none)", "history", formula="prompt_mean", slots=_ADVANTAGE_SLOTS,
          finite=True),
    Input("prompt_var", ("advantage",), "[B]", "float32",
          "the population variance (divided by the count) of those rewards (0 while it has fewer than two)",
          "history", formula="prompt_var", slots=_ADVANTAGE_SLOTS, finite=True),
    Input("prompt_count", ("advantage",), "[B]", "float32",
          "how many finite rewards of the row's prompt those are: G per step seen when none failed",
          "history", formula="prompt_count", slots=_ADVANTAGE_SLOTS, finite=True),
    Input("prompt_steps", ("advantage",), "[B]", "float32",
          "how many times the row's prompt was sampled as a group with a finite reward, this one included: "
          "one per step it was seen in (per sampling round under dynamic sampling)", "history",
          formula="prompt_steps", slots=_ADVANTAGE_SLOTS, finite=True),
    Input("prompt_step_var", ("advantage",), "[B]", "float32",
          "the mean over those groups of each group's Bessel variance (divided by its finite rewards - 1; "
          "0 for a group with one)", "history", formula="prompt_step_var", slots=_ADVANTAGE_SLOTS,
          finite=True),
    Input("teacher_logprobs", ("loss",), "[B, T]", "float32",
          "the teacher's logprobs of the sampled tokens", "teacher", arg="teacher_logp", teacher=True,
          formula="teacher_logp", slots=("kl",) + _LOSS_SLOTS),
    Input("teacher_topk_logprobs", ("loss",), "[B, T, J]", "float32",
          "the teacher's J largest logprobs at each response position (its top-k tokens)", "teacher",
          arg="teacher_topk_logp", teacher=True),
    Input("topk_logprobs", ("loss",), "[B, T, J]", "float32",
          "the policy's logprobs (with gradient) of the teacher's top-k tokens at each response position",
          "update", arg="topk_logp", teacher=True),
    Input("divergence", ("loss",), "[B, T]", "float32",
          "the generalized JSD of the policy from the teacher over the whole vocabulary at each response "
          "position (with gradient; the spec's beta and temperature)", "update", arg="jsd", teacher=True),
    Input("sequence_rewards", ("loss",), "[B]", "float32",
          "each sequence's reward as estimate() received it (before shaping; 0 for a failed reward, whose "
          "row has no loss tokens)", "rollout", arg="seq_reward", formula="reward", slots=_POLICY_SLOTS),
    Input("router_aux", ("loss",), "[B, T]", "float32",
          "a mixture-of-experts policy's router load-balancing loss (E sum_e f_e p_e, averaged over the "
          "MoE layers: f_e the forward's share of top-k picks on expert e, p_e the token's router "
          "probability) of the token at the position that predicts each response token, with gradient "
          "to the routers", "update"),
    Input("ref_reward", ("advantage", "loss"), "[B]", "float32",
          "the reward of the reference model's answers to the row's prompt (the mean over "
          "reward.reference_samples of them, sampled as the rollout samples), scored by the same reward "
          "function; NaN where every one failed: the row then leaves the loss as a failed reward's does",
          "reference_rollout", formula="ref_reward", slots=_ADVANTAGE_SLOTS + _POLICY_SLOTS,
          fails_row=True),
    # the policy's probability of the data's reference answer (RLPR): the row's completion is cut after its
    # answer tag, the reference answer put in place of its own, and the policy that sampled scores it
    Input("answer_prob", ("advantage",), "[B]", "float32",
          "the mean per-token probability the policy that sampled the row gives the data's reference answer "
          "placed after the row's own reasoning (its completion up to the answer tag); 0 where the completion "
          "has not exactly one answer tag followed by an answer", "answer", formula="answer_prob",
          slots=_ADVANTAGE_SLOTS, finite=True),
    Input("bare_answer_prob", ("advantage",), "[B]", "float32",
          "the same probability of the reference answer placed right after the prompt, with no reasoning "
          "(the debiasing term: what the answer scores without the row's reasoning)", "answer",
          formula="bare_answer_prob", slots=_ADVANTAGE_SLOTS, finite=True),
    # the policy's top-K candidates (K: the reading formula's parameter K). The K token ids at each
    # position are the OLD policy's K most likely ones (the no-grad forward before the update; an
    # exactly on-policy update's own forward, which is that policy): old_topk_logprobs are their
    # logprobs there, largest first, policy_topk_logprobs the current policy's at the same ids
    Input("policy_topk_logprobs", ("loss",), "[B, T, K]", "float32",
          "the current policy's logprobs (with gradient) of the K tokens the old policy found most likely at "
          "each response position (the ids of old_topk_logprobs, in its order)", "update",
          arg="pol_topk_logp", formula="topk_logp", slots=_POLICY_SLOTS),
    Input("old_topk_logprobs", ("loss",), "[B, T, K]", "float32",
          "the old policy's K largest logprobs at each response position, largest first (its top-K tokens; "
          "from the forward that makes the old logprobs)", "policy", arg="old_topk_logp",
          formula="old_topk_logp", slots=_POLICY_SLOTS),
    Input("is_top1", ("loss",), "[B, T]", "float32",
          "1 where the sampled token is the old policy's most likely token at its position (a tie for the "
          "largest logit counts), else 0", "policy", formula="is_top1", slots=_POLICY_SLOTS),
    # sampling replay's priority: a formula of one group (its B rows are the group's samples whose
    # reward is scorable; `r` is their rewards). No generated function takes these: stages ()
    *(Input(name, (), shape, "float32", meaning, "replay", formula=formula, slots=("priority",))
      for name, shape, formula, meaning in [
          ("group_reward_deviations", "[B]", "adv", "each reward minus the group's mean reward, r - mean"),
          ("group_reward_mean", "[]", "mean", "the group's mean reward"),
          ("group_reward_std", "[]", "std", "the unbiased standard deviation of the group's rewards (0 below two)"),
          ("group_reward_count", "[]", "n", "how many of the group's rewards are scorable (a failed, NaN one is not)")]),
    # TreeRL's trees (sampling tree): each row is a leaf holding its whole path; a node is a run of
    # tokens the same leaves share (runtime/rollout/tree.py makes these from the group's forks)
    *(Input(name, ("advantage",), shape, "float32", "sampling tree: " + meaning, "tree", formula=name,
            slots=_ADVANTAGE_SLOTS, finite=True)
      for name, shape, meaning in [
          ("node_value", "[B, T]", "the mean reward of the leaves (rows) below the tree node that holds the token"),
          ("parent_value", "[B, T]", "the mean reward of the leaves below that node's parent (the root's for a first node)"),
          ("root_value", "[B]", "the mean reward of every leaf of the row's prompt (the tree's root)"),
          ("node_leaves", "[B, T]", "how many leaves lie below the token's node (1 on a row's own last segment)"),
          ("parent_leaves", "[B, T]", "how many leaves lie below that node's parent (G for a first node)")]),
]}


def of_stage(stage: str) -> list[Input]:
    """The inputs a call of ``stage`` takes as keywords, in table order."""
    return [i for i in INPUTS.values() if stage in i.stages]


def extra_args(stage: str, read: Iterable[str], passed: Iterable[str] = ()) -> list[Input]:
    """The inputs the generated function of ``stage`` takes beyond its fixed arguments:
    those not ``always`` taken that an active component reads (``read``: input names) or
    whose ``arg`` its slot passes to every component (``passed``: slot signature arguments),
    in table order."""
    read, passed = set(read), set(passed)
    return [i for i in INPUTS.values() if stage not in i.always and stage in i.stages
            and (i.name in read or i.arg in passed)]


def readable(slot: str) -> list[Input]:
    """The inputs a formula in ``slot`` may read (``slots`` lists it), in table order."""
    return [i for i in INPUTS.values() if i.formula is not None and slot in i.slots]


def missing(read: Iterable[str], given: Mapping[str, object]) -> list[str]:
    """The inputs of ``read`` that a call left out (None) and that have no default."""
    return [x for x in read if x in given and given[x] is None and not INPUTS[x].default]


def failing_rows(given: Mapping[str, object]) -> list[Input]:
    """The inputs given (not None) whose non-finite values mark their rows failed (``fails_row``)."""
    return [INPUTS[x] for x, v in given.items() if v is not None and INPUTS[x].fails_row]


def check_shape(inp: Input, value: object, sizes: dict[str, int]) -> str | None:
    """An error message if ``value``'s shape does not match ``inp.shape``; binds new letters in
    ``sizes`` (e.g. K from the first [B, K] input)."""
    shape = tuple(getattr(value, "shape", ()))
    if len(shape) != inp.rank:
        return f"{inp.name} must be {inp.shape}; got {shape}"
    for d, n in zip(inp.dims, shape):
        want = sizes.setdefault(d, n)
        if n != want:
            known = ", ".join(f"{k} = {v}" for k, v in sizes.items())
            return f"{inp.name} must be {inp.shape} with {known}; got {shape}"
    return None


def doc_table() -> str:
    """Markdown: every input with its stages, shape, dtype, source and meaning (docs/components.md)."""
    rows = ["| input | stages | shape | dtype | made by | formulas read it as | meaning |",
            "|---|---|---|---|---|---|---|"]
    for i in INPUTS.values():
        calls = ", ".join({"advantage": "estimate", "loss": "loss"}[s] for s in i.stages)
        read = f"`{i.formula}` in {', '.join(i.slots)}" if i.formula else "-"
        rows.append(f"| `{i.name}` | {calls} | {i.shape} | {i.dtype} | {i.source} | {read} | {i.meaning} |")
    return "\n".join(rows)
