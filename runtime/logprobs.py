"""Memory-lean per-token logprobs and entropy of given tokens under a causal LM.

Shapes: B rows, T = Tp + Tr tokens (prompt left padded, response right padded),
H hidden size, V vocabulary, C = ``chunk_size`` rows of the flattened [B*Tr] tokens.

``token_logprobs`` runs the backbone once to hidden states, then the LM head one
chunk of C tokens at a time: the [C, V] fp32 logits of a chunk live only inside a
checkpointed function, so neither the forward nor the backward ever holds a full
[B, Tr, V] fp32 copy (the backward recomputes each chunk's logits when it needs them).

    logprob_t = z_t[y_t] - logsumexp(z_t)
    entropy_t = logsumexp(z_t) - sum_v softmax(z_t)_v * z_t,v

with z_t the fp32 logits predicting token y_t (from the hidden state at t - 1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions counting only real tokens: ``cumsum(mask) - 1`` clamped at 0.

    Matches what ``generate`` uses for left-padded prompts, so a recompute sees the
    same positions as sampling did (TOY_STUDY pitfall 5).
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """``log_softmax(logits.float(), -1).gather(-1, index)`` without the full fp32 copy.

    logits [..., V] (any float dtype), index [...] (long) -> [...] fp32.
    Rows are processed C = ``chunk_size`` at a time.
    """
    if logits.shape[:-1] != index.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and index {tuple(index.shape)} do not match")
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    idx = index.reshape(-1, 1)  # [N, 1]
    out = []
    for i in range(0, flat.shape[0], chunk_size):
        z = flat[i : i + chunk_size].float()  # [C, V]
        out.append(z.gather(-1, idx[i : i + chunk_size]).squeeze(-1) - torch.logsumexp(z, dim=-1))  # [C]
    return torch.cat(out).reshape(index.shape)


def _backbone(model: PreTrainedModel) -> torch.nn.Module:
    base = getattr(model, model.base_model_prefix, None)
    if base is None:
        raise TypeError(
            f"{type(model).__name__}: cannot find the backbone (attribute {model.base_model_prefix!r}); "
            "token_logprobs needs a transformers *ForCausalLM model"
        )
    return base


def _check_plain_head(model: PreTrainedModel) -> None:
    cfg = model.config
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(cfg, attr, None)
        if value not in (None, 1, 1.0):
            raise NotImplementedError(
                f"{type(model).__name__} transforms its logits ({attr}={value}); "
                "token_logprobs only supports a plain linear LM head"
            )


def _head_chunk(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [C, H], targets [C] -> (logprob [C], entropy [C] or empty) in fp32."""
    z = F.linear(hidden, weight, bias).float()  # [C, V]
    lse = torch.logsumexp(z, dim=-1)  # [C]
    logprob = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [C]
    if not with_entropy:
        return logprob, z.new_empty(0)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)  # [C]
    return logprob, entropy


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_response_tokens: int,
    *,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of the last ``num_response_tokens`` tokens of each row.

    input_ids       [B, T]   prompt (left padded) then response (right padded), T = Tp + Tr
    attention_mask  [B, T]   1 on real tokens (prompt mask then response mask)
    returns         logprobs [B, Tr] fp32, carrying gradients to the model's parameters;
                    entropy  [B, Tr] fp32 (detached unless ``entropy_grad``) or None.

    Values on padded response positions are computed but meaningless: mask them.
    Position ids come from the attention mask, as in ``generate``.
    """
    B, T = input_ids.shape
    Tr = num_response_tokens
    if not 0 < Tr < T:
        raise ValueError(f"num_response_tokens must be in [1, {T - 1}] for T={T}, got {Tr}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    _check_plain_head(model)
    head = model.get_output_embeddings()

    out = _backbone(model)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    hidden = out.last_hidden_state[:, T - Tr - 1 : T - 1]  # [B, Tr, H] states predicting the response
    hidden = hidden.reshape(B * Tr, -1)  # [B*Tr, H]
    targets = input_ids[:, T - Tr :].reshape(B * Tr)  # [B*Tr]

    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    logprobs, entropies = [], []
    for i in range(0, B * Tr, chunk_size):
        h, y = hidden[i : i + chunk_size], targets[i : i + chunk_size]  # [C, H], [C]
        args = (head.weight, head.bias, h, y, with_entropy, entropy_grad)
        if needs_grad:
            lp, ent = checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _head_chunk(*args)
        logprobs.append(lp)
        entropies.append(ent)
    logprob = torch.cat(logprobs).view(B, Tr)  # [B, Tr]
    entropy = torch.cat(entropies).view(B, Tr) if with_entropy else None  # [B, Tr]
    if entropy is not None and not entropy_grad:
        entropy = entropy.detach()
    return logprob, entropy
