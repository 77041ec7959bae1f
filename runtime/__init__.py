"""rldsl.runtime: the training system (rollout engines, trainer, workers, the run loop).

The runtime never writes a formula of its own: every advantage, filter, shaping and loss
comes from ``rldsl.compile(algorithm)``. Its folders, one step's data flow and the import rules:
docs/architecture.md.

Each module has one import path, its place in these folders (``rldsl.runtime.run.loop``,
``rldsl.runtime.rollout.engines.hf``): no old path is kept for a module that moved.
"""
