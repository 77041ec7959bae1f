"""Each loss name the Tinker client knows, served as a spec, equals the formula of Tinker's
documentation (tinker-docs.thinkingmachines.ai/tinker/losses, written out below and in
docs/tinker.md) to 1e-6, loss and gradient; any spec by name through loss_fn_config."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from rldsl.errors import UserError
from rldsl.runtime.errors import TinkerRefused
from rldsl.runtime.tinker.losses import compute, resolve_loss

LENGTHS = (5, 3, 7)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = [(-torch.rand(n, generator=g) * 3).requires_grad_(True) for n in LENGTHS]
    inputs = [{"target_tokens": np.zeros(n, dtype=np.int64),
               "weights": torch.rand(n, generator=g).numpy(),
               "logprobs": (t.detach() + 0.4 * torch.randn(n, generator=g)).numpy(),
               "advantages": torch.randn(n, generator=g).numpy(),
               "sequence_ratio_mask": (torch.rand(n, generator=g) > 0.3).float().numpy()}
              for t, n in zip(target, LENGTHS)]
    return target, inputs


# --- Tinker's documented formulas, per datum, summed over the call -----------------------------
def cross_entropy(tl, d, cfg):
    return (-tl * torch.as_tensor(d["weights"])).sum()


def importance_sampling(tl, d, cfg):
    ratio = torch.exp(tl - torch.as_tensor(d["logprobs"]))
    return -(ratio * torch.as_tensor(d["advantages"])).sum()


def ppo(tl, d, cfg):
    adv = torch.as_tensor(d["advantages"])
    ratio = torch.exp(tl - torch.as_tensor(d["logprobs"]))
    clipped = torch.clamp(ratio, cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2))
    return -torch.min(ratio * adv, clipped * adv).sum()


def cispo(tl, d, cfg):
    ratio = torch.exp(tl - torch.as_tensor(d["logprobs"]))
    clipped = torch.clamp(ratio, cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2))
    return -(clipped.detach() * tl * torch.as_tensor(d["advantages"])).sum()


def dro(tl, d, cfg):
    quadratic = (tl - torch.as_tensor(d["logprobs"])) ** 2
    return -(tl * torch.as_tensor(d["advantages"]) - 0.5 * cfg.get("beta", 0.05) * quadratic).sum()


def gspo(tl, d, cfg):
    adv, q = torch.as_tensor(d["advantages"]), torch.as_tensor(d["logprobs"])
    in_ratio = torch.as_tensor(d["sequence_ratio_mask"]) != 0
    log_ratio = (tl.detach() - q)[in_ratio].mean()
    ratio = torch.exp(log_ratio + tl - tl.detach())
    clipped = torch.clamp(ratio, cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2))
    return -(torch.min(ratio * adv, clipped * adv) * in_ratio).sum()


FORMULAS = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo,
            "cispo": cispo, "dro": dro, "gspo": gspo}
CONFIGS = [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}),
           ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}), ("cispo", {}),
           ("cispo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.1}), ("dro", {}), ("dro", {"beta": 0.3}),
           ("gspo", {}), ("gspo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01})]


@pytest.mark.parametrize("name,cfg", CONFIGS)
def test_each_builtin_loss_is_tinkers_formula(name, cfg):
    target, inputs = _batch()
    served, _ = compute(resolve_loss(name, dict(cfg)), target, inputs, None)
    served.backward()
    got = [t.grad.clone() for t in target]
    for t in target:
        t.grad = None
    expected = sum(FORMULAS[name](t, d, cfg) for t, d in zip(target, inputs))
    expected.backward()
    assert float(served) == pytest.approx(float(expected), abs=1e-6)
    for g, t in zip(got, target):
        torch.testing.assert_close(g, t.grad, atol=1e-6, rtol=0)


def test_gspo_clips_whole_sequences():
    """The tight clip must change something here, or the gspo case above proves little."""
    target, inputs = _batch()
    a, _ = compute(resolve_loss("gspo", {}), target, inputs, None)
    b, _ = compute(resolve_loss("gspo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}), target, inputs, None)
    assert abs(float(a) - float(b)) > 1e-3


def test_refused_and_unknown_losses_say_why():
    with pytest.raises(TinkerRefused, match="stable_reinforce.*not served: its formula is not published"):
        resolve_loss("stable_reinforce", {})
    with pytest.raises(TinkerRefused, match="unknown loss 'ppoo'.*rldsl_spec") as e:
        resolve_loss("ppoo", {})
    assert e.value.status == 400
    with pytest.raises(TinkerRefused, match="takes no loss_fn_config \\['beta'\\]"):
        resolve_loss("ppo", {"beta": 1.0})
    with pytest.raises(TinkerRefused, match="clip_low_threshold < 1 < clip_high_threshold"):
        resolve_loss("ppo", {"clip_low_threshold": 1.2})
    with pytest.raises(TinkerRefused, match="rldsl_spec.*='no_such_spec'"):
        resolve_loss("importance_sampling", {"rldsl_spec": "no_such_spec"})
    with pytest.raises(TinkerRefused, match="unknown argument 'hihg' for trust_region clip"):
        resolve_loss("importance_sampling", {"rldsl_spec": "dapo", "trust_region.hihg": 0.3})
    assert not issubclass(TinkerRefused, UserError)  # a request's answer, not a command's exit


def test_a_spec_by_name_runs_with_its_clip_and_warns_of_the_client_slots(caplog):
    target, inputs = _batch(1)
    with caplog.at_level(logging.WARNING, logger="rldsl.tinker"):
        loss = resolve_loss("importance_sampling", {"rldsl_spec": "dapo"})
    assert "baseline, normalizer, shaping, sampling are the client's job" in caplog.text
    value, metrics = compute(loss, target, inputs, None)
    assert "clip_fraction:mean" in metrics and 0 < metrics["clip_fraction:mean"] < 1
    # DAPO: clip(low=0.2, high=0.28), token_mean over the call's sampled tokens
    old = [torch.as_tensor(d["logprobs"]) for d in inputs]
    adv = [torch.as_tensor(d["advantages"]) for d in inputs]
    per_token = torch.cat([torch.max(-a * torch.exp(t - o), -a * torch.clamp(torch.exp(t - o), 0.8, 1.28))
                           for t, o, a in zip(target, old, adv)])
    assert float(value) == pytest.approx(float(per_token.mean()), abs=1e-6)
    # a parameter set as --set sets it; the denominator a client passes replaces the call's count
    wider = resolve_loss("x", {"rldsl_spec": "dapo", "trust_region.high": 5.0})
    assert float(compute(wider, target, inputs, None)[0]) != pytest.approx(float(value), abs=1e-6)
    halved = compute(loss, target, inputs, 2.0 * per_token.numel())[0]
    assert float(halved) == pytest.approx(float(value) / 2, abs=1e-6)


def test_a_mean_spec_is_normalised_over_the_whole_call_not_per_datum():
    target, inputs = _batch(2)
    loss = resolve_loss("x", {"rldsl_spec": "dapo"})
    whole = float(compute(loss, target, inputs, None)[0])
    parts = [float(compute(loss, [t], [d], None)[0]) * len(t) for t, d in zip(target, inputs)]
    assert whole == pytest.approx(sum(parts) / sum(LENGTHS), abs=1e-6)
