"""Checked formula -> lines of torch code for the generated ``loss()`` / ``advantages()``.

The code is built from the typed tree only: every identifier comes from a closed table
(``torch.*`` functions, the ``fx.*`` masked reductions, the slot inputs' names in the
generated function, and variables numbered ``<prefix>_<n>``); every number is a checked
float printed by ``repr``. Names written in the spec appear only in the comments, which are
rendered from the tree. One line per binding, each with its formula and shape:

    # trust_region sapo_gate  spec line 9 (formula: tau_pos=1.0, tau_neg=1.05)
    tr_1 = torch.where(adv > 0.0, fx.scalar(1.0, mask), 1.05)  # tau = where(A > 0, tau_pos, tau_neg)  [B, T]
    w = torch.sigmoid(tr_1 * (rho - 1.0)) * 4.0 / tr_1  # w = sigmoid(tau * (rho - 1)) * 4 / tau  [B, T]

[B] values meet [B, T] ones through ``.unsqueeze(-1)`` (a sequence's value on each token), and
[B, T] values meet [B, T, K] ones (the policy's top-K) the same way (a token's value on each
of its K candidates); the checker lets only such neighbours meet.
"""
from __future__ import annotations

import re

from .. import inputs as table
from ..generated import literal
from . import lang
from .check import Formula, Typed
from .render import binding as render_binding
from .render import number

_ATOM, _POW, _NEG, _MUL, _ADD, _CMP = 6, 5, 4, 3, 2, 1
_OP_PREC = {"+": _ADD, "-": _ADD, "*": _MUL, "/": _MUL, "^": _POW,
            "<": _CMP, "<=": _CMP, ">": _CMP, ">=": _CMP, "==": _CMP, "!=": _CMP}

# every identifier the emitter itself writes (the injection tests check generated code against it)
CODE_WORDS = frozenset({"torch", "fx", "where", "clamp", "minimum", "maximum", "min", "max", "detach",
                        "unsqueeze", "sum", "to", "dtype", "double", "shape", "mask", "batch", "valid_rows",
                        "group_size", "spread", "scalar", "size", "keep", "per_token", "returns", "adv", "r", "values",
                        "w", "rho", "logp", "old_logp", "ref_logp", "rollout_logp", "ent", "log_ratio", "pg", "kl_t",
                        "weights", "count", "formula", "lambda"}
                       | {f.code.split(".")[-1] for f in lang.FUNCTIONS.values() if f.code})
# words of the comments the emitter writes itself (besides the formula, rendered from the tree)
COMMENT_WORDS = frozenset({"rows", "with", "tokens", "a", "real", "reward", "formula", "B", "T"}
                          | set(lang.FUNCTIONS) | set(lang.INPUTS))
_GENERATED = re.compile(r"^(?:sh\d*|bl|no|fi\d*|ra|tr|ob|kl|se\d*|en|ag)_(?:\d+|rows|L|G|B|T)$")


# functions computed in float64 (with their arguments): float32 loses the digits of their differences
_FLOAT64 = frozenset({"lgamma"})


def is_generated_name(name: str) -> bool:
    """A variable the emitter numbers (``tr_1``, ``ag_rows``, ...)."""
    return bool(_GENERATED.match(name))


def _literal(x: float | bool) -> str:
    """A checked constant: True/False, or a float (formulas fold every number as a float)."""
    return literal(x if isinstance(x, bool) else float(x))


