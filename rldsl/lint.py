"""Warnings: specs that are legal but almost surely slips, one function per rule.

``rldsl check`` prints the spec rules (:data:`SPEC_RULES`) as ``file:line:col: warning: ...``
with the source line, a caret and a hint, and exits 0 unless ``--strict``. ``rldsl run``
prints them once at the start together with the rules that need the run's config
(:data:`RUN_RULES`: the group size, the generation budget, the rollout engine).

Every rule reads registry facts (``Facts.roles``, ``per_group``, ``plan``, ``needs``), never a
component's name, so a new component with the same facts gets the same warnings. Legal
values the registry already refuses are not repeated here: a clip ``low`` >= 1, a
``dual_clip`` with ``c`` <= 1, SAPO temperatures <= 0 and a negative entropy coefficient
are errors (their parameters' ranges), and one ``kl`` slot cannot hold a KL both in the
reward and in the loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from . import registry
from .errors import Span, SpecWarning
from .inputs import INPUTS
from .registry import format_value
if TYPE_CHECKING:  # spec.py imports torch (formula hooks); `rldsl check --help` lists the rules without it
    from .spec import Algorithm
    from .values import SlotValue


@dataclass(frozen=True)
class RunFacts:
    """What the run-start rules need from a run's config (the runtime fills it in)."""

    group_size: int              # rollout.n
    max_new_tokens: int          # the run's generation budget (rollout.max_new_tokens resolved)
    engine: str                  # rollout.engine
    exact_logprobs: bool         # the engine's logprobs are the trainer's own (the HF engine)
    max_staleness: int = 0       # rollout.max_staleness: samples up to K policy versions old


@dataclass(frozen=True)
class Finding:
    """One slip: the slot value (and parameter) it is about, the message and a hint."""

    value: SlotValue
    param: str | None
    message: str
    hint: str | None = None


SpecRule = Callable[["Algorithm"], Iterator[Finding]]
RunRule = Callable[["Algorithm", RunFacts], Iterator[Finding]]
SPEC_RULES: dict[str, SpecRule] = {}
RUN_RULES: dict[str, RunRule] = {}


def spec_rule(name: str) -> Callable[[SpecRule], SpecRule]:
    def deco(fn: SpecRule) -> SpecRule:
        SPEC_RULES[name] = fn
        return fn
    return deco


def run_rule(name: str) -> Callable[[RunRule], RunRule]:
    def deco(fn: RunRule) -> RunRule:
        RUN_RULES[name] = fn
        return fn
    return deco


def summary(rule: Callable[..., Any]) -> str:
    """The first line of a rule's docstring: what ``rldsl check --help`` and the docs list."""
    return (rule.__doc__ or "").strip().splitlines()[0]


def _roles(algo: Algorithm, role: str) -> Iterator[tuple[SlotValue, str, Any]]:
    """(slot value, parameter, value) for every active component with a parameter in ``role``."""
    for v in algo.active():
        p = v.spec.facts.roles.get(role)
        if p is not None and v.params.get(p) is not None:
            yield v, p, v.params[p]


def _arg(v: SlotValue, p: str) -> str:
    return f"{v.slot} {v.component}({p}={format_value(v.params[p])})"


# ---------------------------------------------------------------------------------------
# Spec rules: the spec alone


@spec_rule("weight-bound-excludes-1")
def weight_bound_excludes_one(algo: Algorithm) -> Iterator[Finding]:
    """A weight's cap (or band) leaves out 1: every on-policy token is scaled down or masked."""
    for v, p, x in _roles(algo, "cap_offset"):
        if x < 0:
            yield Finding(v, p, f"{_arg(v, p)} caps the weight at 1 + {p} = "
                                f"{format_value(round(1 + x, 12))} < 1: every token with rho near 1 is "
                                "scaled down",
                          "high is an offset from 1 (TRL's CISPO epsilon_high 5.0 is high=4.0; TRL's "
                          "unset epsilon_high caps at 0.2, i.e. high=-0.8)")
    for v, p, x in _roles(algo, "weight_high"):
        if x < 1:
            yield Finding(v, p, f"{_arg(v, p)} bounds the weight below 1: tokens sampled exactly "
                                "on-policy (weight 1) are cut", "the bound is absolute (verl's TIS "
                                "threshold 2.0 is high=2.0)")
    for v, p, x in _roles(algo, "weight_low"):
        if x > 1:
            yield Finding(v, p, f"{_arg(v, p)} bounds the weight above 1: tokens sampled exactly "
                                "on-policy (weight 1) are cut", "the bound is absolute (IcePop's "
                                "band is low=0.5, high=5.0)")


