"""The component registry: the single source of truth for every slot and component.

A *slot* is a role in an algorithm (``baseline``, ``trust_region``, ...). A *component*
fills a slot: a plain torch function registered under ``(slot, name)`` with typed,
range-checked parameters and a docstring that states its formula, its source and its
tensor shapes. The checker, ``rldsl explain``, the code generator and the docs all read
this registry; nothing else defines a formula.

Every component of a slot has that slot's signature (see ``SLOTS``), so the generated code
calls any of them the same way; ``register`` checks it. What a component needs or does
beyond its formula (inputs, the ratio, what the runtime carries out) is declared as
:class:`Facts` in the same ``register(...)`` call, so no other module tells components
apart by name. docs/components.md shows how to add a component or a slot.
"""
from __future__ import annotations

import inspect
import math
import re
import types
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from .inputs import INPUTS

# ---------------------------------------------------------------------------------------
# Parameters


class _Required:
    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Param:
    """A typed component parameter.

    kind: "float" | "int" | "bool" | "choice" | "field" (a data field's name) | "formula" (one of
    ``choices`` or a quoted formula, rldsl/formula/argument.py). ``default`` is
    REQUIRED, None (optional, absent unless given) or a value. Bounds are inclusive (ge/le) or exclusive (gt/lt).
    ``runtime`` params shape the generated code (e.g. where a KL term goes) instead of
    being passed to the component function. ``stages`` maps each choice to the stage the
    component then acts in (kl ``where=reward`` moves it from the loss to the advantage).
    ``when``: ``(param, value)``, the parameter is read only when that other parameter has that
    value (a distill component's ``clip_low`` with ``mode=policy_gradient``); elsewhere it is
    ignored, and ``rldsl explain`` leaves it out.
    ``needs``: inputs (inputs.INPUTS) the component reads only when the parameter is given (not
    None): ``group_by=role`` reads ``group_keys``; :meth:`Component.given` adds them to its facts.
    A ``field`` parameter names a data field (a word: ``group_by=role``); given, the component
    compares the rows that share the field's value instead of a prompt's group (no ``per_group``).
    """

    kind: str
    default: Any = REQUIRED
    doc: str = ""
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    runtime: bool = False
    stages: dict[str, str] | None = None
    when: tuple[str, Any] | None = None
    needs: tuple[str, ...] = ()

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def used(self, values: dict[str, Any]) -> bool:
        """Whether the component reads it with these parameter values (``when``)."""
        return self.when is None or values.get(self.when[0]) == self.when[1]

    def describe(self) -> str:
        """e.g. ``float > 0, default 0.2``."""
        parts = [{"choice": "|".join(self.choices), "field": "a data field's name",
                  "formula": "|".join(self.choices) + "|\"a group formula\""}.get(self.kind, self.kind)]
        for sym, v in (("> ", self.gt), (">= ", self.ge), ("< ", self.lt), ("<= ", self.le)):
            if v is not None:
                parts.append(f"{sym}{format_value(v)}")
        if self.required:
            parts.append("required")
        elif self.default is None:
            parts.append("optional")
        else:
            parts.append(f"default {format_value(self.default)}")
        if self.when is not None:
            parts.append(f"read only with {self.when[0]}={format_value(self.when[1])}")
        return ", ".join(parts)

    def check(self, value: Any) -> str | None:
        """An error message if ``value`` (already typed) is out of range, else None."""
        if self.kind in ("float", "int"):
            if isinstance(value, float) and not math.isfinite(value):
                return "must be a finite number"
            for bound, ok, sym in ((self.gt, lambda v, b: v > b, ">"),
                                   (self.ge, lambda v, b: v >= b, ">="),
                                   (self.lt, lambda v, b: v < b, "<"),
                                   (self.le, lambda v, b: v <= b, "<=")):
                if bound is not None and not ok(value, bound):
                    return f"must be {sym} {format_value(bound)}, got {format_value(value)}"
        if self.kind == "choice" and value not in self.choices:
            return "must be one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind == "field" and not (isinstance(value, str) and FIELD_NAME.fullmatch(value)):
            return f"must name a data field (letters, digits, '_'), got {format_value(value)}"
        return None


