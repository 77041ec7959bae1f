"""What a run carries from one step to the next besides its model and optimizer: the per-prompt
reward statistics a spec reads (``prompt_mean``, ``prompt_var``, ``prompt_count``:
records/prompt_stats.py) and the groups kept by ``sampling replay`` (rollout/replay.py). Each
exists only when the spec asks for it; build makes them, checkpointing saves and restores them."""
from __future__ import annotations

from typing import Any

from ..records.prompt_stats import PromptStats
from ..rollout.replay import ReplayBuffer
from ..train.inputs import reads_history


def carried_state(algo: Any, fn: Any, pad_id: int) -> dict[str, Any]:
    """``Run``'s keywords for the state carried across steps: ``prompt_stats`` (None unless the
    spec reads the per-prompt statistics) and ``replay`` (None unless it samples with replay)."""
    return {"prompt_stats": PromptStats() if reads_history(algo) else None,
            "replay": None if fn.data.replay_policy is None else ReplayBuffer(fn.data.replay_policy, pad_id)}
