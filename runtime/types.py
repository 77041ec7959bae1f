"""Data types shared by the rollout engines, the reward stage and the trainer.

Shapes: P prompts x G samples per prompt, B = P*G rows, groups contiguous
(rows g*G .. g*G+G-1 answer prompt g). Tp = prompt length (left padded),
Tr = response length (right padded).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples. ``n`` samples per prompt; temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int | None = None


@dataclass
class RolloutBatch:
    """What a rollout engine returns for P prompts x G samples (B = P*G rows).

    prompt_ids      [B, Tp]  left padded with the pad id
    prompt_mask     [B, Tp]  1 on real prompt tokens
    response_ids    [B, Tr]  right padded with the pad id
    response_mask   [B, Tr]  1 on generated tokens up to and including the first EOS
    logprobs        [B, Tr]  engine's logprob of each sampled token under the sampling
                             distribution (temperature applied), 0 on padding; kept to
                             measure the train/inference mismatch, never used as policy
                             logprobs
    finish_reason   B x "stop" (EOS produced) | "length" (max_new_tokens reached)
    prompts         B x prompt text (repeated G times)
    completions     B x decoded completion text (without special tokens)
    group_size      G
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: list[str]
    prompts: list[str]
    completions: list[str]
    group_size: int
    answers: list[str] = field(default_factory=list)

    @property
    def truncated(self) -> torch.Tensor:
        """[B] bool: the sample hit max_new_tokens without an EOS."""
        return torch.tensor([f == "length" for f in self.finish_reason], dtype=torch.bool,
                            device=self.response_ids.device)

    def __len__(self) -> int:
        return self.response_ids.shape[0]


@runtime_checkable
class RolloutEngine(Protocol):
    """One interface for every engine (transformers ``hf``, ``vllm``).

    An engine may live in another process (a Ray actor): arguments and results are
    plain tensors, strings and dataclasses.
    """

    def generate(self, prompts: list[str], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` completions for each prompt; groups contiguous."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (HF parameter names) in place."""
        ...
