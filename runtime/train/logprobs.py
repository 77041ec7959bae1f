"""Memory-lean per-token logprobs and entropy of given tokens under a causal LM.

Shapes: B rows, T = Tp + Tr tokens (prompt left padded, response right padded),
H hidden size, V vocabulary, C = ``chunk_size`` rows of the flattened [B*Tr] tokens.

``token_logprobs`` runs the backbone once to hidden states, then the LM head one chunk of
C tokens at a time (``_ChunkedHead``, a custom autograd function): the [C, V] fp32 logits
of a chunk exist only while that chunk is processed, forward and backward, so no
[B, Tr, V] tensor is ever held.

    logprob_t = z_t[y_t] - logsumexp(z_t)
    entropy_t = logsumexp(z_t) - sum_v softmax(z_t)_v * z_t,v
    sum_pi_squared_t = sum_v softmax(z_t)_v^2     (only with ``with_sum_pi_squared``; no gradient)
    self_certainty_t = logsumexp(z_t) - mean_v z_t,v   (only when asked; no gradient)

with z_t the fp32 logits predicting token y_t (from the hidden state at t - 1), taken as
the model's own ``forward`` makes them and then divided by the sampling temperature tau:

    x = h W^T + b                       the linear LM head
    u = s x                             the model's logit scale s (1 for most models)
    v = c tanh(u / c)                   the model's final soft cap c (Gemma 2/3; none = v = u)
    z = v / tau                         the rollout temperature (``temperature=``)

(``logit_transform`` reads s and c from the config, in the order transformers' modeling
code applies them). Dividing by tau makes the logprobs, entropies and KL terms those of the
distribution the engine sampled from (verl ``_scale_logits_by_temperature``; TRL divides the
logits by ``temperature`` before its selective log-softmax, the reference model's too).

Shared prompts (``group_size=G``): when the G rows of each group share one prompt (as every
rollout's do), the backbone runs the prompt once per group, keeps its keys and values in a
``DynamicCache``, repeats them G times (autograd flows back through the repeat) and runs
only the response tokens of the B rows on top: P*Tp + B*(Tr-1) tokens instead of B*(Tp+Tr).
The path is taken only when it is exact -- the prompts (ids and mask) are identical within
every group and the cache has only full-attention layers -- and when it is cheaper: not
under gradient checkpointing, whose layers run without a cache -- else the full forward runs.
Its speed and memory: bench/README.md.

Packed rows (``packing=True``): the real tokens of the B rows laid end to end in rows of
at most ``packing_row_tokens`` tokens, positions restarting at every sequence, no padding through the
layers (train/packing.py), and the LM head run on the real response tokens only; rows that
share their prompt by groups may hold each prompt once per packed row (shared-prompt rows, a
tree mask). The layout pushing the fewest tokens is taken among those the model keeps apart
(checked once each), unless the shared-prompt forward pushes no more; results on padding
positions are then 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from ..batch import position_ids_from_mask
from ..models import moe
from ..models.kinds.base import ForwardInputs
from ..models.kinds.text import TextInputs
from ..models.loading import backbone, cache_keyword, head_weights, plain_kv_cache
from .microbatch import pack
from .packing import PackedRows, packed_hidden, packed_layout, same_prompts
from .throughput import TokenCount


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


def _shared_prompt_hidden(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_response_tokens: int,
    group_size: int,
) -> torch.Tensor | None:
    """Hidden states [B, Tr, H] predicting the response tokens, running each group's prompt once.

    None when the shortcut would not be exact (see the module docstring): the caller then
    runs the full forward.
    """
    if not _shared_prompt_applies(model, input_ids, attention_mask, num_response_tokens, group_size):
        return None
    return _shared_prompt_forward(model, input_ids, attention_mask, num_response_tokens, group_size)


def _shared_prompt_forward(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           num_response_tokens: int, group_size: int,
                           keep_prompt: list[torch.Tensor] | None = None) -> torch.Tensor | None:
    """:func:`_shared_prompt_hidden` where it applies (the caller checked); None when the model did
    not fill the cache. ``keep_prompt``: a list that receives the prompt pass's states [P, Tp - 1, H]
    predicting each group's prompt tokens 1 .. Tp - 1 (``LogprobOptions.prompt_logprobs``)."""
    B, T = input_ids.shape
    G, Tr = group_size, num_response_tokens
    Tp = T - Tr
    body = backbone(model)
    kw = cache_keyword(body)  # "cache" or "past_key_values", as this transformers names it
    from transformers.cache_utils import DynamicCache
    cache = DynamicCache(config=model.config)
    pos = position_ids_from_mask(attention_mask)  # [B, T] as in the full forward
    first = slice(0, B, G)  # one row per group
    out = body(
        input_ids=input_ids[first, :Tp],
        attention_mask=attention_mask[first, :Tp],
        position_ids=pos[first, :Tp],
        **{kw: cache},
        use_cache=True,
    )
    if keep_prompt is not None:
        keep_prompt.append(out.last_hidden_state[:, :-1])  # [P, Tp - 1, H], in the graph when there is one
    h_first = out.last_hidden_state[:, -1:].repeat_interleave(G, dim=0)  # [B, 1, H] predicts response token 0
    if Tr == 1:
        return h_first
    if cache.get_seq_length() != Tp:  # pragma: no cover - a model that did not fill the cache
        return None
    cache.batch_repeat_interleave(G)  # [P, heads, Tp, d] -> [B, heads, Tp, d], differentiable
    out = body(
        input_ids=input_ids[:, Tp : T - 1],
        attention_mask=attention_mask[:, : T - 1],
        position_ids=pos[:, Tp : T - 1],
        **{kw: cache},
        use_cache=True,
    )
    return torch.cat([h_first, out.last_hidden_state], dim=1)  # [B, Tr, H]