@spec_rule("zero-coefficient")
def zero_coefficient(algo: Algorithm) -> Iterator[Finding]:
    """A KL or entropy term with coefficient 0: the slot does nothing (and a KL still loads the reference)."""
    for v, p, x in _roles(algo, "scale"):
        if x == 0:
            off = [c.name for c in registry.REGISTRY[v.slot].values() if c.off]
            extra = " and no reference model is loaded" if any(
                INPUTS[x].source == "reference" for x in v.spec.facts.needs) else ""
            yield Finding(v, p, f"{_arg(v, p)} multiplies the term by 0",
                          f"write `{v.slot} {off[0]}`{extra}" if off else None)


@spec_rule("epsilon-as-bound")
def epsilon_as_bound(algo: Algorithm) -> Iterator[Finding]:
    """A clip offset of 1 or more: the bound 1 + high is at least 2, likely the bound written for the offset."""
    for v, p, x in _roles(algo, "epsilon_high"):
        if x >= 1:
            yield Finding(v, p, f"{_arg(v, p)} lets the ratio rise to 1 + {format_value(x)} = "
                                f"{format_value(round(1 + x, 12))}",
                          f"{p} is epsilon, an offset from 1: clip-higher 1.28 is {p}=0.28")


@spec_rule("clip-higher-reversed")
def clip_higher_reversed(algo: Algorithm) -> Iterator[Finding]:
    """epsilon_high below epsilon_low: the reverse of clip-higher, it clips the ratio up sooner than down."""
    for v, p, hi in _roles(algo, "epsilon_high"):
        lo_p = v.spec.facts.roles.get("epsilon_low")
        lo = v.params.get(lo_p) if lo_p else None
        if lo is not None and hi < lo:
            yield Finding(v, p, f"{v.slot} {v.component}: {p}={format_value(hi)} is below "
                                f"{lo_p}={format_value(lo)}",
                          f"clip-higher (DAPO) is {lo_p}=0.2, {p}=0.28; swap them if that was meant")


@spec_rule("zero-denominator-eps")
def zero_denominator_eps(algo: Algorithm) -> Iterator[Finding]:
    """A normaliser with eps 0: a group or batch whose rewards are all equal divides 0 by 0 (NaN advantages)."""
    for v, p, x in _roles(algo, "denominator_eps"):
        if x == 0:
            yield Finding(v, p, f"{_arg(v, p)}: equal rewards give a spread of 0 and 0/0 = NaN "
                                "advantages", "keep a small eps (verl 1e-6, TRL 1e-4)")


@spec_rule("inert-dynamic-sampling")
def inert_dynamic_sampling(algo: Algorithm) -> Iterator[Finding]:
    """Dynamic sampling allowed only one generation round: it never resamples."""
    for v in algo.active():
        p = v.spec.facts.plan.get("dynamic_rounds")
        if p is not None and v.params.get(p) == 1:
            yield Finding(v, p, f"{_arg(v, p)} allows one round: nothing is ever resampled",
                          f"raise {p} (the DAPO recipe: 10), or remove the {v.slot} line")


@spec_rule("dense-rewards-unread")
def dense_rewards_unread(algo: Algorithm) -> Iterator[Finding]:
    """Rewards declared per turn (rewards dense) that nothing reads per token: every advantage sees only their sum."""
    rewards = algo["rewards"]
    made = set(rewards.spec.facts.needs)
    if not made:
        return
    readers = [v for v in algo.active("advantage") if v is not rewards
               and (v.spec.facts.token_rewards or made & set(v.spec.facts.needs))]
    if not readers:
        yield Finding(rewards, None, f"rewards {rewards.component}: no component reads per-token rewards "
                                     f"(baseline {algo['baseline'].component} reads the sequence reward), so "
                                     "the turns' rewards count only as their sum",
                      "use a token-level baseline (gae with a critic, return_to_go), or drop the rewards line")


