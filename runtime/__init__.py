"""rldsl.runtime: the training system (rollout engines, trainer, workers, the run loop).

The runtime never writes a formula of its own: every advantage, filter, shaping and loss
comes from ``rldsl.compile(algorithm)``. Its layout and import rules: docs/runtime.md.
"""