def _shared_prompt_tokens(B: int, T: int, Tr: int, G: int | None) -> int:
    """Tokens the shared-prompt forward pushes: each group's prompt once, then B x (Tr - 1)."""
    assert G
    return (B // G) * (T - Tr) + B * (Tr - 1)


def _shared_prompt_applies(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           Tr: int, G: int | None) -> bool:
    """The shared-prompt forward is exact here: the rows come in groups of G with identical
    prompts (ids and mask), no layer is checkpointed and the cache has full-attention layers only;
    never while a MoE model's routing is replayed or measured (its records are per row: models/moe.py)."""
    if moe.active(model):
        return False
    if not same_prompts(input_ids, attention_mask, Tr, G):
        return False
    if torch.is_grad_enabled() and model.training and any(m.gradient_checkpointing for m in _checkpointable(model)):
        return False  # a checkpointed layer runs without a cache (transformers drops it, with a warning)
    return _takes_plain_cache(model)


# the modules of a model that carry a ``gradient_checkpointing`` flag -- the only ones transformers'
# ``gradient_checkpointing_enable`` / ``_disable`` ever set -- found once per model (a walk of every
# module), their flags read at each training forward
_CHECKPOINTABLE: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[torch.nn.Module, ...]]" = weakref.WeakKeyDictionary()


def _checkpointable(model: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    found = _CHECKPOINTABLE.get(model)
    if found is None:
        found = _CHECKPOINTABLE[model] = tuple(m for m in model.modules() if hasattr(m, "gradient_checkpointing"))
    return found


# whether a model's body takes a KV cache and that cache is plain: fixed by its class and config,
# read once per model (a signature inspection and a cache built from the config), not per forward
_PLAIN_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _takes_plain_cache(model: PreTrainedModel) -> bool:
    known = _PLAIN_CACHE.get(model)
    if known is None:
        known = _PLAIN_CACHE[model] = cache_keyword(backbone(model)) is not None and plain_kv_cache(model)
    return known


def _packed_layout(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   Tr: int, row_tokens: int | None, group_size: int | None) -> PackedRows | None:
    """The packed layout that pushes the fewest tokens -- shared-prompt rows (each group's prompt
    once per row) or plain ones -- among those exact here and taken by the model; None when
    there is none, or when the padded shared-prompt forward pushes no more tokens."""
    B, T = input_ids.shape
    # the padded shared-prompt forward's tokens, when it is exact here: a packed layout that
    # cannot push fewer is not built (packed_layout's bound decides before any index is made)
    shared = _shared_prompt_tokens(B, T, Tr, group_size) \
        if _shared_prompt_applies(model, input_ids, attention_mask, Tr, group_size) else None
    rows = packed_layout(backbone(model), input_ids, attention_mask, Tr, row_tokens, group_size, fewer_than=shared)
    if rows is None or (shared is not None and shared <= rows.computed_tokens):
        return None
    return rows


# Config fields through which a transformers *ForCausalLM transforms the LM head's output,
# as its forward applies them: a multiplier (Cohere ``logit_scale``, Falcon-H1
# ``lm_head_multiplier``), a divisor (Granite ``logits_scaling``), then a soft cap (Gemma 2/3
# ``final_logit_softcapping``: c tanh(u / c)).
_MULTIPLIERS = ("logit_scale", "lm_head_multiplier")
_DIVISORS = ("logits_scaling",)
_SOFTCAPS = ("final_logit_softcapping",)
#: every config field logit_transform reads (a remote teacher's LM head carries them: train/teachers.py)
TRANSFORM_FIELDS = _MULTIPLIERS + _DIVISORS + _SOFTCAPS


@dataclass(frozen=True)
class LogitTransform:
    """z = c tanh(s x / c) / tau, or s x / tau without a cap (module docstring)."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0


def _config_number(cfg: object, attr: str) -> float | None:
    value = getattr(cfg, attr, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise NotImplementedError(
            f"{type(cfg).__name__}.{attr}={value!r}: token_logprobs applies this logit "
            "transform only for a positive finite number")
    return float(value)


def logit_transform(model: PreTrainedModel, temperature: float) -> LogitTransform:
    """The model's own logit scale and soft cap (read from its config), and ``temperature``."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r} "
                         "(greedy rollouts are scored at temperature 1)")
    cfg = model.config
    scale = 1.0
    for attr in _MULTIPLIERS:
        value = _config_number(cfg, attr)
        scale *= value if value is not None else 1.0
    for attr in _DIVISORS:
        value = _config_number(cfg, attr)
        scale /= value if value is not None else 1.0
    caps = [c for c in (_config_number(cfg, a) for a in _SOFTCAPS) if c is not None]
    return LogitTransform(scale, caps[0] if caps else None, float(temperature))


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tf: LogitTransform) -> torch.Tensor:
    """z [C, V] of hidden [C, H]: the linear head in at least float32 (float64 stays), then the
    transform: c tanh(s x / c) / tau, or s x / tau without a cap. In place when no gradient is
    recorded (the chunked heads' forwards and backwards), out of place when one is (the student's
    side of a divergence: tanh's backward reads its own output)."""
    z = F.linear(hidden, weight, bias)  # [C, V] x
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if z.requires_grad:
        if tf.softcap is not None:
            return tf.softcap * torch.tanh(z * (tf.scale / tf.softcap)) / tf.temperature
        return z * (tf.scale / tf.temperature) if tf.scale != tf.temperature else z
    if tf.softcap is not None:
        z.mul_(tf.scale / tf.softcap).tanh_().mul_(tf.softcap / tf.temperature)  # c tanh(s x / c) / tau
    elif tf.scale != tf.temperature:
        z.mul_(tf.scale / tf.temperature)  # s x / tau
    return z


