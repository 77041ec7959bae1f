"""``HFEngine``: the CPU rollout engine, built on transformers ``generate``.

Shapes: P prompts, G = ``params.n`` samples per prompt, B = P*G rows with each group
contiguous (rows g*G .. g*G+G-1 answer prompt g); Tp = prompt length (left padded),
Tr = response length (right padded), V = vocabulary size.

What the engine guarantees (see ``RolloutBatch``):

- ``response_mask`` is 1 on generated tokens up to and including the first EOS and 0
  after it; ``response_ids`` hold the pad id wherever the mask is 0.
- ``logprobs[b, t] = log_softmax(z_bt / tau)[y_bt]`` with ``z`` the *raw* logits
  (``output_logits=True``, never the processed ``scores``) and tau the temperature
  (tau = 1 for greedy). top-p truncation is not folded in: the value is the logprob
  under the tempered full distribution, the quantity a trainer recomputes.
- Sampling is reproducible given ``SamplingParams.seed``: the engine draws from a
  forked RNG, so the caller's global torch RNG is left untouched.
"""
from __future__ import annotations

from typing import Iterable

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from .types import RolloutBatch, SamplingParams


class HFEngine:
    """A ``RolloutEngine`` that samples with ``model.generate`` in one batched call.

    The engine uses ``model`` as given (no copy): pass a ``copy.deepcopy`` if the
    trainer must keep its own weights apart; ``update_weights`` then syncs them.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        device: str | torch.device = "cpu",
    ) -> None:
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("HFEngine needs a tokenizer with both a pad and an EOS token")
        if tokenizer.pad_token_id == tokenizer.eos_token_id:
            raise ValueError(
                "HFEngine needs pad != EOS: with pad == EOS a padded prompt cannot be told "
                "apart from a finished answer"
            )
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.pad_id: int = tokenizer.pad_token_id
        self.eos_id: int = tokenizer.eos_token_id

    # ------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, prompts: list[str], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` completions per prompt (groups contiguous)."""
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if params.n < 1 or params.max_new_tokens < 1:
            raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got {params}")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {params}")
        G = params.n
        greedy = params.temperature == 0
        tau = 1.0 if greedy else float(params.temperature)

        enc = self.tokenizer(
            prompts, return_tensors="pt", padding=True, padding_side="left"
        )
        prompt_ids = enc["input_ids"].repeat_interleave(G, dim=0).to(self.device)  # [B, Tp]
        prompt_mask = enc["attention_mask"].repeat_interleave(G, dim=0).to(self.device)  # [B, Tp]
        Tp = prompt_ids.shape[1]

        config = GenerationConfig(
            do_sample=not greedy,
            temperature=tau if not greedy else None,
            top_p=params.top_p if not greedy else None,
            top_k=0 if not greedy else None,  # transformers 5 would apply top_k=50 when unset
            max_new_tokens=params.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            bos_token_id=self.tokenizer.bos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        self.model.eval()
        # generate() fills every unset field from model.generation_config (a checkpoint's
        # generation_config.json may set repetition_penalty, top_k, ...): hide it, so the
        # sampling distribution is exactly the one described by `params`.
        checkpoint_defaults = self.model.generation_config
        self.model.generation_config = GenerationConfig()
        try:
            with torch.random.fork_rng(devices=[]):
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                out = self.model.generate(
                    input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config
                )
        finally:
            self.model.generation_config = checkpoint_defaults

        response_ids = out.sequences[:, Tp:]  # [B, Tr]
        logits = torch.stack(out.logits, dim=1).float()  # [B, Tr, V] raw logits
        logprobs = torch.log_softmax(logits / tau, dim=-1)  # [B, Tr, V]
        logprobs = logprobs.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)  # [B, Tr]

        response_mask = valid_until_first_eos(response_ids, self.eos_id)  # [B, Tr]
        response_ids = response_ids.masked_fill(response_mask == 0, self.pad_id)
        logprobs = logprobs.masked_fill(response_mask == 0, 0.0)
        finished = ((response_ids == self.eos_id) & (response_mask == 1)).any(dim=1)  # [B]

        completions = self.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        return RolloutBatch(
            prompt_ids=prompt_ids.cpu(),
            prompt_mask=prompt_mask.cpu(),
            response_ids=response_ids.cpu(),
            response_mask=response_mask.cpu(),
            logprobs=logprobs.cpu(),
            finish_reason=["stop" if f else "length" for f in finished.tolist()],
            prompts=[p for p in prompts for _ in range(G)],
            completions=completions,
            group_size=G,
        )

    # -------------------------------------------------------------- weight sync
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the engine's model by HF parameter (or buffer) name.

        Tied weights may arrive under either name (``lm_head.weight`` or the embedding).
        An unknown name or a shape mismatch raises; nothing is skipped silently.
        """
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        for name, tensor in named_tensors:
            if name not in targets:
                raise KeyError(
                    f"update_weights: the engine's model has no parameter {name!r} "
                    f"(it has {len(targets)}, e.g. {sorted(targets)[:3]})"
                )
            target = targets[name]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"the engine expects {tuple(target.shape)}"
                )
            target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))


def valid_until_first_eos(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, T] long mask: 1 on tokens up to and including the first EOS, 0 after it.

    A row without EOS is all ones.
    """
    is_eos = (ids == eos_id).long()  # [B, T]
    eos_before = is_eos.cumsum(dim=1) - is_eos  # [B, T] number of EOS strictly before t
    return (eos_before == 0).long()