@spec_rule("empty-band")
def empty_band(algo: Algorithm) -> Iterator[Finding]:
    """A band whose upper end is not above its lower end: nothing ever falls in it, so the component never acts."""
    for v, p, hi in _roles(algo, "band_high"):
        lo_p = v.spec.facts.roles.get("band_low")
        lo = v.params.get(lo_p) if lo_p else None
        if lo is not None and hi <= lo:
            yield Finding(v, p, f"{v.slot} {v.component}: the band ({lo_p}, {p}) = ({format_value(lo)}, "
                                f"{format_value(hi)}) is empty: no token ever qualifies",
                          f"{p} must exceed {lo_p} (verl clip_cov: lb=1.0, ub=5.0); swap them if that was meant")


# ---------------------------------------------------------------------------------------
# Run rules: the spec against the run's config


@run_rule("budget-mismatch")
def budget_mismatch(algo: Algorithm, run: RunFacts) -> Iterator[Finding]:
    """A constant generation budget (Dr. GRPO's normaliser, the overlong penalty's L_max) other than rollout.max_new_tokens."""
    for v, p, x in _roles(algo, "budget"):
        if x != run.max_new_tokens:
            yield Finding(v, p, f"{_arg(v, p)} is not the run's generation budget "
                                f"rollout.max_new_tokens={run.max_new_tokens}",
                          f"set {p}={run.max_new_tokens} in the spec, or --set "
                          f"rollout.max_new_tokens={x}")


@run_rule("dynamic-sampling-one-sample")
def dynamic_sampling_one_sample(algo: Algorithm, run: RunFacts) -> Iterator[Finding]:
    """Dynamic sampling with one sample per prompt: a group of one never has mixed outcomes, so every round is spent."""
    if run.group_size != 1:
        return
    for v in algo.active():
        if v.spec.facts.plan.get("dynamic_rounds") is not None:
            yield Finding(v, None, f"{v.slot} {v.component} with rollout.n=1: no group ever has "
                                   "mixed outcomes, every step draws the most rounds",
                          "set rollout.n >= 2")


@run_rule("group-of-one")
def group_of_one(algo: Algorithm, run: RunFacts) -> Iterator[Finding]:
    """A group statistic (group baseline, group std, zero-variance filter) with one sample per prompt."""
    if run.group_size != 1:
        return
    for v in algo.active():
        if not algo.task_loss and registry.SLOTS[v.slot].task_only:
            continue  # distillation alone (distill task=false): the advantages reach no term of the loss
        if v.spec.flag("per_group", v.params):
            yield Finding(v, None, f"{v.slot} {v.component} compares the samples of a prompt's group, "
                                   "but rollout.n=1: every group has one sample",
                          "set rollout.n >= 2 (GRPO-style specs need several samples per prompt)")


@run_rule("correction-on-exact-engine")
def correction_on_exact_engine(algo: Algorithm, run: RunFacts) -> Iterator[Finding]:
    """A train/inference correction on an engine with exact logprobs (the HF engine): a no-op (bypass excepted)."""
    if not run.exact_logprobs:
        return
    if any(v.spec.flag("old_from_rollout", v.params) for v in algo.active()):
        # bypass: pi_old is the engine's logprobs, so the other corrections compare pi_theta with them,
        # which drifts apart over minibatches and epochs; bypass itself only skips the old-logprob forward
        return
    for v in algo.active():
        if any(INPUTS[x].source == "engine" for x in v.spec.facts.needs):
            yield Finding(v, None, f"{v.slot} {v.component}: rollout.engine={run.engine} samples with "
                                   "the trainer's own logprobs, so the weights are 1 and nothing is "
                                   "rejected", "the correction matters with rollout.engine=vllm")