class _ChunkedHead(torch.autograd.Function):
    """Logprobs and entropies of N tokens through the LM head, C = ``chunk`` tokens at a time.

    Forward, per chunk: z = transform(h W^T + b) [C, V] (fp32; ``head_logits``),
    lse = logsumexp(z), logprob = z[y] - lse, entropy = lse - sum softmax(z) * z. Saved for
    backward: the inputs and lse, entropy [N] -- no [*, V] tensor. Backward recomputes each
    chunk's z and writes its gradient in place:

        d logprob / dz = onehot(y) - p,     d entropy / dz = -p * (log p + entropy)
        grad_z = p * (-g - g_ent * (log p + entropy)) + g * onehot(y),   p = exp(z - lse)
        grad_x = grad_z * dz/dx,   dz/dx = s / tau  (with a soft cap: (s / tau)(1 - t^2),
                                                     t = tanh(s x / c) = z tau / c)
        grad_h = grad_x W,   grad_W = sum_chunks grad_x^T h,   grad_b = sum grad_x

    so a chunk needs two [C, V] fp32 buffers in either direction (a third with a soft cap
    and an entropy gradient); bench/logprobs.py measures the memory against the naive
    log_softmax. ``entropy_grad`` False: the entropy output carries no gradient (g_ent = 0).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, with_entropy, entropy_grad, tf, with_spp=False,
                extra_ids=None, topk=0, with_top1=False, with_sc=False):
        N = hidden.shape[0]
        # the logprobs of extra_ids [N, J0] and of each position's own top-K tokens, whose ids the
        # chunks pick (top_ids), share one [N, J0 + K] buffer and the same backward
        extra_ids, J0 = _with_topk_columns(extra_ids, topk, N, targets.device)
        J = extra_ids.shape[1] if extra_ids is not None else 0
        extra = hidden.new_empty((N, J), dtype=torch.float32)  # [N, J] logprobs of extra_ids
        top1 = torch.zeros(N if with_top1 else 0, dtype=torch.bool, device=hidden.device)  # [N]
        spp = hidden.new_empty(N if with_spp else 0, dtype=torch.float32)  # [N] sum_v p_v^2
        sc = hidden.new_empty(N if with_sc else 0, dtype=torch.float32)  # [N] self-certainty
        logprob = hidden.new_empty(N, dtype=torch.float32)  # [N]
        lse = hidden.new_empty(N, dtype=torch.float32)  # [N]
        entropy = hidden.new_empty(N if with_entropy else 0, dtype=torch.float32)  # [N]
        for i in range(0, N, chunk):
            j = min(i + chunk, N)
            z = head_logits(hidden[i:j], weight, bias, tf)  # [C, V]
            m = z.amax(dim=-1, keepdim=True)  # [C, 1]
            z.sub_(m)  # z - max
            e = z.exp()  # [C, V] unnormalised probabilities
            s = e.sum(dim=-1)  # [C]
            log_s = s.log()
            lse[i:j] = m.squeeze(-1) + log_s
            picked = z.gather(-1, targets[i:j, None]).squeeze(-1)  # z_y - max
            logprob[i:j] = picked - log_s
            if with_top1:  # the sampled token's logit is the largest (a tie counts)
                top1[i:j] = picked == 0
            if topk:  # the chunk's own K most likely tokens, largest first
                extra_ids[i:j, J0:] = z.topk(topk, dim=-1).indices
            if J:
                extra[i:j] = z.gather(-1, extra_ids[i:j]) - log_s[:, None]
            if with_sc:  # lse - mean(z) = log s - mean(z - max): one reduction, no [C, V] buffer
                sc[i:j] = log_s - z.mean(dim=-1)
            if with_spp:  # sum (e / s)^2, no extra [C, V] buffer
                spp[i:j] = torch.linalg.vector_norm(e, dim=-1).div_(s).square_()
            if with_entropy:
                # H = log s - sum(e * (z - max)) / s
                entropy[i:j] = log_s - e.mul_(z).sum(dim=-1) / s
            del z, e
        ctx.chunk = chunk
        ctx.tf = tf
        ctx.with_entropy = with_entropy
        ctx.entropy_grad = entropy_grad and with_entropy
        ctx.has_bias = bias is not None
        ctx.save_for_backward(hidden, weight, bias if bias is not None else hidden.new_empty(0),
                              targets, lse, entropy,
                              extra_ids if J else targets.new_empty((N, 0)))
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.mark_non_differentiable(spp, sc)
        ids = extra_ids[:, J0:].clone() if topk else targets.new_empty((N, 0))  # [N, K]
        ctx.mark_non_differentiable(ids, top1)
        return logprob, entropy, spp, extra, ids, top1, sc

    @staticmethod
    def backward(ctx, g_logprob, g_entropy, g_spp, g_extra, g_ids, g_top1, g_sc):
        hidden, weight, bias, targets, lse, entropy, extra_ids = ctx.saved_tensors
        J = extra_ids.shape[1]
        g_extra = g_extra.float() if (J and g_extra is not None) else None  # [N, J]
        bias = bias if ctx.has_bias else None
        tf: LogitTransform = ctx.tf
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        N = hidden.shape[0]
        g = g_logprob.float() if g_logprob is not None else torch.zeros_like(lse)  # [N]
        # extra logprobs: d / dz = onehot(id_j) - p each, so -p is scaled by g + sum_j g_j
        g_all = g if g_extra is None else g + g_extra.sum(-1)  # [N]
        g_ent = g_entropy.float() if (ctx.entropy_grad and g_entropy is not None) else None  # [N]
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        rows = torch.arange(min(ctx.chunk, N), device=hidden.device)
        chain = tf.scale / tf.temperature  # dz/dx without a cap
        for i in range(0, N, ctx.chunk):
            j = min(i + ctx.chunk, N)
            h = hidden[i:j]  # [C, H]
            z = head_logits(h, weight, bias, tf)  # [C, V]
            t2 = None  # tanh(s x / c)^2 of a soft cap
            if tf.softcap is not None and g_ent is not None:
                t2 = z.mul(tf.temperature / tf.softcap).square_()  # a third buffer: z is consumed
            z.sub_(lse[i:j, None])  # log p
            p = z.exp()  # [C, V]
            if g_ent is None:
                grad_z = p.mul_(-g_all[i:j, None])  # -g p
                if tf.softcap is not None:  # z (log p) is free again: hold t^2 there
                    t2 = z.add_(lse[i:j, None]).mul_(tf.temperature / tf.softcap).square_()
            else:
                grad_z = z.add_(entropy[i:j, None]).mul_(-g_ent[i:j, None]).sub_(g_all[i:j, None]).mul_(p)
                del p
            r = rows[: j - i]
            grad_z[r, targets[i:j]] += g[i:j]  # + g onehot(y): d / dz, z the tempered logits
            if g_extra is not None:
                grad_z.scatter_add_(1, extra_ids[i:j], g_extra[i:j])  # + sum_j g_j onehot(id_j)
            if t2 is not None:
                grad_z.mul_(t2.neg_().add_(1.0).mul_(chain))  # d / dx = d / dz * (s / tau)(1 - t^2)
            elif chain != 1.0:
                grad_z.mul_(chain)  # d / dx = d / dz * s / tau
            gz = grad_z.to(weight.dtype)
            if need_h:
                grad_h[i:j] = gz @ weight
            if need_w:
                grad_w.addmm_(gz.t().float() if gz.dtype != torch.float32 else gz.t(), h.float())
            if need_b:
                grad_b += grad_z.sum(dim=0)
            del z, grad_z, gz, t2
        return (grad_h,
                grad_w.to(weight.dtype) if need_w else None,
                grad_b.to(bias.dtype) if need_b else None,
                None, None, None, None, None, None, None, None, None, None)


def _with_topk_columns(extra_ids: torch.Tensor | None, topk: int, N: int,
                       device: torch.device) -> tuple[torch.Tensor | None, int]:
    """The ids buffer of a head forward: the given ``extra_ids`` [N, J0], then ``topk`` columns
    the chunks fill with their own top-K ids; and J0."""
    J0 = 0 if extra_ids is None else extra_ids.shape[1]
    if not topk:
        return extra_ids, J0
    ids = torch.empty((N, J0 + topk), dtype=torch.long, device=device)
    if J0:
        ids[:, :J0] = extra_ids
    return ids, J0


def response_hidden(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    num_response_tokens: int, group_size: int | None = None) -> torch.Tensor:
    """The backbone's last hidden states [B, Tr, H] that predict the response tokens (each
    group's prompt once when ``group_size`` allows it exactly; module docstring)."""
    B, T = input_ids.shape
    Tr = num_response_tokens
    hidden = None
    if group_size is not None:
        hidden = _shared_prompt_hidden(model, input_ids, attention_mask, Tr, group_size)
    if hidden is None:
        out = backbone(model)(
            input_ids=input_ids[:, : T - 1],  # the last token predicts nothing
            attention_mask=attention_mask[:, : T - 1],
            position_ids=position_ids_from_mask(attention_mask)[:, : T - 1],
            use_cache=False,
        )
        hidden = out.last_hidden_state[:, T - Tr - 1 :]  # [B, Tr, H] states predicting the response
    return hidden


