"""The generalized JSD over the full vocabulary (runtime/train/divergence.py), exact against TRL
1.16's DistillationTrainer: its own ``_chunked_divergence_loss`` (float32 inside, so compared in
float32) and a float64 transcription (peer_refs.trl_generalized_jsd_loss), value and gradient;
chunked = naive at several chunk sizes; a teacher equal to the student gives 0 and no gradient."""
from __future__ import annotations

import pytest
import torch

import peer_refs as ref
from rldsl.components.distill import generalized_jsd
from rldsl.runtime.train.divergence import chunked_generalized_jsd
from rldsl.runtime.train.logprobs import LogitTransform

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def _models(seed: int, dtype=torch.float64, N: int = 13, V: int = 37, Hs: int = 8, Ht: int = 12):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    return dict(hs=r(N, Hs), ws=r(V, Hs, scale=0.7), bs=r(V, scale=0.3), ht=r(N, Ht), wt=r(V, Ht, scale=0.7),
                bt=r(V, scale=0.3))


def _grads(loss, *xs):
    return torch.autograd.grad(loss, xs)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_equals_trl_transcription_in_float64(beta, temperature):
    m = _models(0)
    mask = (torch.arange(13) % 4 != 3).to(torch.float64)
    hs, ws = m["hs"].clone().requires_grad_(), m["ws"].clone().requires_grad_()
    tf = LogitTransform(temperature=temperature)
    d = chunked_generalized_jsd(hs, ws, m["bs"], m["ht"], m["wt"], m["bt"], beta, student_tf=tf, teacher_tf=tf, chunk=4)
    ours = (d * mask).sum() / mask.sum()
    hs2, ws2 = m["hs"].clone().requires_grad_(), m["ws"].clone().requires_grad_()
    peer = ref.trl_generalized_jsd_loss(hs2 @ ws2.T + m["bs"], m["ht"] @ m["wt"].T + m["bt"], mask, beta, temperature)
    torch.testing.assert_close(ours, peer, rtol=0, atol=1e-6)
    for a, b in zip(_grads(ours, hs, ws), _grads(peer, hs2, ws2)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_equals_trl_chunked_divergence_loss(beta, temperature):
    """TRL's own function projects in float32 tiles: compared at float32 round-off."""
    trl = pytest.importorskip("trl.trainer.distillation_trainer")
    m = _models(1, torch.float32, N=12)
    mask = (torch.arange(12) % 5 != 4).reshape(3, 4).float()
    hs, ws = m["hs"].clone().requires_grad_(), m["ws"].clone().requires_grad_()
    loss, _, _ = trl._chunked_divergence_loss(hs.reshape(3, 4, -1), m["ht"].reshape(3, 4, -1), ws, m["wt"], mask,
                                              beta, student_lm_head_bias=m["bs"], teacher_lm_head_bias=m["bt"],
                                              temperature=temperature)
    hs2 = m["hs"].double().requires_grad_()
    ws2 = m["ws"].double().requires_grad_()
    tf = LogitTransform(temperature=temperature)
    d = chunked_generalized_jsd(hs2, ws2, m["bs"].double(), m["ht"].double(), m["wt"].double(), m["bt"].double(),
                                beta, student_tf=tf, teacher_tf=tf, chunk=5)
    ours = (d * mask.reshape(-1).double()).sum() / mask.sum()
    torch.testing.assert_close(ours.float(), loss.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(_grads(ours, hs2, ws2), _grads(loss, hs, ws)):
        torch.testing.assert_close(a.float(), b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("chunk", [1, 3, 7, 13, 100])
def test_chunked_equals_naive(beta, chunk):
    m = _models(2)
    w = torch.rand(13, dtype=torch.float64)
    a = [m[k].clone().requires_grad_() for k in ("hs", "ws", "bs")]
    d = chunked_generalized_jsd(*a, m["ht"], m["wt"], m["bt"], beta, chunk=chunk)
    b = [m[k].clone().requires_grad_() for k in ("hs", "ws", "bs")]
    naive = generalized_jsd(b[0] @ b[1].T + b[2], m["ht"] @ m["wt"].T + m["bt"], beta)
    torch.testing.assert_close(d, naive.detach(), rtol=0, atol=1e-12)
    for x, y in zip(_grads((d * w).sum(), *a), _grads((naive * w).sum(), *b)):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", BETAS)
def test_teacher_equal_to_student_gives_zero_and_no_gradient(beta):
    m = _models(3)
    hs, ws = m["hs"].clone().requires_grad_(), m["ws"].clone().requires_grad_()
    d = chunked_generalized_jsd(hs, ws, m["bs"], m["hs"], m["ws"], m["bs"], beta, chunk=5)
    assert float(d.detach().abs().max()) < 1e-12
    for g in _grads(d.sum(), hs, ws):
        assert float(g.abs().max()) < 1e-12


def test_bad_arguments_are_refused():
    m = _models(4)
    with pytest.raises(ValueError, match=r"beta must be a number in \[0, 1\]"):
        chunked_generalized_jsd(m["hs"], m["ws"], None, m["ht"], m["wt"], None, 1.5)
    with pytest.raises(ValueError, match="vocabulary has 37 tokens and the teacher's 36"):
        chunked_generalized_jsd(m["hs"], m["ws"], None, m["ht"], m["wt"][:36], None, 0.5)