def Float(default: Any = REQUIRED, doc: str = "", **kw: Any) -> Param:
    return Param("float", default, doc, **kw)


def Int(default: Any = REQUIRED, doc: str = "", **kw: Any) -> Param:
    return Param("int", default, doc, **kw)


def Bool(default: Any = REQUIRED, doc: str = "", **kw: Any) -> Param:
    return Param("bool", default, doc, **kw)


def Choice(choices: tuple[str, ...], default: Any = REQUIRED, doc: str = "", **kw: Any) -> Param:
    return Param("choice", default, doc, choices=tuple(choices), **kw)


def Formula(choices: tuple[str, ...], default: Any = REQUIRED, doc: str = "", **kw: Any) -> Param:
    """A word among ``choices`` or a quoted formula of the language (rldsl/formula/argument.py; the
    parameter's name is its slot in ``formula.lang.ARGUMENTS``): ``priority=uniform``,
    ``priority="std * sum(abs(adv))"``; the spec checks it as a slot's formula (names, shape)."""
    return Param("formula", default, doc, choices=tuple(choices), **kw)


def Field(doc: str = "", **kw: Any) -> Param:
    """An optional parameter naming a data field (``group_by=role``); None: not given."""
    return Param("field", None, doc, **kw)


FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def format_value(v: Any) -> str:
    """A parameter value as the DSL writes it: ``true``/``false``, ``0.2``, ``loss``; ``-`` for None.

    The one formatter of values for messages, ``rldsl list`` and ``rldsl explain``.
    """
    if isinstance(v, bool):
        return "true" if v else "false"
    return "-" if v is None else str(v)


# ---------------------------------------------------------------------------------------
# Inputs, runtime plan and facts


PLAN: dict[str, str] = {
    # what the runtime carries out, as fields of CompiledAlgorithm.data (DataPlan)
    "dynamic_rounds": "generation rounds per step (1 unless sampling resamples)",
    "replay_policy": "sampling replay's policy, set from its capacity (rldsl/priority.ReplayPolicy; None: no replay)",
    "pass_rate_cap": "prompts whose pass rate is above it leave later epochs (None: none do)",
    "teacher_topk": "tokens per position the teacher returns with their logprobs (None: no top-k)",
    "jsd_beta": "the generalized JSD's beta the update computes over the vocabulary (None: none)",
    "jsd_temperature": "the temperature of both models' logits in that JSD",
    "policy_topk": "K, the policy's top-K tokens per position its forwards keep for formulas (None: none)",
    "tree_shape": "sampling tree's shape (rldsl.compiled.TreePlan: M, N, L, T; None: no tree)",
}


ROLES: dict[str, str] = {
    # what a parameter means beyond its range, for the warnings of `rldsl check` and of a run's
    # start (rldsl/lint.py): legal values that are almost surely slips are told by role
    "scale": "multiplies the component's whole term: 0 leaves it with nothing to do",
    "epsilon_low": "a clip offset: the ratio may fall to 1 - value",
    "epsilon_high": "a clip offset: the ratio may rise to 1 + value (an offset, not the bound)",
    "cap_offset": "the weight is capped at 1 + value",
    "weight_low": "an absolute lower bound on a weight whose on-policy value is 1",
    "weight_high": "an absolute upper bound on a weight whose on-policy value is 1",
    "denominator_eps": "added to a spread (std, variance) that is 0 for equal rewards: 0 gives 0/0",
    "budget": "the generation budget in tokens: should equal the run's rollout.max_new_tokens",
    "band_low": "the exclusive lower end of a band a statistic must fall in (with band_high)",
    "band_high": "the exclusive upper end of that band: at or below band_low the band is empty",
    "log_ratio_clamp": "every token's log-ratio is clamped to +-value before rho = exp(log ratio)",
}


@dataclass(frozen=True)
class Requires:
    """A condition on another slot: ``Requires("rewards", "binary", why)``."""

    slot: str
    component: str
    why: str = ""


