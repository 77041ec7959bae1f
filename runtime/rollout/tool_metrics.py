"""Tool-call metrics of a batch of multi-turn episodes (``RolloutBatch.episodes``): how many
calls an episode makes, how many of them are well-formed, how many got an error back."""
from __future__ import annotations

from ..batch import RolloutBatch
from .episodes.parsers import ToolCall, parse_tool_calls
from ..records.metrics import TOOL_CALL_ERRORS, TOOL_CALLS_PER_EPISODE, TOOL_CALLS_WELL_FORMED


def tool_call_metrics(batch: RolloutBatch, parser: str = "hermes", prefix: str = "") -> dict[str, float]:
    """``tool_calls/per_episode`` (calls the model wrote, per episode), ``tool_calls/well_formed``
    (the fraction of them the parser reads as a call: valid JSON with a name and an arguments
    object; NaN without calls), ``tool_calls/errors`` (the fraction of tool results that are an
    error: a malformed call, an unknown tool, a tool that raised or timed out); ``prefix`` is
    put before each name (``"eval/"``). Empty for a single-turn batch. An agent's assistant
    messages carry their well-formed calls as ``tool_calls`` (docs/agents.md); each of its
    episodes counts once however many rows it has."""
    if not batch.episodes:
        return {}
    calls = well = results = errors = 0
    episodes = [e for e in batch.episodes if e.agent is None or e.agent.row == 0]  # an agent's once, not per row
    for episode in episodes:
        for m in episode.messages:
            if m.get("role") == "assistant":
                parsed = parse_tool_calls(parser, m.get("content") or "")
                structured = m.get("tool_calls") or []  # an agent's calls, read by the endpoint already
                calls += len(parsed) + len(structured)
                well += sum(isinstance(c, ToolCall) for c in parsed) + len(structured)
            elif m.get("role") == "tool":
                results += 1
                errors += str(m.get("content", "")).startswith("error:")
    nan = float("nan")
    return {prefix + TOOL_CALLS_PER_EPISODE: calls / len(episodes),
            prefix + TOOL_CALLS_WELL_FORMED: well / calls if calls else nan,
            prefix + TOOL_CALL_ERRORS: errors / results if results else nan}
