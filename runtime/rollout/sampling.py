"""How a training step's single-turn rows come from an engine: plain samples, a tree per prompt
(``sampling tree``: tree.py), or in segments with newer weights loaded between two
(``rollout.partial``: partial.py). ``LocalRollouts.generate`` asks :func:`sample_rows`."""
from __future__ import annotations

from typing import Any, Callable

from ..batch import RolloutBatch
from .engines.base import SamplingParams
from .partial import generate_in_segments
from .tree import sample_tree


def sample_rows(engine: Any, prompts: list[str], params: SamplingParams,
                segments: tuple[int, Callable[[], int]] | None = None) -> RolloutBatch:
    """The rows of ``prompts``: a tree per prompt when ``params.tree`` is set (run/resolve.py refuses
    a tree with partial rollouts), else in segments of ``segments = (tokens, refresh)``, else plain."""
    if params.tree is not None:
        return sample_tree(engine, prompts, params, params.tree)
    if segments is not None:
        tokens, refresh = segments
        return generate_in_segments(engine, prompts, params, tokens, refresh)
    return engine.generate(prompts, params)
