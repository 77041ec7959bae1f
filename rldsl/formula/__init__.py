"""Formulas in specs: components written in mathematical notation inside a ``.rl`` file.

    define sapo_gate                      # docs/formulas.md
      tau = where(A > 0, 1.0, 1.05)
      w = sigmoid(tau * (rho - 1)) * 4 / tau
    end
    trust_region  sapo_gate

Modules, in the order a formula goes through them:

- ``nodes``   syntax nodes with their spans; ``syntax``: Lark tree -> nodes, syntax-error hints
- ``lang``    the closed tables: per-slot inputs and outputs, functions, shapes
- ``check``   names, arity, kinds, shapes, constants, padding -> a typed :class:`check.Formula`
- ``emit``    the typed tree -> lines of torch code (closed-table identifiers, checked literals)
- ``masked``  the masked reductions the generated code calls (``fx.*``)
- ``render``  formula text for explain, diffs and code comments
- ``hooks``   the few functions spec, codegen, compiled and explain call
- ``argument`` a formula written as a component's argument (sampling replay's priority): parsed,
  checked and compiled by the modules above, evaluated on one prompt group's rows
"""