class _Emitter:
    def __init__(self, f: Formula, prefix: str):
        self.f = f
        self.spec = f.spec
        self.prefix = prefix
        self.stage = self.spec.stage
        self.vars: dict[str, str] = {}
        self.prelude: dict[str, str] = {}  # var -> line, in first-use order
        self.wide = 0  # > 0: inside an lgamma's argument, every tensor read is made float64
        # a formula with an lgamma computes in float64 from there on; its outputs return to the stage's dtype
        self.float64 = any(t.op == "call" and t.name in _FLOAT64 for name in f.order for t in _walk(f.typed[name]))

    def _pre(self, key: str, code: str, comment: str) -> str:
        var = f"{self.prefix}_{key}"
        if var not in self.prelude:
            self.prelude[var] = f"{var} = {code}  # {comment}"
        return var

    def rows(self) -> str:
        if self.stage == "loss":
            return self._pre("rows", "(mask.sum(-1) > 0).to(mask.dtype)", "rows with tokens  [B]")
        if self.stage == "group":  # the group's rows: those with a scorable reward, every one
            return "mask"
        return self._pre("rows", "batch.valid_rows.to(mask.dtype)", "rows with a real reward  [B]")

    def input(self, name: str) -> str:
        inp = lang.INPUTS[name]
        # a group formula's function takes each input under its formula name (group_function_source)
        code = inp.loss if self.stage == "loss" else name if self.stage == "group" else inp.advantage
        assert code is not None, (name, self.stage)
        if name == "L":
            return self._pre("L", code, "L  [B]")
        if inp.rank == 0:
            return self._pre(name, code if code.startswith("fx.") else f"fx.scalar({code}, mask)", f"{name}  []")
        return code

    # -- expressions ------------------------------------------------------------------

    def code(self, t: Typed) -> tuple[str, int]:
        if t.const is not None:
            text = _literal(t.const)
            return text, (_NEG if text.startswith("-") else _ATOM)
        if t.op == "input":
            return self._wide(self.input(t.name)), _ATOM
        if t.op == "ref":
            return self._wide(self.vars[t.name]), _ATOM
        if t.op == "bound":
            return self.vars[t.name], _ATOM
        if t.op == "neg":
            x, p = self.code(t.args[0])
            return "-" + (x if p >= _NEG else f"({x})"), _NEG
        if t.op == "operator":
            return self.binary(t)
        return self.call(t)

    def aligned(self, t: Typed, rank: int) -> tuple[str, int]:
        """``t``'s code, unsqueezed when a [B] value meets a [B, T] one or a [B, T] value a
        [B, T, K] one (one axis up: the checker refuses [B] against [B, T, K])."""
        x, p = self.code(t)
        if t.const is None and t.rank >= 1 and rank == t.rank + 1:
            return (x if p == _ATOM else f"({x})") + ".unsqueeze(-1)", _ATOM
        return x, p

    def _wide(self, code: str) -> str:
        """A tensor read inside an lgamma's argument, as float64."""
        return f"{code}.double()" if self.wide else code

    def binary(self, t: Typed) -> tuple[str, int]:
        a, b = t.args
        p = _OP_PREC[t.name]
        x, xp = self.aligned(a, t.rank)
        y, yp = self.aligned(b, t.rank)
        op = "**" if t.name == "^" else t.name
        if t.name == "^":
            x = x if xp > p else f"({x})"
            y = y if yp >= _NEG else f"({y})"
        else:
            x = x if xp >= p else f"({x})"
            y = y if yp > p else f"({y})"
        return f"{x} {op} {y}", p

    def call(self, t: Typed) -> tuple[str, int]:
        f = lang.FUNCTIONS[t.name]
        args = t.args
        if f.kind == "elementwise":
            self.wide += f.name in _FLOAT64
            try:
                return f"{f.code}({self.code(args[0])[0]})", _ATOM
            finally:
                self.wide -= f.name in _FLOAT64
        if f.kind == "sg":
            x, p = self.code(args[0])
            return (x if p == _ATOM else f"({x})") + ".detach()", _ATOM
        if f.kind == "kreduce":  # over the K axis: nothing to mask
            return f"{f.code}({self.code(args[0])[0]})", _ATOM
        if f.kind == "minmax":
            return self.minmax(f.name, self.part(args[0]), self.part(args[1]), t.rank)[0], _ATOM
        if f.kind == "clamp":
            x, lo, hi = (self.part(a) for a in args)
            if lo[2] is not None and hi[2] is not None:
                return f"torch.clamp({x[0]}, min={_literal(lo[2])}, max={_literal(hi[2])})", _ATOM
            return self.minmax("min", self.minmax("max", x, lo, t.rank), hi, t.rank)[0], _ATOM
        if f.kind == "where":
            c, a, b = args
            x = self.aligned(c, t.rank)[0]
            y = self.aligned(a, t.rank)[0]
            z = self.aligned(b, t.rank)[0]
            if a.const is not None and b.const is not None:  # give the constants the stage's dtype
                y = f"fx.scalar({y}, mask)"
            return f"torch.where({x}, {y}, {z})", _ATOM
        # masked reductions and order operations (a quantile's level q, topk_mask's k: [])
        x = args[0]
        xs = self.code(x)[0]
        q = f"{self.code(args[1])[0]}, " if len(args) == 2 else ""
        # inside an lgamma's argument the result is float64 too (a constant's reduction is the stage's dtype)
        if f.scope == "seq":
            return self._wide(f"{f.code}({xs}, {q}mask)"), _ATOM
        if f.scope == "group":  # a prompt's G samples, or (group_by=FIELD) the rows with equal keys
            return self._wide(f"{f.code}({xs}, {q}{self.rows()}, {'batch.group_keys' if self.f.group_by else 'group_size'})"), _ATOM
        valid = "mask" if x.rank == 2 else self.rows()
        return self._wide(f"{f.code}({xs}, {q}{valid})"), _ATOM

    def search(self, t: Typed, names: tuple[str, ...]) -> str:
        """A search as one call: ``fx.bisect(lo, hi, steps, lambda x: cond, mask)`` or
        ``fx.first_of((c1, c2, ...), lambda x: cond, mask)`` (tuples for several names); the
        lambda's parameters are the variables the line assigns (``self.vars``)."""
        *bounds, cond = t.args
        params = ", ".join(self.vars[n] for n in names)
        test = f"lambda {params}: {self.code(cond)[0]}"
        if t.name == "bisect":
            lo, hi, steps = bounds
            return f"fx.bisect({self.code(lo)[0]}, {self.code(hi)[0]}, {int(steps.const)}, {test}, mask)"
        width = len(names)
        items = [", ".join(self.code(c)[0] for c in bounds[i:i + width]) for i in range(0, len(bounds), width)]
        cands = ", ".join(f"({x})" for x in items) if width > 1 else ", ".join(items)
        return f"fx.first_of(({cands}{',' if len(items) == 1 else ''}), {test}, mask)"

    def part(self, t: Typed) -> tuple[str, int, float | bool | None]:
        """(code, rank, constant) of a checked expression, for min / max / clamp."""
        return self.code(t)[0], t.rank, t.const

    def minmax(self, name: str, a: tuple[str, int, float | bool | None], b: tuple[str, int, float | bool | None],
               rank: int) -> tuple[str, int, float | bool | None]:
        """min/max of two parts: folded if both are constants; a clamp against a constant (its
        gradient passes at the bound, as the registry's clamps); else torch.minimum / maximum."""
        pick = min if name == "min" else max
        if a[2] is not None and b[2] is not None:
            c = pick(float(a[2]), float(b[2]))
            return _literal(c), 0, c
        if a[2] is not None:
            a, b = b, a
        out_rank = max(a[1], b[1])
        if b[2] is not None:
            return f"torch.clamp({a[0]}, {'max' if name == 'min' else 'min'}={_literal(b[2])})", out_rank, None
        x, y = (self.unsqueezed(p[0]) if p[1] >= 1 and out_rank == p[1] + 1 else p[0] for p in (a, b))
        return f"torch.{'minimum' if name == 'min' else 'maximum'}({x}, {y})", out_rank, None

    @staticmethod
    def unsqueezed(code: str) -> str:
        return (code if re.fullmatch(r"[A-Za-z_][\w.]*", code) else f"({code})") + ".unsqueeze(-1)"

    # -- lines ------------------------------------------------------------------------

    def output_value(self, t: Typed, out: lang.Output, code: str) -> str:
        if self.float64 and t.const is None:  # back to the stage's dtype (a no-op on a float32 value)
            code = f"({code}).to(mask.dtype)" if out.kind != "bool" else code
        if "fx.spread(" in out.statement:  # the statement broadcasts itself
            return code
        if out.rank == 0:
            return code
        if out.kind == "bool" or t.const is not None or t.rank < out.rank:
            like = "mask" if out.rank == 2 else "r"
            return f"fx.spread({code}, {like})"
        return code

    def lines(self, header: str) -> list[str]:
        f = self.f
        bindings = {b.name: b for b in f.define.bindings}
        outputs = {o.name: o for o in self.spec.outputs if o.name in f.outputs}
        referenced = {a.name for name in f.order for a in _walk(f.typed[name]) if a.op == "ref"}
        body: list[str] = []
        n = 0
        for name in f.order:
            t = f.typed[name]
            comment = f"{render_binding(bindings[name])}  {lang.SHAPES[t.rank]}"
            if t.op == "search":  # one line assigns every name of the search, then the outputs among them
                names = bindings[name].names
                if name not in self.vars:
                    for other in names:
                        n += 1
                        self.vars[other] = f"{self.prefix}_{n}"
                    body.append(f"{', '.join(self.vars[o] for o in names)} = {self.search(t, names)}  # {comment}")
                if name in outputs:
                    out = outputs[name]
                    body.append(out.statement.format(x=self.output_value(t, out, self.vars[name])) +
                                f"  # {name}  {lang.SHAPES[out.rank]}")
                continue
            code = self.code(t)[0]
            if name in outputs and name not in referenced:
                out = outputs[name]
                body.append(out.statement.format(x=self.output_value(t, out, code)) + f"  # {comment}")
                continue
            n += 1
            var = f"{self.prefix}_{n}"
            self.vars[name] = var
            body.append(f"{var} = {code}  # {comment}")
            if name in outputs:
                out = outputs[name]
                body.append(out.statement.format(x=self.output_value(t, out, var)) +
                            f"  # {name}  {lang.SHAPES[out.rank]}")
        extra = self.spec.extra_reading_values if "V" in self.f.reads and self.spec.extra_reading_values \
            else self.spec.extra
        if extra:
            body.append(extra)
        return [header] + list(self.prelude.values()) + body