@run_rule("off-policy-without-correction")
def off_policy_without_correction(algo: Algorithm, run: RunFacts) -> Iterator[Finding]:
    """Asynchronous rollouts (rollout.max_staleness > 0) with no correction of the stale samples."""
    if run.max_staleness == 0:
        return
    active = list(algo.active())
    if any(v.spec.flag("old_from_rollout", v.params) or any(INPUTS[x].source == "engine" for x in v.spec.facts.needs)
           for v in active):  # bypass, or a component that weighs the engine's logprobs
        return
    anchor = next((v for v in active if v.slot == "objective"), active[0])
    yield Finding(anchor, None, f"rollout.max_staleness={run.max_staleness}: samples come from a policy up to "
                                f"{run.max_staleness} update(s) old, and no correction weighs them",
                  "add a correction (`correction importance(level=token, high=2.0)` for TIS, or "
                  "`correction bypass`) -- or keep it, to measure what staleness costs")


# ---------------------------------------------------------------------------------------
# Rendering


def _warning(algo: Algorithm, rule: str, f: Finding) -> SpecWarning:
    origin = f.value.param_origins.get(f.param) if f.param else None
    origin = origin or f.value.origin
    if origin is None:  # a slot default: the algorithm as a whole
        return SpecWarning(rule, f.message + f" (slot {f.value.slot} is the default)", Span(algo.file),
                           hint=f.hint)
    source = algo.source if origin.file == algo.file else algo.parent_sources.get(origin.algorithm)
    length = len(f.param) if f.param and f.param in f.value.param_origins else len(f.value.component)
    return SpecWarning(rule, f.message, Span(origin.file, origin.line, origin.column, length),
                       hint=f.hint, source=source)


# ---------------------------------------------------------------------------------------
# Notes: facts worth knowing about a legal spec, printed by `rldsl check` as `note:` (never a
# warning: --strict does not fail on them)


NOTE_RULES: dict[str, SpecRule] = {}


def note_rule(name: str) -> Callable[[SpecRule], SpecRule]:
    def deco(fn: SpecRule) -> SpecRule:
        NOTE_RULES[name] = fn
        return fn
    return deco


@note_rule("clamped-rho")
def clamped_rho(algo: Algorithm) -> Iterator[Finding]:
    """A formula reads rho under a ratio that clamps each token's log-ratio (the default: +-20): rho is exp of the clamped value."""
    ratio = algo["ratio"]
    p = ratio.spec.facts.roles.get("log_ratio_clamp")
    if ratio.formula is not None or p is None or ratio.params.get(p) is None:
        return
    c = format_value(ratio.params[p])
    for v in algo.active():
        if v.formula is not None and "rho" in v.formula.reads:
            yield Finding(v, None, f"{v.slot} {v.component} reads rho, which {ratio.slot} {ratio} makes as "
                                   f"exp(clamp(logp - old_logp, -{c}, {c})): a log-ratio past +-{c} is cut there",
                          f"for the unclamped ratio write exp(logp - old_logp), or set {ratio.slot} "
                          f"{ratio.component}({p}=...) (a large value turns the clamp off)")


def notes(algo: Algorithm) -> list[SpecWarning]:
    """The notes for ``algo``: rendered like warnings with ``note:``, in rule order."""
    out = [_warning(algo, name, f) for name, rule in NOTE_RULES.items() for f in rule(algo)]
    for n in out:
        n.severity = "note"
    return out


def check(algo: Algorithm) -> list[SpecWarning]:
    """The spec rules' warnings for ``algo``, in rule order."""
    return [_warning(algo, name, f) for name, rule in SPEC_RULES.items() for f in rule(algo)]


def check_run(algo: Algorithm, run: RunFacts) -> list[SpecWarning]:
    """Every warning at the start of a run: the spec rules, then the rules on the run's config."""
    return check(algo) + [_warning(algo, name, f) for name, rule in RUN_RULES.items()
                          for f in rule(algo, run)]


def rules_text() -> str:
    """The rules, one per line, for ``rldsl check --help`` and the docs."""
    lines = [f"{name}: {summary(r)}" for name, r in SPEC_RULES.items()]
    lines += [f"{name} (at run start): {summary(r)}" for name, r in RUN_RULES.items()]
    lines += [f"{name} (a note): {summary(r)}" for name, r in NOTE_RULES.items()]
    return "\n".join(lines)
