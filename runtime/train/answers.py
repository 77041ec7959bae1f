"""The policy's probability of the data's reference answer (``answer_prob``, ``bare_answer_prob``).

RLPR's reward (Yu et al. 2025, arXiv 2506.18254) is how likely the policy finds the reference
answer once it has reasoned: each row's completion is cut after its answer tag
(``reward.answer_tags``: ``<answer>`` by default), the data's answer (``data.answer_key``) put in
place of the row's own answer, and the policy that sampled the step scores that sequence in a
no-grad forward; the row's value is the mean per-token probability of the answer's tokens. The
same answer right after the prompt, with no reasoning, is the debiasing term
(``bare_answer_prob``). The rows are built as the authors' ``replace_answer_with_gt_batch`` and
``get_scoreA`` build them (github.com/OpenBMB/RLPR @ 8490fca, verl/trainer/ppo/ray_trainer.py):

- after the reasoning: ``reasoning + answer tag + lead + answer + " " + closing tag + EOS``, where
  ``reasoning + answer tag`` is the completion up to and including its one answer tag and
  ``lead`` the whitespace the row's own answer started with (one space when none);
- bare: ``" " + answer + " " + EOS`` right after the prompt.

The answer's tokens are those whose characters overlap the answer's (the authors'
``locate_substring_tokens``). A completion without exactly one answer tag gets 0, as the
authors' (their ``ground_truth_mask`` is empty there); so does an empty reference answer (no
tokens to score; the authors' code raises there). The prompt keeps the tokens it was
sampled with; the response text is tokenized afresh (a fast tokenizer: its character offsets).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import Tensor

from ..batch import RolloutBatch
from ..errors import RunError


@dataclasses.dataclass(frozen=True)
class AnswerRows:
    """Sequences to score and where the answer lies in them: ``batch`` (the rollout's prompts,
    responses made of the texts above) and ``answer`` [B, Tr'] 1 on the answer's tokens."""

    batch: RolloutBatch
    answer: Tensor


def answer_texts(completion: str, answer: str, tags: tuple[str, str]) -> tuple[str, int] | None:
    """The response text with ``answer`` after the completion's reasoning, and where the answer
    starts in it; None when the completion has not exactly one opening tag."""
    start, end = tags
    if completion.count(start) != 1:
        return None
    cut = completion.index(start) + len(start)
    rest = completion[cut:]
    lead = rest[:len(rest) - len(rest.lstrip(" \n\t\r"))] or " "
    return completion[:cut] + lead + answer + " " + end, cut + len(lead)


def _rows(tokenizer: Any, batch: RolloutBatch, texts: list[tuple[str, int] | None], answers: list[str]) -> AnswerRows:
    """Tokenize each response text (EOS appended) and mark the tokens overlapping its answer."""
    if not getattr(tokenizer, "is_fast", False):
        raise RunError("answer_prob needs a fast tokenizer (its character offsets place the reference answer's "
                       "tokens); this policy's tokenizer is a slow one")
    eos = tokenizer.eos_token_id
    ids, marks = [], []
    for made, ans in zip(texts, answers):
        if made is None or not ans:
            ids.append([eos])
            marks.append([0])
            continue
        text, at = made
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids.append(list(enc["input_ids"]) + [eos])
        marks.append([int(s < at + len(ans) and e > at) for s, e in enc["offset_mapping"]] + [0])
    width = max(len(x) for x in ids)
    dev = batch.response_ids.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    response = torch.tensor([x + [pad] * (width - len(x)) for x in ids], dtype=torch.long, device=dev)
    attend = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids], dtype=batch.response_mask.dtype,
                          device=dev)
    answer = torch.tensor([m + [0] * (width - len(m)) for m in marks], dtype=torch.float32, device=dev)
    rows = dataclasses.replace(batch, response_ids=response, response_mask=attend,
                               logprobs=torch.zeros(response.shape, dtype=torch.float32, device=dev),
                               response_attention=None, inputs={}, routed_experts=None, replayed=None,
                               kept_advantages=None)
    return AnswerRows(rows, answer)


def after_reasoning(tokenizer: Any, batch: RolloutBatch, answers: list[str], tags: tuple[str, str]) -> AnswerRows:
    """Each row's completion with its answer replaced by the reference answer (module docstring)."""
    return _rows(tokenizer, batch, [answer_texts(c, a, tags) for c, a in zip(batch.completions, answers)], answers)


def bare(tokenizer: Any, batch: RolloutBatch, answers: list[str]) -> AnswerRows:
    """The reference answer right after each prompt: ``" " + answer + " "`` then EOS, one row per
    prompt (the first of its group: the G rows share prompt and answer), groups of one."""
    G = batch.group_size
    firsts = dataclasses.replace(batch.select(torch.arange(0, len(batch), G)), group_size=1)
    mine = answers[::G]
    return _rows(tokenizer, firsts, [(" " + a + " ", 1) for a in mine], mine)


def mean_probability(logprobs: Tensor, answer: Tensor) -> Tensor:
    """[B]: the mean of exp(logprob) over each row's answer tokens; 0 for a row with none."""
    p = torch.exp(logprobs.float()) * answer
    n = answer.sum(-1)
    return torch.where(n > 0, p.sum(-1) / n.clamp_min(1), torch.zeros_like(n))


def answer_probabilities(score: Callable[[RolloutBatch], Tensor], tokenizer: Any, batch: RolloutBatch,
                         answers: list[str], tags: tuple[str, str]) -> tuple[Tensor, Tensor]:
    """(answer_prob, bare_answer_prob) [B] float32: ``score`` (the policy's no-grad logprobs of a
    batch's responses, [B, Tr']) over the two sets of rows."""
    out = []
    for rows in (after_reasoning(tokenizer, batch, answers, tags), bare(tokenizer, batch, answers)):
        lp = score(rows.batch).to(rows.answer.device)
        out.append(mean_probability(lp, rows.answer))
    return out[0], out[1].repeat_interleave(batch.group_size)  # the bare one per prompt, on its G rows
