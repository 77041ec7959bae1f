"""The ``jsd`` component's divergence of the student from a teacher over the whole vocabulary,
per token, without the [N, V] logits of both models at once: the plumbing only. The formula is
``rldsl.components.distill.generalized_jsd_of_logits``; here it runs on C tokens at a time.

Shapes: N tokens, V vocabulary, H the student's hidden size (the teacher's may differ), C =
``chunk`` tokens. Each model's logits are z = transform(h W^T + b) (its logit scale and soft
cap, then divided by the temperature, as ``token_logprobs`` takes them; ``logprobs.head_logits``).

``chunked_generalized_jsd`` runs the heads C tokens at a time under activation checkpointing:
a chunk's two [C, V] logits exist only while that chunk is computed (forward, then again in
backward), so memory grows with C, not with N; the gradient reaches the student's hidden states
and head, never the teacher's. ``rldsl.components.distill.generalized_jsd`` is the same
divergence from full logits (the naive reference; bench/distill_jsd.py measures both).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rldsl.components.distill import check_beta, generalized_jsd_of_logits

from .logprobs import LogitTransform, head_logits


def chunked_generalized_jsd(student_hidden: Tensor, student_weight: Tensor, student_bias: Tensor | None,
                            teacher_hidden: Tensor, teacher_weight: Tensor, teacher_bias: Tensor | None,
                            beta: float, *, student_tf: LogitTransform = LogitTransform(),
                            teacher_tf: LogitTransform = LogitTransform(), chunk: int = 1024) -> Tensor:
    """D per token [N] from the hidden states ([N, H_s], [N, H_t]) and LM heads ([V, H] weights,
    [V] biases or None) of both models, C = ``chunk`` tokens at a time (module docstring). The
    transforms carry each model's logit scale and soft cap and the temperature (the same for both)."""
    beta = check_beta(beta)
    if student_tf.temperature != teacher_tf.temperature:
        raise ValueError("the student's and the teacher's logits take the same temperature")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"the student's vocabulary has {student_weight.shape[0]} tokens and the teacher's "
                         f"{teacher_weight.shape[0]}: the divergence compares one vocabulary")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")

    def one(h_s: Tensor, w_s: Tensor, b_s: Tensor | None, h_t: Tensor) -> Tensor:
        z_s = head_logits(h_s, w_s, b_s, student_tf)  # [C, V]
        with torch.no_grad():
            z_t = head_logits(h_t, teacher_weight, teacher_bias, teacher_tf)  # [C, V]
        return generalized_jsd_of_logits(z_s, z_t, beta)

    out = []
    grad = torch.is_grad_enabled() and (student_hidden.requires_grad or student_weight.requires_grad)
    for i in range(0, student_hidden.shape[0], chunk):
        args = (student_hidden[i:i + chunk], student_weight, student_bias, teacher_hidden[i:i + chunk])
        out.append(checkpoint(one, *args, use_reentrant=False) if grad else one(*args))
    if not out:
        return student_hidden.new_zeros(0)
    return torch.cat(out)
