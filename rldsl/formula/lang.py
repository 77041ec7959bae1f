"""The closed tables of the formula language: what each slot's formula reads and binds, and
the functions it may call. The checker, the code emitter and docs/formulas.md follow them.

Shapes are ranks: 0 = [] (one number), 1 = [B] (one value per sequence), 2 = [B, T] (one
value per token), 3 = [B, T, K] (one value per top-K candidate token of each position: the
policy's top-K inputs). A lower rank is broadcast up where a higher one is needed ([B] -> [B, T]
repeats a sequence's value on its tokens, [B, T] -> [B, T, K] a token's value on its K
candidates); a higher rank where a lower one is needed is an error: reduce first (seq_mean,
group_mean, batch_mean, ...; k_sum, k_max, ... over the K axis). A [B] value never meets a
[B, T, K] one directly (the checker says why: :data:`SKIPS_AXIS`).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import inputs as table

SHAPES = {0: "[]", 1: "[B]", 2: "[B, T]", 3: "[B, T, K]"}
#: the rank of the top-K axis's values, and what a [B] value meeting one is told
TOPK_RANK = 3
SKIPS_AXIS = ("a sequence's value [B] meets a top-K value [B, T, K]: spread it on the tokens first "
              "(e.g. x * mask is [B, T]) or reduce the K axis first (k_sum, k_mean, k_max, k_min)")


@dataclass(frozen=True)
class Input:
    """A value a formula reads. ``code`` is what it is called in the generated function."""

    name: str
    rank: int
    doc: str
    loss: str | None = None       # its code in loss(); None: not there
    advantage: str | None = None  # its code in advantages(); None: not there


# The values the generated code computes (or always has) where formulas run; the optional
# inputs of estimate()/loss() a formula may read come from the inputs table (below).
_COMPUTED = [
    Input("rho", 2, "importance ratio pi / pi_old (after the ratio slot). Under the default `ratio "
                    "token(clamp=20)` it is `exp(clamp(logp - old_logp, -20, 20))`: the log-ratio is clamped "
                    "at ±20 (`clamp=`; a large value turns it off). A formula that needs the unclamped ratio "
                    "writes `exp(logp - old_logp)`; `rldsl check` notes the clamp when a formula reads `rho` "
                    "under it", loss="rho"),
    Input("w", 2, "the trust region's weight", loss="w"),
    Input("A", 2, "advantage (0 on padding)", loss="adv", advantage="adv"),
    Input("logp", 2, "log pi(o_t) of the current policy (carries the gradient)", loss="logp"),
    Input("old_logp", 2, "log pi_old(o_t) at rollout time (advantage stage: estimate()'s old_logprobs)",
          loss="old_logp", advantage="old_logp"),
    Input("old_seq_logp", 1, "log pi_old of each whole response: sum_t mask old_logp (advantage stage)",
          advantage="fx.seq_sum(old_logp, mask)"),
    Input("rollout_seq_logp", 1, "the engine's log-probability of each whole response: sum_t mask "
                                 "rollout_logp (advantage stage)", advantage="fx.seq_sum(rollout_logp, mask)"),
    Input("mask", 2, "response mask: 1 on generated tokens, 0 on padding", loss="mask", advantage="mask"),
    Input("r", 1, "sequence reward (after shaping)", advantage="r"),
    Input("L", 1, "response length: sum_t mask", loss="mask.sum(-1)", advantage="mask.sum(-1)"),
    Input("G", 0, "group size (samples per prompt)", loss="group_size", advantage="group_size"),
    Input("B", 0, "rows in the batch", loss="fx.size(mask, 0)", advantage="fx.size(mask, 0)"),
    Input("T", 0, "padded response length", loss="fx.size(mask, 1)", advantage="fx.size(mask, 1)"),
]


def _from_table(i: table.Input) -> Input:
    """An optional input (rldsl/inputs.py) as a formula reads it: under its ``formula`` name, as
    its generated-code argument in each stage whose function has it when read."""
    def code(stage: str) -> str | None:
        return i.arg if stage in i.always or stage in i.stages else None
    return Input(i.formula or "", i.rank, i.meaning, loss=code("loss"), advantage=code("advantage"))


INPUTS: dict[str, Input] = {i.name: i for i in _COMPUTED + [
    _from_table(t) for t in table.INPUTS.values() if t.formula is not None]}


@dataclass(frozen=True)
class Output:
    """A name a slot's formula must bind, its kind and highest rank, and the statement of the
    generated code that receives it (``{x}``: its value, broadcast to ``rank`` unless the
    statement broadcasts it itself)."""

    name: str
    kind: str   # "num" | "bool"
    rank: int
    statement: str
    doc: str


@dataclass(frozen=True)
class FormulaSlot:
    """How a formula fills a slot."""

    slot: str
    stage: str                       # "loss" (compiled) | "advantage" (eager) | "group" (one group's rows)
    prefix: str                      # of the generated variables: tr_1, tr_2, ...
    inputs: tuple[str, ...]
    outputs: tuple[Output, ...]      # all of them must be bound ...
    one_of: bool = False             # ... or exactly one of them (baseline: b or A)
    extra: str = ""                  # a statement after the outputs
    extra_reading_values: str = ""   # ... instead, when the formula reads the critic's values V
    params: tuple[str, ...] = ()     # parameters the slot itself needs (kl: beta)
    makes_ratio: bool = False        # it computes rho or w (reading them does not make the loss need them)
    plain_scope: str = ""            # the scope a plain sum/mean/std/max/min(x) reduces over ("": none)


_LOSS_COMMON = ("mask", "L", "G", "B", "T")
_ADV_COMMON = ("r", "mask", "L", "G", "B", "T", "old_logp", "old_seq_logp", "rollout_seq_logp")
#: advantage-stage names that read an optional input of estimate() (a formula reading one needs it)
ADVANTAGE_NEEDS = {"old_logp": "old_logprobs", "old_seq_logp": "old_logprobs",
                   "rollout_seq_logp": "rollout_logprobs"}


def _reads(slot: str, computed: tuple[str, ...]) -> tuple[str, ...]:
    """What a formula in ``slot`` may read: the computed values the slot receives, then the
    optional inputs the inputs table says it receives (``Input.slots``)."""
    return computed + tuple(i.formula for i in table.readable(slot) if i.formula is not None)


SLOTS: dict[str, FormulaSlot] = {s.slot: s for s in [
    FormulaSlot("shaping", "advantage", "sh", _reads("shaping", _ADV_COMMON),
                (Output("r", "num", 1, "r = {x}", "the shaped reward [B]"),)),
    FormulaSlot("baseline", "advantage", "bl", _reads("baseline", _ADV_COMMON),
                (Output("b", "num", 1, "adv = fx.spread(r - {x}, mask) * mask", "baseline b [B]: A = r - b"),
                 Output("A", "num", 2, "adv = fx.spread({x}, mask) * mask", "the advantage itself")),
                one_of=True, extra="returns = adv", extra_reading_values="returns = (adv + values) * mask"),
    FormulaSlot("normalizer", "advantage", "no", _reads("normalizer", ("A",) + _ADV_COMMON),
                (Output("A", "num", 2, "adv = {x}", "the scaled advantage"),)),
    FormulaSlot("filter", "advantage", "fi", _reads("filter", _ADV_COMMON),
                (Output("keep", "bool", 1, "keep = keep * {x}", "true: the sample stays in the loss"),)),
    FormulaSlot("ratio", "loss", "ra", _reads("ratio", ("logp", "old_logp", "A") + _LOSS_COMMON),
                (Output("log_rho", "num", 2, "log_ratio = {x}", "log of the importance ratio"),),
                makes_ratio=True),
    FormulaSlot("trust_region", "loss", "tr", _reads("trust_region", ("rho", "A", "logp", "old_logp") + _LOSS_COMMON),
                (Output("w", "num", 2, "w = {x}", "the weight the objective uses"),), makes_ratio=True),
    FormulaSlot("objective", "loss", "ob", _reads("objective", ("w", "rho", "A", "logp", "old_logp") + _LOSS_COMMON),
                (Output("l", "num", 2, "pg = {x}", "the per-token loss to minimise"),)),
    FormulaSlot("kl", "loss", "kl", _reads("kl", ("logp", "old_logp", "rho") + _LOSS_COMMON),
                (Output("kl", "num", 2, "kl_t = {x}", "the per-token KL estimate"),),
                params=("beta",)),
    FormulaSlot("selection", "loss", "se",
                _reads("selection", ("A", "logp", "old_logp", "rho", "w") + _LOSS_COMMON),
                (Output("keep", "bool", 2, "pg = pg * {x}",
                        "true: the token keeps its policy loss (the denominator is unchanged)"),)),
    FormulaSlot("entropy", "loss", "en", _reads("entropy", ("A", "w", "rho", "logp") + _LOSS_COMMON),
                (Output("term", "num", 2, "per_token = per_token + {x}",
                        "added to the per-token loss"),)),
    FormulaSlot("aggregation", "loss", "ag", _reads("aggregation", _LOSS_COMMON),
                (Output("weights", "num", 2, "weights = {x}", "per-token weights"),
                 Output("count", "num", 0, "count = {x}", "the denominator: loss = sum(l * weights) / count"))),
]}


# Formulas that are a component's argument rather than a slot's component: a quoted one-line
# expression, checked like a slot's formula (its spans inside the string) and evaluated on the
# rows of one prompt group at a time. In it B is the group's samples, so one number per group is
# [], and the plain reductions sum, mean, std, max, min (x) reduce the group's rows
# (batch_sum, ... of the group).
ARGUMENTS: dict[str, FormulaSlot] = {s.slot: s for s in [
    FormulaSlot("priority", "group", "pr", _reads("priority", ("r",)),
                (Output("priority", "num", 0, "priority = {x}", "the group's priority: one number per group"),),
                plain_scope="batch"),
]}
#: the scopes of the functions an argument formula may call (its rows are one group: no tokens)
ARGUMENT_SCOPES = ("", "batch")


def formula_slot(name: str) -> FormulaSlot | None:
    """The formula slot ``name``: a slot of :data:`SLOTS` or an argument of :data:`ARGUMENTS`."""
    return SLOTS.get(name) or ARGUMENTS.get(name)


# Slots a formula cannot fill, and why (the checker's message says it).
NOT_FORMULAS: dict[str, str] = {
    "rewards": "it declares what the verifier returns; it computes nothing",
    "sampling": "the runtime carries it out; it computes nothing",
    "correction": "its rejections also run in estimate() through the component's own function, "
                  "and it reports its own metrics",
    "critic": "a critic brings a value model, which a formula cannot",
    "distill": "its components read the teacher's top-k and vocabulary-wide divergence and carry the "
               "parameters that place it in the loss; a formula reads the teacher's logprobs as "
               "teacher_logp in the objective, kl, ratio, trust_region and selection slots instead",
    "router": "its one term is the routers' load-balancing loss the trainer's forward makes (a coefficient "
              "times router_aux); a formula has nothing else to compute from",
}


# ---------------------------------------------------------------------------------------
# Functions


@dataclass(frozen=True)
class Function:
    """A function of the closed table. ``kind``: how the checker types it and the emitter writes it.

    elementwise — number -> number, same shape (``torch`` function ``code``)
    minmax      — min(a, b) / max(a, b), elementwise
    clamp       — clamp(x, low, high)
    where       — where(condition, a, b)
    sg          — stop-gradient (the value, no gradient)
    reduce      — a masked reduction over tokens (seq), a group's sequences (group) or the batch
    order       — a masked order operation (sort, rank, cumsum, topk_mask) over the same scopes;
                  it keeps its argument's shape (seq: [B, T], group: [B], batch: [B] or [B, T])
    kreduce     — a reduction over the top-K axis: [B, T, K] -> [B, T] (every candidate counts; no mask:
                  the K axis has no padding)
    search      — a bounded search (bisect, first_of): the whole right side of a binding, whose
                  name(s) are the searched variable(s), visible in its condition (SEARCHES)
    """

    name: str
    kind: str
    arity: tuple[int, ...]
    doc: str
    code: str = ""
    scope: str = ""   # reductions: "seq" | "group" | "batch"


_ELEMENTWISE = {"exp": "torch.exp", "log": "torch.log", "sigmoid": "torch.sigmoid", "tanh": "torch.tanh",
                "abs": "torch.abs", "sqrt": "torch.sqrt", "sign": "torch.sign"}
REDUCTIONS = ("sum", "mean", "std", "max", "min", "quantile")
SCOPES = {"seq": "over each sequence's tokens: [B, T] -> [B]",
          "group": "over the sequences of each prompt's group: [B] -> [B] (every member gets it)",
          "batch": "over the batch: [B] -> [] (rows), [B, T] -> [] (tokens)"}
# order operations: name -> (arity, what it gives at a valid entry i). Entries are taken in
# their scope's order: a sequence's tokens by position, a group's rows by row, the batch's rows
# by row ([B]) or its tokens row by row ([B, T]); padding (mask 0, a row without a real reward /
# without tokens) never takes part.
ORDER = {
    "sort": (1, "x's valid entries sorted ascending, the i-th smallest at the i-th valid entry; "
                "0 on padding"),
    "rank": (1, "#{j valid: x_j < x_i, or x_j = x_i and j before i}: 0 = smallest, ties broken by "
                "position (stable); 0 on padding"),
    "cumsum": (1, "sum of x_j over the valid entries j up to and including i; 0 on padding"),
    "topk_mask": (2, "rank(-x) < k: the k largest valid entries (ties: the earlier one), k [] any "
                     "number expression; false on padding"),
}
ORDER_SCOPES = {"seq": "over each sequence's tokens: [B, T] -> [B, T]",
                "group": "over the sequences of each prompt's group: [B] -> [B]",
                "batch": "over the batch: [B] -> [B] (rows), [B, T] -> [B, T] (tokens)"}

# bounded searches: name -> (arity, what the binding `x = name(...)` gets). The binding's name is
# the searched variable: inside the condition it is the value tried, after the line the one found.
# Every search runs a fixed number of steps (a constant): compiled to a loop over a constant.
MAX_STEPS = 64
SEARCHES = {
    "bisect": (4, "x = bisect(lo, hi, steps, cond): the bracket [a, b] = [lo, hi] halved `steps` times "
                  "(m = (a + b) / 2; b = m where cond holds at x = m, else a = m), then b: the smallest x "
                  "in (lo, hi] where a condition false below a threshold holds, to (hi - lo) / 2^steps; hi "
                  "when it holds nowhere. lo, hi, cond []; steps a constant whole number 1..64; no gradient"),
    "first_of": (2, "x = first_of([c1, c2, ...], cond): the first candidate c_i at which cond holds, the "
                    "last when none does; `a, b = first_of([(a1, b1), (a2, b2), ...], cond)` searches pairs "
                    "(any width). Candidates and cond [] (1..64 candidates); no gradient"),
}

FUNCTIONS: dict[str, Function] = {}
for _n, _c in _ELEMENTWISE.items():
    FUNCTIONS[_n] = Function(_n, "elementwise", (1,), f"{_n}(x), elementwise", _c)
FUNCTIONS["lgamma"] = Function(
    "lgamma", "elementwise", (1,),
    "lgamma(x) = log |Gamma(x)|, elementwise (lgamma(n + 1) = log n!). Computed in float64, its "
    "argument too, and what follows it in the formula stays float64 until the slot's outputs "
    "return to the stage's dtype: a difference of lgammas (a log-Beta, a log-binomial) keeps its "
    "digits", "torch.lgamma")
FUNCTIONS["min"] = Function("min", "minmax", (2,), "min(a, b), elementwise", "min")
FUNCTIONS["max"] = Function("max", "minmax", (2,), "max(a, b), elementwise", "max")
FUNCTIONS["clamp"] = Function("clamp", "clamp", (3,), "clamp(x, low, high) = min(max(x, low), high)")
FUNCTIONS["where"] = Function("where", "where", (3,), "where(condition, a, b): a where the condition holds, else b")
FUNCTIONS["sg"] = Function("sg", "sg", (1,), "stop-gradient: the value of x, no gradient through it")
for _s in SCOPES:
    for _r in REDUCTIONS:
        _n = f"{_s}_{_r}"
        FUNCTIONS[_n] = Function(_n, "reduce", (2,) if _r == "quantile" else (1,),
                                 f"{_n}(x{', q' if _r == 'quantile' else ''}): masked {_r} {SCOPES[_s]}",
                                 f"fx.{_n}", _s)
for _s in ORDER_SCOPES:
    for _r, (_k, _doc) in ORDER.items():
        _n = f"{_s}_{_r}"
        FUNCTIONS[_n] = Function(_n, "order", (_k,), f"{_n}(x{', k' if _k == 2 else ''}): {_doc}; "
                                 f"{ORDER_SCOPES[_s]}", f"fx.{_n}", _s)

for _n, (_k, _doc) in SEARCHES.items():
    FUNCTIONS[_n] = Function(_n, "search", (_k,), _doc, f"fx.{_n}")

#: the reductions over the top-K axis of the policy's top-K inputs ([B, T, K] -> [B, T])
K_REDUCTIONS = {"sum": "sum over the K candidates", "mean": "mean over the K candidates",
                "max": "largest of the K candidates", "min": "smallest of the K candidates"}
for _r, _doc in K_REDUCTIONS.items():
    FUNCTIONS[f"k_{_r}"] = Function(f"k_{_r}", "kreduce", (1,), f"k_{_r}(x): {_doc}: [B, T, K] -> [B, T]",
                                    f"fx.k_{_r}", "k")



def function_list() -> str:
    """Every function of the table in one line, for the unknown-function help: the plain ones by
    name, the scoped families as ``seq_/group_/batch_ + ...``. Built from :data:`FUNCTIONS`, so a
    function added to the table is listed without another edit."""
    plain = [f.name for f in FUNCTIONS.values() if not f.scope]
    scopes: dict[str, list[str]] = {}  # kind -> its scopes, in table order
    names: dict[str, list[str]] = {}   # kind -> the names after the scope
    for f in FUNCTIONS.values():
        if f.scope:
            scopes.setdefault(f.kind, [])
            names.setdefault(f.kind, [])
            for seq, item in ((scopes[f.kind], f.scope), (names[f.kind], f.name[len(f.scope) + 1:])):
                if item not in seq:
                    seq.append(item)
    words = {"reduce": "the masked reductions", "order": "the order operations",
             "kreduce": "the reductions over the top-K axis"}
    parts = [f"{words.get(k, k)} {'/'.join(s + '_' for s in scopes[k])} + {', '.join(names[k])}" for k in names]
    return ", ".join(plain) + "; " + "; ".join(parts)


# names that are not functions but look like one: the advice to give instead of "unknown"
ALIASES = {"bisection": "bisect", "binary_search": "bisect", "first": "first_of", "find": "first_of",
           "stop_gradient": "sg", "detach": "sg", "stopgrad": "sg", "clip": "clamp", "minimum": "min",
           "maximum": "max", "sgn": "sign", "ln": "log", "exp2": None, "pow": None}
UNSCOPED = set(REDUCTIONS) | {"avg", "var", "median", "count"}
UNSCOPED_ORDER = set(ORDER) | {"argsort", "topk", "cumulative_sum", "sorted", "order"}


# ---------------------------------------------------------------------------------------
# The tables of docs/formulas.md (a test checks the document holds them as printed here)


def slot_table() -> str:
    """Markdown: per slot, where it runs, what its formula reads and what it must bind."""
    rows = ["| slot | runs in | reads | binds |", "|---|---|---|---|"]
    for s, fs in SLOTS.items():
        outs = (" or " if fs.one_of else ", ").join(
            f"`{o.name}` {SHAPES[o.rank]}" + (" true/false" if o.kind == "bool" else "") for o in fs.outputs)
        extra = "; parameter `beta` (its coefficient)" if fs.params else ""
        rows.append(f"| {s} | {fs.stage}() | {', '.join(fs.inputs)} | {outs}{extra} |")
    return "\n".join(rows)


def input_table() -> str:
    """Markdown: every input name, its shape and meaning."""
    rows = ["| name | shape | meaning |", "|---|---|---|"]
    rows += [f"| `{i.name}` | {SHAPES[i.rank]} | {i.doc} |" for i in INPUTS.values()]
    return "\n".join(rows)


def function_table() -> str:
    """Markdown: the closed set of functions."""
    rows = ["| function | meaning |", "|---|---|"]
    rows += [f"| `{f.name}` | {f.doc} |" for f in FUNCTIONS.values() if f.kind not in ("reduce", "order", "search")]
    for scope, doc in SCOPES.items():
        names = ", ".join(f"`{scope}_{r}`" + ("(x, q)" if r == "quantile" else "") for r in REDUCTIONS)
        rows.append(f"| {names} | masked, {doc} |")
    for scope, doc in ORDER_SCOPES.items():
        names = ", ".join(f"`{scope}_{r}`" + ("(x, k)" if k == 2 else "") for r, (k, _) in ORDER.items())
        rows.append(f"| {names} | masked order operations, {doc} (table below) |")
    rows += [f"| `{n}` | bounded search: {doc} (Bounded searches, below) |" for n, (_, doc) in SEARCHES.items()]
    return "\n".join(rows)


def order_table() -> str:
    """Markdown: what each order operation computes (the same in every scope)."""
    rows = ["| operation | value at a valid entry i |", "|---|---|"]
    rows += [f"| `*_{r}`" + ("(x, k)" if k == 2 else "(x)") + f" | {doc} |" for r, (k, doc) in ORDER.items()]
    return "\n".join(rows)