def _walk(t: Typed):  # noqa: ANN202
    yield t
    for a in t.args:
        yield from _walk(a)


def lines(f: Formula, where: str, prefix: str | None = None) -> list[str]:
    """The generated lines for formula ``f`` (``where``: the slot/spec-line comment of codegen)."""
    params = ", ".join([f"{k}={number(v)}" for k, v in f.params.items()]
                       + ([f"group_by={f.group_by}"] if f.group_by else []))
    header = f"# {where} (formula" + (f": {params})" if params else ")")
    return _Emitter(f, prefix or f.spec.prefix).lines(header)


# the template variable that holds each output after the formula's lines
_RESULT = {"w": "w", "l": "pg", "kl": "kl_t", "term": "per_token", "weights": "weights", "count": "count",
           "log_rho": "log_ratio", "r": "r", "b": "adv", "A": "adv", "keep": "keep"}
# ... and what a baseline formula also returns
_RETURNS = ", 'returns': returns"


def group_function_source(f: Formula) -> str:
    """``def formula(r, adv, ...)`` for a formula of one prompt group (``lang.ARGUMENTS``: the
    replay priority): its inputs by their formula names, [B] = the group's rows with a scorable
    reward (``mask``: all ones, their dtype); returns its one output, a 0-dim tensor."""
    out = f.outputs[0]
    head = f"def formula({', '.join(f.spec.inputs)}):"
    body = ["mask = torch.ones_like(r)"] + lines(f, f"{f.slot} formula")
    return head + "\n    " + "\n    ".join(body) + f"\n    return fx.scalar({out}, mask)\n"