@dataclass(frozen=True)
class Facts:
    """What a component declares in ``register(...)`` besides its parameters and formula.

    The checker, the code generator, ``rldsl explain`` and CompiledAlgorithm read these;
    nothing outside the registry tells components apart by name. Flags (``uses_ratio``,
    ``per_token_only``, ``sequence_level``) are True/False or the name of a bool parameter
    whose value decides.
    """

    off: bool = False                     # leaves its slot unused (`none`): no term, no input, no line
    needs: tuple[str, ...] = ()           # inputs.INPUTS it reads: a call without one fails, naming it
    provides: tuple[str, ...] = ()        # inputs.INPUTS that exist because of it (a critic: `values`)
    uses_ratio: bool | str = False        # reads rho or the weight w; without any, the ratio is skipped
    per_token_only: bool | str = False    # defined on per-token ratios: refuses a sequence-level one
    sequence_level: bool | str = False    # its ratio is one value per sequence
    requires: tuple[Requires, ...] = ()   # other slots it needs filled with a given component
    plan: dict[str, str] = field(default_factory=dict)  # PLAN field -> parameter holding its value
    roles: dict[str, str] = field(default_factory=dict)  # ROLES entry -> parameter that plays it
    per_group: bool | str = False         # compares the samples of one prompt's group (needs G >= 2)
    old_from_rollout: bool | str = False  # pi_old is the engine's logprobs: no old-logprob forward (bypass)
    token_rewards: bool = False           # reads the per-token rewards (AdvantageBatch.token_rewards)


FACTS: tuple[str, ...] = tuple(f.name for f in fields(Facts))
_FLAGS = ("uses_ratio", "per_token_only", "sequence_level", "per_group", "old_from_rollout")


# ---------------------------------------------------------------------------------------
# Slots

_SIG = re.compile(r"\((?P<args>[^()]*)\)\s*->\s*\S.*")
_SIG_ARG = re.compile(r"\s*(?P<name>[a-z_][a-z0-9_]*)\s*(\[[^\]]*\])?\s*")


def signature_args(signature: str) -> tuple[str, ...] | None:
    """The argument names of a slot signature ``(rho [B, T], adv [B, T]) -> w [B, T]``; None for ``-``."""
    if signature == "-":
        return None
    m = _SIG.fullmatch(signature)
    if not m:
        raise ValueError(f"slot signature {signature!r} is not '(arg [shape], ...) -> result'")
    names = []
    for part in re.split(r",(?![^\[]*\])", m["args"]):  # commas outside [..]
        a = _SIG_ARG.fullmatch(part)
        if not a:
            raise ValueError(f"slot signature {signature!r}: cannot read argument {part.strip()!r}")
        names.append(a["name"])
    return tuple(names)


@dataclass(frozen=True)
class Slot:
    """A role in an algorithm. ``stage`` says where it acts:

    advantage — in ``estimate()`` (eager): rewards -> advantages, loss mask
    loss      — in the compiled ``loss()``
    data      — carried out by the runtime (sampling, prompt filters); declared and validated here
    declare   — a fact about the task that other slots are checked against

    ``signature`` is how the generated code calls every component of the slot (its first
    arguments, by name and in order; ``-`` for slots without a function); ``register``
    refuses a function that differs. ``declares`` lists the facts each of its components
    must state (a default there would silently change the loss or skip a check).
    ``keyword_inputs``: a component of the slot takes the inputs it ``needs`` as keyword
    arguments named by their ``arg`` (after the slot's arguments), so each component reads
    only its own inputs (``distill``: a teacher's sampled-token or top-k logprobs).
    ``task_only``: what the slot makes reaches the loss only through the policy loss of the
    task's advantages, which a ``distill`` with ``task=false`` drops (``Algorithm.task_loss``):
    the baseline and the normalizer, not a filter (its mask holds for every term).
    """

    name: str
    stage: str
    default: str
    signature: str
    doc: str
    multi: bool = False
    declares: tuple[str, ...] = ()
    keyword_inputs: bool = False  # its components get the inputs they need as keywords (by ``arg``)
    task_only: bool = False       # acts only through the task's policy loss (the advantages)

    def __post_init__(self) -> None:
        signature_args(self.signature)  # a malformed signature fails at import
        unknown = [f for f in self.declares if f not in FACTS]
        if unknown:
            raise ValueError(f"slot {self.name}: unknown facts {unknown}")

    @property
    def args(self) -> tuple[str, ...] | None:
        return signature_args(self.signature)