def compiled_body(model: PreTrainedModel) -> torch.nn.Module:
    """The model's backbone under ``torch.compile`` (dynamic shapes), for ``LogprobOptions.body``
    (``model.compile``)."""
    return torch.compile(backbone(model), dynamic=True)


@dataclass
class Forward:
    """What one forward scores: the rows' tokens and what the layers read beside them.

    input_ids        [B, T]  prompt (left padded) then response (right padded), T = Tp + Tr
    attention_mask   [B, T]  1 on real tokens (prompt mask then response mask); positions come
                             from it, as in ``generate``
    response_tokens  Tr, the last columns of each row, scored (0 < Tr < T)
    group_size       rows come in contiguous groups of this many samples of one prompt: the prompt
                     may go through the backbone once per group (module docstring); None, or
                     groups whose prompts differ: every row in full
    routing          [B, T, Y, K] a mixture-of-experts policy's recorded experts of each token,
                     replayed or measured inside ``models.moe.routing`` (padded and packed alike)
    inputs           what the model's kind feeds beside the ids (models/kinds/: its positions and
                     its family's own inputs), asked of the kind once per forward
                     (``ModelKind.forward_inputs``); None: a text model's (positions from the mask)
    gather_ids       [B, Tr, J] tokens whose logprobs are also returned at each position (the
                     policy's logprobs of a teacher's top-k, or of the old policy's top-K ids),
                     from the same chunks, with gradient; padded and packed alike
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_tokens: int
    group_size: int | None = None
    routing: torch.Tensor | None = None
    inputs: ForwardInputs | None = None
    gather_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.inputs is None:
            self.inputs = TextInputs.of(self.attention_mask)

    def to(self, device: torch.device) -> "Forward":
        """The record with its tensors on ``device`` (a sharded trainer's rank)."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)
        return dataclasses.replace(self, input_ids=self.input_ids.to(device),
                                   attention_mask=self.attention_mask.to(device), routing=move(self.routing),
                                   inputs=self.inputs.to(device),
                                   gather_ids=move(self.gather_ids))


@dataclass
class LogprobOptions:
    """How a forward runs and what it returns beyond the logprobs.

    entropy          return the entropy of each position (else ``LogprobOut.entropy`` is None)
    entropy_grad     the entropy carries a gradient (else detached)
    sum_pi_squared   return sum_v softmax(z)_v^2 (detached; the old-policy statistic of
                     `baseline optimal_token`, verl's ``sum_pi_squared``)
    router_aux       return each response token's load-balancing loss (with gradient; that of the
                     token fed at the position predicting it: ``models.moe.balance``), inside
                     ``models.moe.routing`` with ``aux``
    hidden           return the hidden states the head ran on (a divergence over the vocabulary)
    topk             K > 0: also return the K largest logprobs of each position (with gradient
                     when the forward has one) and their token ids, from the same chunks (a
                     ``torch.topk`` of each chunk's logits; ``LogprobOut.top_logprobs``)
    sampled_is_top   also return whether each sampled token is the position's most likely one
    self_certainty   also return logsumexp(z) - mean_v z at each position (detached; Intuitor's
                     self-certainty, from the same chunks' logits z, temperature included)
    prompt_logprobs  also return each group's prompt tokens' logprobs from the shared-prompt
                     forward's own prompt pass (``LogprobOut.prompt_logprobs``, with gradient
                     when the forward has one: its backward joins the prompt pass's, which runs
                     anyway): a caller that scores every position (the Tinker service) needs no
                     second forward for them. Only that layout has them; the others return None
    temperature      the rollout's sampling temperature tau: logprobs and entropies are those of
                     softmax(z / tau), z the logits of the model's own forward (its logit scale
                     and soft cap included; module docstring). Score greedy rollouts at 1
    chunk_size       C, tokens per LM-head chunk
    packing          packed rows of at most ``packing_row_tokens`` tokens (None: the longest
                     sequence's) instead of padded ones (module docstring); a forward that asks
                     for ``hidden`` runs padded (its [B, Tr] layout); ``gather_ids`` are taken at
                     the packed tokens' rows
    body             what runs the backbone in the padded and packed forwards (a compiled copy,
                     ``model.compile``); None: ``backbone(model)``
    count            adds the forward's real and computed tokens to it (throughput metrics)
    """

    entropy: bool = True
    entropy_grad: bool = False
    sum_pi_squared: bool = False
    router_aux: bool = False
    hidden: bool = False
    topk: int = 0
    sampled_is_top: bool = False
    self_certainty: bool = False
    prompt_logprobs: bool = False
    temperature: float = 1.0
    chunk_size: int = 1024
    packing: bool = False
    packing_row_tokens: int | None = None
    body: torch.nn.Module | None = None
    count: TokenCount | None = None


@dataclass
class LogprobOut:
    """What :func:`token_logprobs` returns; values on padded response positions are computed but
    meaningless (0 in a packed forward): mask them.

    logprobs        [B, Tr] fp32, carrying gradients to the model's parameters
    entropy         [B, Tr] fp32 (detached unless ``entropy_grad``); None unless ``entropy``
    sum_pi_squared  [B, Tr] fp32 detached; None unless asked
    gathered        [B, Tr, J] fp32 logprobs of ``Forward.gather_ids``, with gradient; None without
    router_aux      [B, Tr] each response token's load-balancing loss (0 for a dense model); None
                    unless asked
    hidden          [B*Tr, H] the hidden states the head ran on, with gradient; None unless asked
    top_logprobs    [B, Tr, K] fp32 each position's K largest logprobs, largest first, with
                    gradient (the logprobs of ``top_ids``); None unless ``topk``
    top_ids         [B, Tr, K] long, their token ids; None unless ``topk``
    sampled_is_top  [B, Tr] fp32, 1 where the sampled token's logit is the position's largest (a
                    tie counts), else 0; None unless asked
    self_certainty  [B, Tr] fp32 detached, logsumexp(z) - mean_v z; None unless asked
    prompt_logprobs [P, Tp - 1] fp32 with gradient, one row per group (P = B / group_size): column j
                    the logprob of prompt token j + 1 (left padding: meaningless there); None
                    unless asked and the shared-prompt forward ran
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    router_aux: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    sampled_is_top: torch.Tensor | None = None
    self_certainty: torch.Tensor | None = None
    prompt_logprobs: torch.Tensor | None = None


@dataclass
class _States:
    """The hidden states a layout ran to: ``hidden`` [N, H] predicting ``targets`` [N] (N = B*Tr,
    or the M real response tokens of packed rows, put back by ``packed``), the tokens the layers
    ``computed``, ``router_aux`` [B, Tr], and ``shared_group``: the size of the groups whose prompt
    ran once (None: every row's in full); ``prompt_hidden`` [P, Tp - 1, H]: the states
    predicting each group's prompt tokens (``LogprobOptions.prompt_logprobs``)."""

    hidden: torch.Tensor
    targets: torch.Tensor
    computed: int
    router_aux: torch.Tensor | None = None
    packed: PackedRows | None = None
    shared_group: int | None = None
    prompt_hidden: torch.Tensor | None = None


def token_logprobs(model: PreTrainedModel, fwd: Forward, options: LogprobOptions | None = None) -> LogprobOut:
    """Logprobs (and what ``options`` asks beside them) of the last ``fwd.response_tokens`` tokens
    of each row: the backbone in the layout :func:`layout` chooses, then the LM head C tokens at a
    time (``_ChunkedHead``)."""
    opts = options if options is not None else LogprobOptions()
    B, T = fwd.input_ids.shape
    Tr = fwd.response_tokens
    if not 0 < Tr < T:
        raise ValueError(f"num_response_tokens must be in [1, {T - 1}] for T={T}, got {Tr}")
    if fwd.attention_mask.shape != fwd.input_ids.shape:
        raise ValueError(f"attention_mask {tuple(fwd.attention_mask.shape)} != input_ids {tuple(fwd.input_ids.shape)}")
    tf = logit_transform(model, opts.temperature)
    weight, bias = head_weights(model)  # a LoRA adapter on the head included (models/loading.py)
    if opts.topk > weight.shape[0]:
        raise ValueError(f"top-K of {opts.topk} tokens from a vocabulary of {weight.shape[0]}")
    states = layout(model, fwd, opts)()
    if opts.count is not None:
        opts.count.add((fwd.attention_mask.long().sum(1) - 1).tolist(),  # tokens fed: the last predicts nothing
                       states.computed, _distinct(fwd, states))
    extra_ids = None if fwd.gather_ids is None else fwd.gather_ids.reshape(B * Tr, -1)  # [B*Tr, J]
    if extra_ids is not None and states.packed is not None:  # the packed forward's M real tokens' rows
        extra_ids = extra_ids.index_select(0, states.packed.out)  # [M, J]
    logprob, entropy, spp, extra, ids, top1, sc = _ChunkedHead.apply(
        states.hidden, weight, bias, states.targets, opts.chunk_size, opts.entropy, opts.entropy_grad,
        tf, opts.sum_pi_squared, extra_ids, opts.topk, opts.sampled_is_top,
        opts.self_certainty)  # [B*Tr] or [M] each (, J or K)
    if states.packed is not None:  # [M] -> [B, Tr], zeros on padding
        logprob = states.packed.scatter(logprob, B, Tr)
        entropy = states.packed.scatter(entropy, B, Tr) if opts.entropy else entropy
        spp = states.packed.scatter(spp, B, Tr) if opts.sum_pi_squared else spp
        sc = states.packed.scatter(sc, B, Tr) if opts.self_certainty else sc
        extra, ids, top1 = (_scatter_rows(states.packed, t, B * Tr) for t in (extra, ids, top1))
    logprob = logprob.view(B, Tr)  # [B, Tr]
    entropy = entropy.view(B, Tr) if opts.entropy else None  # [B, Tr]
    aux = states.router_aux if states.router_aux is not None else logprob.new_zeros(B, Tr)
    J0 = 0 if fwd.gather_ids is None else fwd.gather_ids.shape[-1]
    prompt = _prompt_logprobs(fwd, states, weight, bias, tf, opts.chunk_size) if opts.prompt_logprobs else None
    return LogprobOut(logprob, entropy if entropy is None or opts.entropy_grad else entropy.detach(),
                      spp.view(B, Tr).detach() if opts.sum_pi_squared else None,
                      extra[:, :J0].reshape(B, Tr, J0) if fwd.gather_ids is not None else None,
                      aux if opts.router_aux else None, states.hidden if opts.hidden else None,
                      **_topk_fields(extra[:, J0:], ids, top1, opts, B, Tr),
                      self_certainty=sc.view(B, Tr).detach() if opts.self_certainty else None,
                      prompt_logprobs=prompt)


def _prompt_logprobs(fwd: Forward, states: _States, weight: torch.Tensor, bias: torch.Tensor | None,
                     tf: LogitTransform, chunk: int) -> torch.Tensor | None:
    """[P, Tp - 1] each group's prompt tokens 1 .. Tp - 1 scored on the states the shared-prompt
    forward's prompt pass left (``LogprobOptions.prompt_logprobs``), by the same chunked head as
    the responses; None when another layout ran."""
    if states.prompt_hidden is None or states.shared_group is None:
        return None
    P, Tq, H = states.prompt_hidden.shape  # Tq = Tp - 1
    targets = fwd.input_ids[::states.shared_group, 1:Tq + 1].reshape(-1)  # [P*Tq]
    lp = _ChunkedHead.apply(states.prompt_hidden.reshape(P * Tq, H), weight, bias, targets, chunk,
                            False, False, tf)[0]
    return lp.view(P, Tq)


def _scatter_rows(packed: PackedRows, t: torch.Tensor, n: int) -> torch.Tensor:
    """A packed forward's [M, ...] per real response token -> [B*Tr, ...], zeros on padding
    (differentiable); an empty statistic ([0]: not asked) stays as it is."""
    if t.shape[0] != packed.out.shape[0]:
        return t
    return t.new_zeros((n,) + tuple(t.shape[1:])).index_copy(0, packed.out, t)


def _topk_fields(top: torch.Tensor, ids: torch.Tensor, top1: torch.Tensor, opts: LogprobOptions,
                 B: int, Tr: int) -> dict[str, torch.Tensor | None]:
    """The policy's top-K fields of a ``LogprobOut``: None unless ``opts`` asked for them."""
    return {"top_logprobs": top.reshape(B, Tr, opts.topk) if opts.topk else None,
            "top_ids": ids.reshape(B, Tr, opts.topk) if opts.topk else None,
            "sampled_is_top": top1.view(B, Tr).float() if opts.sampled_is_top else None}


def layout(model: PreTrainedModel, fwd: Forward, opts: LogprobOptions) -> "partial[_States]":
    """The one choice of a forward's layout (module docstring), as the forward to run (its ``func``
    names the layout):

    - packed whole rows: rows whose kind's inputs are each row's own (``ForwardInputs.whole_rows``,
      models/kinds/), packed as whole sequences;
    - packed: the real tokens end to end, when a packed layout is exact here and pushes fewer
      tokens than the shared-prompt forward (``_packed_layout``);
    - shared prompt: each group's prompt once (padded rows; not through a compiled body: a KV
      cache through it is not tried);
    - padded: every row in full.

    ``hidden`` keeps the padded [B, Tr] layouts, packing or not."""
    packable = opts.packing and not opts.hidden
    if packable and fwd.inputs.whole_rows:
        return partial(_packed_whole, model, fwd, opts)
    if packable:
        rows = _packed_layout(model, fwd.input_ids, fwd.attention_mask, fwd.response_tokens,
                              opts.packing_row_tokens, fwd.group_size)
        if rows is not None:
            return partial(_packed, model, fwd, opts, rows)
    if fwd.group_size is not None and opts.body is None and not fwd.inputs.whole_rows \
            and _shared_prompt_applies(model, fwd.input_ids, fwd.attention_mask, fwd.response_tokens, fwd.group_size):
        return partial(_shared, model, fwd, opts)
    return partial(_padded, model, fwd, opts)


def _body(model: PreTrainedModel, opts: LogprobOptions) -> torch.nn.Module:
    return opts.body if opts.body is not None else backbone(model)


def _packed(model: PreTrainedModel, fwd: Forward, opts: LogprobOptions, rows: PackedRows) -> _States:
    """Packed rows: states [M, H] of the real response tokens only."""
    B, T = fwd.input_ids.shape
    r = fwd.routing
    hidden = packed_hidden(_body(model, opts), rows, None if r is None else r.reshape(B * T, *r.shape[2:]), model)
    aux = moe.balance(model) if opts.router_aux else None  # [R*S]
    return _States(hidden, fwd.input_ids.reshape(-1).index_select(0, rows.target), rows.computed_tokens,
                   None if aux is None else rows.scatter(aux.index_select(0, rows.predictor), B, fwd.response_tokens),
                   packed=rows)


def _packed_whole(model: PreTrainedModel, fwd: Forward, opts: LogprobOptions) -> _States:
    """Rows packed as whole sequences, each with its kind's own inputs (``ForwardInputs.packed``),
    at most ``packing_row_tokens`` tokens a packed row (None: the longest sequence's length, so no
    packed row's attention is larger than a padded row's); states [B, Tr, H], zeros where a row
    has no response token."""
    B, T = fwd.input_ids.shape
    Tr = fwd.response_tokens
    body = _body(model, opts)
    lengths = fwd.attention_mask.long().sum(1).tolist()  # [B] real tokens a row
    prompt_len = fwd.attention_mask[:, : T - Tr].long().sum(1).tolist()  # [B]
    starts = [T - Tr - p for p in prompt_len]  # each row's first real token
    hidden_out, computed = None, 0
    for rows in pack(lengths, opts.packing_row_tokens or max(lengths)):
        if not rows:
            continue
        kwargs, context = fwd.inputs.packed(body, rows, starts, lengths)
        computed += sum(lengths[b] for b in rows)
        with context:
            hidden = body(**kwargs, use_cache=False).last_hidden_state[0]
        if hidden_out is None:
            hidden_out = hidden.new_zeros(B, Tr, hidden.shape[-1])
        offset = 0
        for b in rows:
            r = lengths[b] - prompt_len[b]  # real response tokens
            if r > 0:  # token j of the response is predicted by the state before it
                first = offset + prompt_len[b] - 1
                hidden_out[b, :r] = hidden[first:first + r]
            offset += lengths[b]
    return _row_states(model, fwd, opts, hidden_out, computed)


def _shared(model: PreTrainedModel, fwd: Forward, opts: LogprobOptions) -> _States:
    """Each group's prompt once (``_shared_prompt_forward``; :func:`layout` checked that it is
    exact); the padded forward when the cache did not fill."""
    B, T = fwd.input_ids.shape
    G = fwd.group_size
    assert G is not None
    kept: list[torch.Tensor] | None = [] if opts.prompt_logprobs else None
    hidden = _shared_prompt_forward(model, fwd.input_ids, fwd.attention_mask, fwd.response_tokens, G, kept)
    if hidden is None:  # pragma: no cover - a model that did not fill the cache
        return _padded(model, fwd, opts)
    states = _row_states(model, fwd, opts, hidden, _shared_prompt_tokens(B, T, fwd.response_tokens, G), G)
    states.prompt_hidden = kept[0] if kept else None
    return states


def _padded(model: PreTrainedModel, fwd: Forward, opts: LogprobOptions) -> _States:
    """Every row in full, padded, with its kind's inputs (positions and its family's own)."""
    B, T = fwd.input_ids.shape
    run = _body(model, opts)
    kwargs, context = fwd.inputs.padded(run, T - 1)  # the last token predicts nothing
    r = fwd.routing
    with moe.feeding(model, None if r is None else r[:, : T - 1].reshape(B * (T - 1), *r.shape[2:]),
                     fwd.attention_mask[:, : T - 1]), context:
        out = run(input_ids=fwd.input_ids[:, : T - 1], attention_mask=fwd.attention_mask[:, : T - 1],
                  use_cache=False, **kwargs)
    hidden = out.last_hidden_state[:, T - fwd.response_tokens - 1:]  # [B, Tr, H] states predicting the response
    return _row_states(model, fwd, opts, hidden, B * (T - 1))


def _row_states(model: PreTrainedModel, fwd: Forward, opts: LogprobOptions, hidden: torch.Tensor, computed: int,
                shared_group: int | None = None) -> _States:
    """The states [B, Tr, H] of a padded-shape forward, flattened with their targets [B*Tr]."""
    B, T = fwd.input_ids.shape
    Tr = fwd.response_tokens
    aux = moe.balance(model) if opts.router_aux else None  # [B*(T-1)]
    return _States(hidden.reshape(B * Tr, -1), fwd.input_ids[:, T - Tr:].reshape(B * Tr), computed,
                   None if aux is None else aux.view(B, T - 1)[:, T - Tr - 1:], shared_group=shared_group)


def _distinct(fwd: Forward, states: _States) -> int | None:
    """The distinct tokens a forward fed (train/throughput.py): each packed row's placed ones, each
    group's prompt once; None: every fed token."""
    if states.packed is not None:  # (shared-prompt rows: each prompt once per row holding it)
        return states.packed.placed
    if states.shared_group is None:
        return None
    Tp = fwd.input_ids.shape[1] - fwd.response_tokens
    lengths = fwd.attention_mask.long().sum(1) - 1  # [B]
    prompt = fwd.attention_mask[:, :Tp].long().sum(1)  # [B]
    return int(lengths.sum() - prompt.sum() + prompt[::states.shared_group].sum())


def token_topk(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_response_tokens: int,
    k: int,
    *,
    chunk_size: int = 1024,
    group_size: int | None = None,
    temperature: float = 1.0,
    return_hidden: bool = False,
) -> tuple[torch.Tensor, ...]:
    """No-grad: the logprobs of the response tokens [B, Tr] and the k largest logprobs with their
    token ids [B, Tr, k] at each response position (a teacher's top-k; k = 0: none, [B, Tr, 0]),
    C tokens at a time; with ``return_hidden`` also the hidden states [B, Tr, H], last.

    The logits are transformed as in :func:`token_logprobs` (logit scale, soft cap, temperature).
    """
    B, T = input_ids.shape
    Tr = num_response_tokens
    tf = logit_transform(model, temperature)
    weight, bias = head_weights(model)
    if k > weight.shape[0]:
        raise ValueError(f"top-k of {k} tokens from a vocabulary of {weight.shape[0]}")
    with torch.no_grad():
        hidden = response_hidden(model, input_ids, attention_mask, Tr, group_size).reshape(B * Tr, -1)
        targets = input_ids[:, T - Tr :].reshape(B * Tr)
        lp = hidden.new_empty(B * Tr, dtype=torch.float32)
        top = hidden.new_empty((B * Tr, k), dtype=torch.float32)
        ids = torch.empty((B * Tr, k), dtype=torch.long, device=hidden.device)
        for i in range(0, B * Tr, chunk_size):
            j = min(i + chunk_size, B * Tr)
            z = torch.log_softmax(head_logits(hidden[i:j], weight, bias, tf), dim=-1)  # [C, V]
            lp[i:j] = z.gather(-1, targets[i:j, None]).squeeze(-1)
            if k:
                top[i:j], ids[i:j] = z.topk(k, dim=-1)
            del z
    out = (lp.view(B, Tr), top.view(B, Tr, k), ids.view(B, Tr, k))
    return out + (hidden.view(B, Tr, -1),) if return_hidden else out
