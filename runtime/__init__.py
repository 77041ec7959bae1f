"""rldsl.runtime: the training system (rollout engines, trainer, orchestration).

The runtime never writes a formula of its own: every advantage, filter, shaping and loss
comes from ``rldsl.compile(algorithm)``.
"""
