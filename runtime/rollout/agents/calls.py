"""An agent episode's model calls, recorded exactly, and the training rows made from them.

Every call the endpoint answers is a :class:`Call`: the prompt ids the engine saw, the ids it
sampled and their logprobs, the policy version. :func:`episode_rows` joins the calls into
sequences: a call whose prompt ids extend a sequence's ids so far (its prompt, then every token
after it) exactly continues that sequence -- the ids between are the environment's (tool
results, turn markers: loss mask 0), the new completion the model's (mask 1); any other call
starts a row of its own with its own exact prompt (a *prefix break*). No text is ever
re-tokenised here: rows are made of recorded ids only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...batch import first_records


@dataclass
class Call:
    """One completion the endpoint returned (one choice of a request)."""

    prompt_ids: list[int]
    completion_ids: list[int]      # sampled, up to and including the stop token (or the cut)
    logprobs: list[float]          # one per completion id, the engine's (tempered) logprob
    version: int                   # the policy version that sampled it
    finish_reason: str             # "stop" | "length" | "tool_calls"
    route: str                     # "chat" | "completions" | "generate"
    text: str = ""                 # the completion's text as returned
    messages: list[dict] | None = None  # chat: the request's messages and the reply
    bridged: bool = False          # chat: the prompt continued an earlier call's ids
    metadata: dict[str, str] = field(default_factory=dict)  # the request's ``metadata`` (e.g. the caller's role)
    # a mixture-of-experts policy: the experts of the prompt and completion ids [len(prompt_ids) +
    # len(completion_ids), Y, K] (-1 on the last id: no forward fed it); None = not recorded
    routed_experts: Any = None
    images: list[str] = field(default_factory=list)  # chat: the images its prompt ids hold, in order (data: URLs)


@dataclass
class Row:
    """One training sequence of an episode: ``prompt_ids`` then ``response_ids``; ``mask`` 1 on
    the model's sampled tokens, ``logprobs`` the engine's there (0 elsewhere)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # indices of the calls it holds
    finish_reason: str = "length"
    routed_experts: Any = None  # [len(ids), Y, K] each token's first record (batch.first_records)
    images: list[str] = field(default_factory=list)  # the images its ids hold, in order (a VLM's)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def episode_rows(calls: list[Call]) -> list[Row]:
    """The rows of an episode's calls, in call order. A call joins the row whose ids (prompt +
    response so far) its prompt ids start with (the longest such row, when several do: ``n`` > 1
    or parallel calls); otherwise it starts a new row. A row's routing keeps each token's first
    record: the model's ids as sampled, the environment's from the next call's prefill."""
    rows: list[Row] = []
    for k, c in enumerate(calls):
        best: Row | None = None
        for r in rows:
            ids = r.ids
            if len(c.prompt_ids) >= len(ids) and c.prompt_ids[:len(ids)] == ids \
                    and (best is None or len(ids) > len(best.ids)):
                best = r
        if best is None:
            best = Row(list(c.prompt_ids))
            rows.append(best)
            gap: list[int] = []
        else:
            gap = c.prompt_ids[len(best.ids):]
        best.response_ids += gap + c.completion_ids
        best.mask += [0] * len(gap) + [1] * len(c.completion_ids)
        best.logprobs += [0.0] * len(gap) + list(c.logprobs)
        best.calls.append(k)
        if c.routed_experts is not None:
            best.routed_experts = first_records(best.routed_experts, c.routed_experts)
        best.images = list(c.images)  # a continuing call's prompt holds the row's ids, so its images too
        best.finish_reason = "length" if c.finish_reason == "length" else "stop"
    return rows


def prefix_breaks(rows: list[Row]) -> int:
    """Calls that could not continue an earlier call's sequence: every row after the first."""
    return max(0, len(rows) - 1)


@dataclass
class Outcome:
    """How one agent episode ended: the model calls the endpoint recorded, what the agent
    returned (its reward, checked: a number, a reward per role -- {tag value: number} -- or None)
    and why it failed (None: it did not)."""

    calls: list[Call] = field(default_factory=list)
    reward: float | dict[str, float] | None = None
    error: str | None = None

    def row_rewards(self, rows: list[Row], K: int, subject: str) -> tuple[list[float | None], str | None]:
        """The reward of each of the episode's ``K`` rows (its ``rows``, then padding) and the
        episode's error. A number (or None) is every row's. A reward per role is each row's by the
        value its calls are tagged with in their request ``metadata`` (any key: the field a spec's
        ``group_by`` reads); a padding row gets the mean of the others', so an episode's mean over
        its rows is its rows' mean. A row tagged with none of the roles, or two, is the episode's
        error."""
        if not isinstance(self.reward, dict):
            return [self.reward] * K, self.error
        got: list[float] = []
        for j, row in enumerate(rows):
            tags = {v for i in row.calls for v in self.calls[i].metadata.values()}
            hit = sorted(tags & self.reward.keys())
            if len(hit) != 1:
                tagged = " and ".join(map(repr, sorted(tags))) or "nothing"
                return [None] * K, (f"{subject} returned a reward per role ({', '.join(map(repr, sorted(self.reward)))}) "
                                    f"but the episode's row {j} is tagged {tagged} in its calls' metadata: "
                                    f"tag each row's calls with one of the roles")
            got.append(self.reward[hit[0]])
        pad = sum(got) / len(got) if got else None
        return got + [pad] * (K - len(got)), None
