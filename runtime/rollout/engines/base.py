"""The rollout-engine interface and the conventions every engine shares.

Every engine returns the same :class:`~rldsl.runtime.batch.RolloutBatch` layout, so the
trainer cannot tell them apart: G samples per prompt with groups contiguous, prompts left
padded, responses right padded with the pad id, ``response_mask`` 1 up to and including the
first stop token, ``logprobs`` those of the sampled tokens under the tempered distribution.
The checks and steps that guarantee it are here, written once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Protocol, runtime_checkable

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

from ...batch import RolloutBatch
from ...config import RunConfig
from ...models.kinds import ModelKind
from ...records.rng import step_seed


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples. ``n`` samples per prompt; temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    seed: int | None = None
    min_new_tokens: int = 0  # no stop token is sampled before this many (HF's / TRL's min_new_tokens)
    # sampling tree (rldsl.compiled.TreePlan): the training step's rows are a tree per prompt
    # (rollout/tree.py sample_tree, called by LocalRollouts); None: plain samples
    tree: Any = None

    @classmethod
    def greedy(cls, max_new_tokens: int) -> "SamplingParams":
        """One greedy answer per prompt (evaluations, ReMax's baseline)."""
        return cls(n=1, temperature=0.0, max_new_tokens=max_new_tokens)

    @classmethod
    def for_rollout(cls, cfg: RunConfig, seed: int) -> "SamplingParams":
        """A training step's sampling: ``rollout.n`` samples per prompt at the rollout's
        temperature and top-p, ``rollout.min_new_tokens`` at least (within the budget)."""
        r = cfg.rollout
        return cls(n=r.n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=cfg.max_new_tokens,
                   seed=seed, min_new_tokens=min(r.min_new_tokens, cfg.max_new_tokens))

    @classmethod
    def for_evaluation(cls, cfg: RunConfig, n: int, seed: int) -> "SamplingParams":
        """An evaluation's sampled answers: ``n`` per prompt at the rollout's temperature and top-p."""
        r = cfg.rollout
        return cls(n=n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=cfg.max_new_tokens, seed=seed)

    def for_chunk(self, worker: int) -> "SamplingParams":
        """Chunk ``worker``'s sampling when a round's prompts are split across rollout workers: a seed
        of its own, ``step_seed(seed, worker, 0, "chunk")`` (reproducible for a given number of
        workers, not the samples of one)."""
        if self.seed is None:
            return self
        return dataclasses.replace(self, seed=step_seed(self.seed, worker, 0, "chunk"))

    def check(self) -> None:
        """Raise ValueError unless every field is in range (engines call it before sampling)."""
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got {self}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"need 0 <= min_new_tokens <= max_new_tokens, got {self}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self}")


@runtime_checkable
class RolloutEngine(Protocol):
    """One interface for every engine (transformers ``hf``, ``vllm``).

    An engine may live in another process (a Ray actor): arguments and results are
    plain tensors, strings and dataclasses.
    """

    #: the policy's kind (models/kinds/), chosen once from its config: how its prompts' images
    #: become tokens and inputs
    kind: ModelKind

    def generate(self, prompts: list[str], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` completions for each prompt; groups contiguous."""
        ...

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams,
                     prompts: list[str] | None = None) -> RolloutBatch:
        """Token in, token out: the same from prompt token ids, used exactly as given (never
        decoded and re-encoded); ``prompts`` is their text for the batch (default: decoded)."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (HF parameter names) in place."""
        ...

    def load_adapter(self, adapter: Any, version: int) -> None:
        """``model.lora.sync = "adapter"``: hold ``adapter`` (a ``models.lora.LoraAdapter``) as the
        policy's LoRA adapters of ``version``, the base weights unchanged."""
        ...


def check_request(prompts: list[str], params: SamplingParams) -> None:
    """The checks every ``generate`` makes before sampling."""
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    params.check()


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (ids [P, T] left padded with ``pad_id``, mask [P, T] 1 on real tokens)."""
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("generate_ids() needs at least one prompt, each with at least one token")
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = torch.as_tensor(r, dtype=torch.long)
        mask[i, T - len(r):] = 1
    return ids, mask


def special_token_ids(tokenizer: Any, engine: str) -> tuple[int, int]:
    """(pad id, EOS id) of ``tokenizer``; both must exist and differ.

    With pad == EOS a padded row cannot be told apart from a finished answer.
    """
    if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise ValueError(f"{engine} needs a tokenizer with both a pad and an EOS token")
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(f"{engine} needs pad != EOS: with pad == EOS a padded row cannot be "
                         "told apart from a finished answer")
    return int(tokenizer.pad_token_id), int(tokenizer.eos_token_id)


def generation_config_eos_ids(source: Any) -> set[int]:
    """Every EOS id of a model's generation config: ``source`` is a model (its
    ``generation_config``), a ``GenerationConfig``, or a model folder / hub id (its
    ``generation_config.json``). Empty when there is none.

    The stop rule every engine follows (TRL and vLLM do the same): a completion ends at
    the first token that is the tokenizer's EOS *or* any of these ids (Qwen and Llama 3
    checkpoints list several, e.g. ``<|im_end|>`` and ``<|endoftext|>``).
    """
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        try:
            from transformers import GenerationConfig

            config = GenerationConfig.from_pretrained(source)
        except Exception:  # no generation_config.json: nothing to add
            return set()
    else:
        config = getattr(source, "generation_config", source)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def stop_token_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """The ids that end a completion: the tokenizer's EOS and every EOS id of the model's
    generation config (:func:`generation_config_eos_ids`), the pad id excluded."""
    stops = {int(tokenizer.eos_token_id), *generation_config_eos_ids(model)}
    stops.discard(tokenizer.pad_token_id)
    return frozenset(stops)


def cut_at_first_stop(ids: torch.Tensor, stop_ids: int | Collection[int], pad_id: int,
                      lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled response ids [B, T] -> (ids with the pad id after the first stop token,
    ``response_mask`` [B, T], ``stopped`` [B] bool: the row holds a stop token).

    ``lengths`` [B]: how many of each row's ids were generated (the rest is filler).
    """
    mask = valid_until_first_eos(ids, stop_ids)  # [B, T]
    if lengths is not None:
        mask = mask * (torch.arange(ids.shape[1], device=ids.device) < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, pad_id)
    stops = torch.as_tensor([stop_ids] if isinstance(stop_ids, int) else sorted(stop_ids),
                            dtype=ids.dtype, device=ids.device)
    stopped = (torch.isin(ids, stops) & (mask == 1)).any(dim=1)  # [B]
    return ids, mask, stopped


def valid_until_first_eos(ids: torch.Tensor, eos_id: int | Collection[int]) -> torch.Tensor:
    """[B, T] long mask: 1 on tokens up to and including the first stop token, 0 after it.

    ``eos_id``: the EOS id, or every id that ends a completion. A row without one is all ones.
    """
    stops = torch.as_tensor([eos_id] if isinstance(eos_id, int) else sorted(eos_id),
                            dtype=ids.dtype, device=ids.device)
    is_stop = torch.isin(ids, stops).long()  # [B, T]
    stops_before = is_stop.cumsum(dim=1) - is_stop  # [B, T] number of stops strictly before t
    return (stops_before == 0).long()