STAGES = ("declare", "advantage", "data", "loss")

# The order of this table is the data flow: `rldsl explain`, `list` and diffs follow it.
SLOTS: dict[str, Slot] = {s.name: s for s in [
    Slot("rewards", "declare", "scalar", "-",
         "what the verifier returns: binary (0/1) or scalar rewards"),
    Slot("shaping", "advantage", "none",
         "(rewards [B], batch) -> rewards [B]",
         "reward transforms applied before the advantage", multi=True),
    Slot("baseline", "advantage", "none",
         "(batch) -> (advantages [B, T], returns [B, T])",
         "b subtracted from the reward (or GAE with a critic); returns are value targets", task_only=True),
    Slot("normalizer", "advantage", "none",
         "(adv [B, T], batch) -> adv [B, T]",
         "divides (r - b); or whitens token advantages", task_only=True),
    Slot("filter", "advantage", "none",
         "(batch) -> keep [B]",
         "samples removed from the loss (masked, never dropped from metrics)", multi=True),
    Slot("sampling", "data", "once", "-",
         "how the runtime draws groups (once, resampling until groups have mixed outcomes, or replaying "
         "kept groups)"),
    Slot("correction", "loss", "none",
         "(old_logp [B, T], rollout_logp [B, T], mask [B, T]) -> (weight [B, T], keep [B, T], metrics)",
         "the train/inference mismatch: importance weights on the policy loss, rejected tokens",
         multi=True),
    Slot("ratio", "loss", "token",
         "(logp [B, T], old_logp [B, T], mask [B, T], adv [B, T]) -> log_ratio [B, T]",
         "the importance ratio: per token, or per sequence (GSPO's or GMPO's geometric mean, the product)",
         declares=("sequence_level",)),
    Slot("trust_region", "loss", "none",
         "(rho [B, T], adv [B, T], logp [B, T], old_logp [B, T]) -> w [B, T]",
         "turns the ratio into the weight the objective uses (clipped, truncated or masked)",
         declares=("per_token_only",)),
    Slot("objective", "loss", "ppo",
         "(w [B, T], adv [B, T], logp [B, T], mask [B, T]) -> loss [B, T]",
         "the per-token surrogate to minimise", declares=("uses_ratio",)),
    Slot("kl", "loss", "none",
         "(logp [B, T], ref_logp [B, T], rho [B, T]) -> kl [B, T]",
         "penalty against the reference policy, in the loss or in the reward",
         declares=("uses_ratio",)),
    Slot("distill", "loss", "none",
         "(logp [B, T], mask [B, T]) -> (d [B, T], metrics)",
         "a per-token divergence from a teacher: a supervised term, or minus it as a per-token advantage",
         keyword_inputs=True),
    Slot("selection", "loss", "all",
         "(adv [B, T], logp [B, T], old_logp [B, T], rollout_logp [B, T], entropy [B, T], mask [B, T], "
         "rho [B, T], w [B, T]) -> keep [B, T]",
         "which tokens keep their policy loss (the denominator is unchanged)", multi=True),
    Slot("entropy", "loss", "none",
         "(entropy [B, T]) -> term [B, T]",
         "entropy regularisation added to the per-token loss"),
    Slot("router", "loss", "none",
         "(router_aux [B, T]) -> term [B, T]",
         "a mixture-of-experts policy's router load-balancing (auxiliary) loss added to the per-token loss"),
    Slot("aggregation", "loss", "token_mean",
         "(mask [B, T], group_size) -> (weights [B, T], count [])",
         "how per-token losses become one scalar: sum(l * weights) / count, exact denominators"),
    Slot("critic", "loss", "none",
         "(values [B, T], old_values [B, T], returns [B, T]) -> value_loss [B, T]",
         "a value model and its loss (needed by the gae baseline)"),
]}