def function_source(f: Formula) -> str:
    """A standalone ``def formula(...)`` holding ``f``'s lines, returning its outputs by name:
    the formula alone, outside a loss, e.g. to test it against a hand-written reference.

    Loss-stage arguments: rho, w, adv, logp, old_logp, ref_logp, ent, mask, group_size;
    advantage-stage: r, adv, mask, group_size, batch (an ``AdvantageBatch``: its valid rows); then,
    as keywords defaulting to None, every other input of the stage a formula can read (the inputs
    table: rollout_logp, teacher_logp; old_logp, values, dense_rewards)."""
    if f.spec.stage == "loss":
        fixed = ["rho", "w", "adv", "logp", "old_logp", "ref_logp", "ent", "mask", "group_size"]
        init = ["per_token = torch.zeros_like(mask)"]
    else:
        fixed = ["r", "adv", "mask", "group_size", "batch"]
        init = ["keep = torch.ones_like(r)"]
    optional = [i.arg for i in table.INPUTS.values()
                if i.formula is not None and f.spec.stage in i.stages and i.arg not in fixed]
    if f.spec.stage == "advantage":  # estimate()'s old logprobs, read as old_logp / old_seq_logp
        optional.insert(0, lang.INPUTS["old_logp"].advantage)
    head = f"def formula({', '.join(fixed + [a + '=None' for a in optional])}):"
    body = init + lines(f, f"{f.slot} {f.name}")
    outs = ", ".join(f"{o!r}: {_RESULT[o]}" for o in f.outputs) + (_RETURNS if f.spec.extra else "")
    return head + "\n    " + "\n    ".join(body) + "\n    return {" + outs + "}\n"