# ---------------------------------------------------------------------------------------
# Components


@dataclass(frozen=True)
class Component:
    slot: str
    name: str
    fn: Callable[..., Any] | None
    params: dict[str, Param]
    doc: str
    sections: dict[str, str] = field(default_factory=dict)
    facts: Facts = field(default_factory=Facts)
    declared: frozenset[str] = frozenset()  # the facts given explicitly at registration

    @property
    def summary(self) -> str:
        return self.doc.strip().splitlines()[0] if self.doc.strip() else ""

    @property
    def formula(self) -> str:
        return self.sections.get("formula", "")

    @property
    def source(self) -> str:
        return self.sections.get("source", "")

    @property
    def shapes(self) -> str:
        return self.sections.get("shapes", "")

    @property
    def off(self) -> bool:
        return self.facts.off

    def flag(self, fact: str, values: dict[str, Any]) -> bool:
        """A flag fact for these parameter values (a flag may name the bool parameter that decides)."""
        if self.facts.off:
            return False
        v = getattr(self.facts, fact)
        return bool(values.get(v, self.params[v].default)) if isinstance(v, str) else bool(v)

    def stage(self, values: dict[str, Any]) -> str:
        """Where the component acts with these values: its slot's stage unless a parameter moves it."""
        for k, p in self.params.items():
            if p.stages:
                return p.stages[values.get(k, p.default)]
        return SLOTS[self.slot].stage

    def example(self) -> str:
        """How a spec writes it with its defaults, e.g. ``value(clip=0.5)``."""
        args = [f"{k}={'...' if p.required else format_value(p.default)}"
                for k, p in self.params.items() if not p.runtime and p.default is not None]
        return self.name + (f"({', '.join(args)})" if args else "")

    def fn_params(self, values: dict[str, Any]) -> dict[str, Any]:
        """The parameters passed to the component function (runtime ones left out)."""
        return {k: v for k, v in values.items() if not self.params[k].runtime}

    def given(self, values: dict[str, Any]) -> "Component":
        """The component with these parameter values: the inputs of its parameters' ``needs`` join
        its facts' for each parameter given, and a ``field`` parameter given (``group_by``) turns
        ``per_group`` off (it no longer compares a prompt's group)."""
        extra = tuple(x for k, p in self.params.items() if values.get(k) is not None for x in p.needs)
        regrouped = any(p.kind == "field" and values.get(k) is not None for k, p in self.params.items())
        return self if not extra and not regrouped else _given(self, extra, regrouped)

    def formula_with(self, values: dict[str, Any]) -> str:
        """The formula with parameter values substituted for ``{name}`` placeholders."""
        def sub(m: re.Match[str]) -> str:
            v = values.get(m.group(1))
            return format_value(v) if v is not None else m.group(0)
        return re.sub(r"\{(\w+)\}", sub, self.formula)


_GIVEN: dict[tuple[str, str, tuple[str, ...], bool], Component] = {}


def _given(comp: Component, extra: tuple[str, ...], regrouped: bool) -> Component:
    key = (comp.slot, comp.name, extra, regrouped)
    if key not in _GIVEN:
        facts = replace(comp.facts, needs=tuple(dict.fromkeys(comp.facts.needs + extra)),
                        per_group=False if regrouped else comp.facts.per_group)
        _GIVEN[key] = replace(comp, facts=facts)
    return _GIVEN[key]


_SECTION = re.compile(r"^\s*(formula|source|shapes|edge cases):\s*(.*)$")


def parse_docstring(doc: str) -> dict[str, str]:
    """Sections ``formula:``, ``source:``, ``shapes:``, ``edge cases:`` (continuation lines indented)."""
    out: dict[str, str] = {}
    key = None
    for line in inspect.cleandoc(doc or "").splitlines():
        m = _SECTION.match(line)
        if m:
            key = m.group(1)
            out[key] = m.group(2).strip()
        elif key and line.startswith("  ") and line.strip():
            out[key] += "\n" + line.strip()
        else:
            key = None
    return out


REGISTRY: dict[str, dict[str, Component]] = {name: {} for name in SLOTS}


def _split(where: str, kw: dict[str, Any]) -> tuple[dict[str, Param], dict[str, Any]]:
    """register()/declare() keywords -> (parameters, facts): a Param is a parameter, the rest facts."""
    params = {k: v for k, v in kw.items() if isinstance(v, Param)}
    facts = {k: v for k, v in kw.items() if not isinstance(v, Param)}
    unknown = [k for k in facts if k not in FACTS]
    if unknown:
        raise TypeError(f"{where}: unknown fact {unknown[0]!r}; a parameter is a Param (Float(...), "
                        f"Int, Bool, Choice) and the facts are: {', '.join(FACTS)}")
    clash = [k for k in params if k in FACTS]
    if clash:
        raise ValueError(f"{where}: parameter name {clash[0]!r} is the name of a fact")
    for k in ("needs", "provides", "requires"):
        if k in facts and isinstance(facts[k], (str, Requires)):
            facts[k] = (facts[k],)
        elif k in facts:
            facts[k] = tuple(facts[k])
    return params, facts


def _check_facts(slot: Slot, where: str, params: dict[str, Param], given: dict[str, Any]) -> Facts:
    facts = Facts(**given)
    for k, p in params.items():
        for x in p.needs:
            if x not in INPUTS:
                raise ValueError(f"{where}: parameter {k!r} needs {x!r}, which is not an input")
    for k in ("needs", "provides"):
        for x in getattr(facts, k):
            if x not in INPUTS:
                raise ValueError(f"{where}: {k} {x!r} is not an input; inputs: {', '.join(INPUTS)}")
    for k in _FLAGS:
        v = getattr(facts, k)
        if isinstance(v, str):
            if v not in params or params[v].kind != "bool":
                raise ValueError(f"{where}: {k}={v!r} must be True, False or the name of a bool parameter")
        elif not isinstance(v, bool):
            raise ValueError(f"{where}: {k} must be True, False or the name of a bool parameter")
    if not isinstance(facts.off, bool):
        raise ValueError(f"{where}: off must be True or False")
    for r in facts.requires:
        if not isinstance(r, Requires) or r.slot not in SLOTS:
            raise ValueError(f"{where}: requires takes Requires(slot, component, why) with a known slot")
    for f, p in facts.plan.items():
        if f not in PLAN or p not in params:
            raise ValueError(f"{where}: plan maps a field of CompiledAlgorithm.data ({', '.join(PLAN)}) "
                             f"to one of its parameters; got {f!r}: {p!r}")
    for r, p in facts.roles.items():
        if r not in ROLES or p not in params or params[p].kind not in ("float", "int"):
            raise ValueError(f"{where}: roles maps a role ({', '.join(ROLES)}) to one of its numeric "
                             f"parameters; got {r!r}: {p!r}")
    missing = [f for f in slot.declares if f not in given]
    if missing and not facts.off:
        raise ValueError(f"{where}: every {slot.name} component declares {', '.join(missing)} "
                         f"(e.g. register({slot.name!r}, {missing[0]}=True|False)); see Facts")
    for k, p in params.items():
        if p.stages is not None and (set(p.stages) != set(p.choices) or
                                     not set(p.stages.values()) <= set(STAGES)):
            raise ValueError(f"{where}: parameter {k!r}: stages maps each choice to one of {STAGES}")
    return facts


def _check_signature(slot: Slot, where: str, fn: Callable, params: dict[str, Param],
                     needs: tuple[str, ...] = ()) -> None:
    """The function takes the slot's arguments first (same names, same order), then exactly
    its non-runtime parameters by keyword (and, in a ``keyword_inputs`` slot, the ``arg`` of
    each input it needs)."""
    assert slot.args is not None
    ps = list(inspect.signature(fn).parameters.values())
    got = [p.name for p in ps]
    n = len(slot.args)
    call = f"slot {slot.name} calls every component as {slot.signature}"
    if tuple(got[:n]) != slot.args or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ps):
        raise ValueError(f"{where}: the function takes ({', '.join(got)}) but {call}; its first "
                         f"arguments must be ({', '.join(slot.args)}), in this order")
    rest = got[n:]
    want = [k for k, p in params.items() if not p.runtime]
    if slot.keyword_inputs:
        want += [INPUTS[x].arg for x in needs if x in INPUTS]
    if set(rest) != set(want) or any(p.kind is p.POSITIONAL_ONLY for p in ps[n:]):
        extra = [k for k in rest if k not in want]
        lacking = [k for k in want if k not in rest]
        what = []
        if lacking:
            what.append("it lacks the declared parameter(s) " + ", ".join(lacking))
        if extra:
            what.append("it takes " + ", ".join(extra) + ", which register() does not declare" +
                        (" (runtime parameters are not passed)" if any(k in params for k in extra) else ""))
        raise ValueError(f"{where}: after ({', '.join(slot.args)}) the function takes exactly its "
                         f"parameters; {'; '.join(what) or 'a parameter is positional-only'}")


def _add(slot: str, key: str, fn: Callable | None, doc: str, kw: dict[str, Any]) -> Component:
    where = f"component {slot}.{key}"
    if key in REGISTRY[slot]:
        raise ValueError(f"{where} is registered twice")
    params, given = _split(where, kw)
    for name, p in params.items():
        if p.when is not None and (p.when[0] not in params or params[p.when[0]].check(p.when[1])):
            raise ValueError(f"{where}: parameter {name} is read when {p.when[0]}={p.when[1]!r}, "
                             "which is not a value of a parameter of the component")
    s = SLOTS[slot]
    if fn is not None:
        if s.args is None:
            raise ValueError(f"{where}: slot {slot} has no function (stage {s.stage}); use declare()")
        _check_signature(s, where, fn, params, tuple(given.get("needs", ())))
    facts = _check_facts(s, where, params, given)
    sections = parse_docstring(doc)
    if "formula" not in sections or "source" not in sections:
        raise ValueError(f"{where} needs 'formula:' and 'source:' in its docstring")
    comp = Component(slot, key, fn, params, doc, sections, facts, frozenset(given))
    REGISTRY[slot][key] = comp
    return comp


def register(slot: str, name: str | None = None, **kw: Any) -> Callable[[Callable], Callable]:
    """Register a component function under ``(slot, name)``; the function name is the DSL name.

    Keywords that are :class:`Param` s are its parameters, the others its :class:`Facts`.
    Refuses a name registered twice, a docstring without a formula and a source, a
    function whose arguments differ from the slot signature plus its parameters, and facts
    that are unknown, malformed or missing where the slot requires them.
    """
    if slot not in SLOTS:
        raise KeyError(f"unknown slot {slot!r}")

    def deco(fn: Callable) -> Callable:
        _add(slot, name or fn.__name__.rstrip("_"), fn, inspect.getdoc(fn) or "", kw)
        return fn

    return deco


def declare(slot: str, name: str, doc: str, **kw: Any) -> None:
    """Register a component that has no tensor function (``data``/``declare`` slots)."""
    if slot not in SLOTS:
        raise KeyError(f"unknown slot {slot!r}")
    _add(slot, name, None, inspect.cleandoc(doc), kw)


def get(slot: str, name: str) -> Component:
    """The component, or a KeyError listing the valid names."""
    try:
        return REGISTRY[slot][name]
    except KeyError:
        raise KeyError(f"unknown {slot} {name!r}; valid: {', '.join(sorted(REGISTRY[slot]))}") from None


def namespaces() -> dict[str, types.SimpleNamespace]:
    """One namespace per slot holding its component functions (what generated code calls)."""
    return {slot: types.SimpleNamespace(**{n: c.fn for n, c in comps.items() if c.fn is not None})
            for slot, comps in REGISTRY.items()}

