"""The correction slot against verl's rollout correction and TRL's vLLM importance sampling
(correction_refs.py), float64 value and gradient; identity when the engine agrees with the
trainer; rejections and IcePop masks zero the gradient exactly where they say."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from component_refs import spec_fn
from correction_refs import trl_corrected, verl_bypass, verl_corrected
from peer_cases import loss_batch

VERL_PPO = "trust_region dual_clip(low=0.2, high=0.28, c=3.0)\n"
TRL_PPO = "ratio token(clamp=80.0)\ntrust_region clip(low=0.2, high=0.2)\naggregation token_mean\n"


def batch(seed: int, nan: bool = False) -> dict:
    b = loss_batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    b["old"] = b["logp"] + 0.1 * torch.randn(b["logp"].shape, generator=g, dtype=torch.float64)
    b["roll"] = b["old"] + 0.3 * torch.randn(b["logp"].shape, generator=g, dtype=torch.float64)
    b["roll"][5, 0] = b["old"][5, 0] - 3.0  # a token the engine found far less likely
    b["roll"][6, 1] = b["old"][6, 1] + 3.0
    if nan:
        b["roll"][0, 0] = float("nan")
    return b


VERL_CASES = [
    ("importance(level=token, high=2.0)", dict(is_kw=dict(rollout_is="token"))),
    ("importance(level=sequence, high=2.0)", dict(is_kw=dict(rollout_is="sequence"))),
    ("importance(level=token, high=2.0, normalize=true)",
     dict(is_kw=dict(rollout_is="token", batch_normalize=True))),
    ("importance(level=sequence, high=2.0, normalize=true)",
     dict(is_kw=dict(rollout_is="sequence", batch_normalize=True))),
    ("importance(level=token, mode=mask, low=0.5, high=5.0)",
     dict(is_kw=dict(rollout_is="token", rollout_is_threshold=5.0, threshold_lower=0.5))),
    ("reject(stat=token_k1, low=0.5, high=2.0)", dict(rs=[dict(rollout_rs="token_k1", threshold=2.0,
                                                               threshold_lower=0.5)])),
    ("reject(stat=token_k3, high=0.05)", dict(rs=[dict(rollout_rs="token_k3", threshold=0.05)])),
    ("reject(stat=seq_sum_k1, low=0.5, high=2.0)", dict(rs=[dict(rollout_rs="seq_sum_k1", threshold=2.0,
                                                                 threshold_lower=0.5)])),
    ("reject(stat=seq_mean_k1, high=1.05)", dict(rs=[dict(rollout_rs="seq_mean_k1", threshold=1.05)])),
    ("reject(stat=seq_sum_k2, high=0.5)", dict(rs=[dict(rollout_rs="seq_sum_k2", threshold=0.5)])),
    ("reject(stat=seq_mean_k3, high=0.05)", dict(rs=[dict(rollout_rs="seq_mean_k3", threshold=0.05)])),
    ("reject(stat=seq_max_k2, high=1.0)", dict(rs=[dict(rollout_rs="seq_max_k2", threshold=1.0)])),
    ("reject(stat=seq_max_k3, high=2.0)", dict(rs=[dict(rollout_rs="seq_max_k3", threshold=2.0)])),
    ("importance(level=sequence, high=2.0), reject(stat=seq_mean_k3, high=0.05)",
     dict(is_kw=dict(rollout_is="sequence"), rs=[dict(rollout_rs="seq_mean_k3", threshold=0.05)])),
]

TRL_CASES = [
    ("importance(level=token, high=3.0, clamp=80.0)", dict(mode="token_truncate")),
    ("importance(level=token, mode=mask, high=3.0, clamp=80.0)", dict(mode="token_mask")),
    ("importance(level=sequence, high=3.0, clamp=80.0)", dict(mode="sequence_truncate")),
    ("importance(level=sequence, mode=mask, high=3.0, clamp=80.0)", dict(mode="sequence_mask")),
    ("importance(level=token, high=3.0, low=0.5, clamp=80.0)", dict(mode="token_truncate", clip_min=0.5)),
    ("importance(level=token, mode=mask, high=3.0, low=0.5, clamp=80.0)", dict(mode="token_mask", clip_min=0.5)),
]


def run(spec: str, b: dict, estimate: bool = True):
    """(loss, d loss / d logp, loss mask) through estimate() -> loss(), as the runtime calls them."""
    fn = spec_fn(spec)
    mask = b["mask"]
    if estimate:
        r = torch.arange(b["mask"].shape[0], dtype=torch.float32)
        mask = fn.estimate(r, 1, b["mask"], old_logprobs=b["old"], rollout_logprobs=b["roll"]).mask
        mask = mask.to(torch.float64)
    lp = b["logp"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], b["adv"], mask, group_size=1, rollout_logprobs=b["roll"])
    (g,) = torch.autograd.grad(out.loss, lp)
    return out, g, mask


def _close(ours, ref, g, g_ref):
    assert abs(ours.item() - ref.item()) <= 1e-7 * max(1.0, abs(ref.item())), (ours.item(), ref.item())
    assert (g - g_ref).abs().max().item() <= 1e-7 * max(1.0, g_ref.abs().max().item())


def _ref_grad(ref, b):
    lp = b["logp"].clone().requires_grad_(True)
    want = ref({**b, "logp": lp})
    (g,) = torch.autograd.grad(want, lp)
    return want.detach(), g


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("line,kw", VERL_CASES, ids=[c[0] for c in VERL_CASES])
def test_verl_rollout_correction(line, kw, seed):
    b = batch(seed)
    out, g, _ = run(VERL_PPO + "correction " + line, b)
    want, g_ref = _ref_grad(lambda bb: verl_corrected(bb, **kw), b)
    _close(out.loss.detach(), want, g, g_ref)
    for k in ("mismatch_kl", "mismatch_k3"):
        assert out.metrics["correction/" + k] == out.metrics["correction/" + k]  # logged, not NaN


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("line,kw", TRL_CASES, ids=[c[0] for c in TRL_CASES])
def test_trl_vllm_importance_sampling(line, kw, seed):
    b = batch(seed, nan=True)
    out, g, _ = run(TRL_PPO + "correction " + line, b, estimate=False)
    want, g_ref = _ref_grad(lambda bb: trl_corrected(bb, **kw), b)
    _close(out.loss.detach(), want, g, g_ref)


BYPASS_CASES = [  # verl rollout_correction.bypass_mode=true, policy_loss.rollout_correction.loss_type
    (VERL_PPO + "correction bypass", dict(loss_type="ppo_clip")),
    (VERL_PPO + "correction bypass, reject(stat=token_k1, low=0.5, high=2.0)",
     dict(loss_type="ppo_clip", rs=[dict(rollout_rs="token_k1", threshold=2.0, threshold_lower=0.5)])),
    (VERL_PPO + "correction bypass, reject(stat=seq_mean_k3, high=0.05)",
     dict(loss_type="ppo_clip", rs=[dict(rollout_rs="seq_mean_k3", threshold=0.05)])),
    ("objective reinforce\naggregation token_mean\ncorrection bypass, importance(level=token, high=2.0)",
     dict(loss_type="reinforce", is_kw=dict(rollout_is="token"))),
    ("objective reinforce\naggregation token_mean\n"
     "correction bypass, importance(level=sequence, high=2.0), reject(stat=seq_max_k2, high=1.0)",
     dict(loss_type="reinforce", is_kw=dict(rollout_is="sequence"), rs=[dict(rollout_rs="seq_max_k2",
                                                                             threshold=1.0)])),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spec,kw", BYPASS_CASES, ids=[c[0].split("correction ")[-1] for c in BYPASS_CASES])
def test_verl_bypass_mode(spec, kw, seed):
    """pi_old := pi_rollout; weights and rejections compare sg(pi_theta) with the engine inside the
    loss (estimate() leaves the mask alone); the old_logprobs given are ignored."""
    b = batch(seed)
    out, g, mask = run(spec, {**b, "old": b["old"] - 7.0})
    assert torch.equal(mask, b["mask"])
    want, g_ref = _ref_grad(lambda bb: verl_bypass(bb, **kw), b)
    _close(out.loss.detach(), want, g, g_ref)
    if "rs" in kw:
        assert out.metrics["correction/rejected_fraction"] > 0


def test_the_cases_bind():
    """The batch truncates, masks and rejects: each case differs from the uncorrected loss."""
    b = batch(0)
    plain = run(VERL_PPO, b, estimate=False)[0].loss.item()
    for line, _ in VERL_CASES:
        out, _, mask = run(VERL_PPO + "correction " + line, b)
        assert out.loss.item() != pytest.approx(plain, rel=1e-6), line
    fn = spec_fn(VERL_PPO + "correction reject(stat=seq_mean_k3, high=0.05)")
    est = fn.estimate(torch.zeros(8), 1, b["mask"], old_logprobs=b["old"], rollout_logprobs=b["roll"])
    assert 0 < est.metrics["correction/rejected_seq_fraction"] < 1  # estimate() sees the rejections
    rows = (b["mask"].sum(-1) > 0) & (est.mask.sum(-1) == 0)
    assert est.metrics["correction/rejected_seq_fraction"] == pytest.approx(
        float(rows.sum() / (b["mask"].sum(-1) > 0).sum()))


def test_metrics():
    b = batch(0)
    out, _, _ = run(VERL_PPO + "correction importance(level=token, high=2.0), "
                    "reject(stat=token_k2, high=1.0)", b, estimate=False)
    m, valid = out.metrics, b["mask"] > 0
    x = (b["old"] - b["roll"])[valid]
    assert m["correction/mismatch_kl"] == pytest.approx(float((-x).mean()), rel=1e-6)
    w = torch.exp(x).clamp(max=2.0)
    assert m["correction/is_max"] == pytest.approx(float(w.max())) and m["correction/is_max"] <= 2.0
    assert m["correction/is_mean"] == pytest.approx(float(w.mean()), rel=1e-6)
    assert m["correction/ess"] == pytest.approx(float(1 / ((w / w.mean()) ** 2).mean()), rel=1e-6)
    assert m["correction/rejected_fraction"] == pytest.approx(float((x * x / 2 > 1.0).double().mean()))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000),
       line=st.sampled_from([c[0] for c in VERL_CASES + TRL_CASES]))
def test_identical_logprobs_make_the_correction_the_identity(seed, line):
    """rollout == old: weights 1 (normalised or not), nothing rejected, the plain loss and gradient."""
    b = batch(seed % 7)
    b["roll"] = b["old"].clone()
    out, g, mask = run(VERL_PPO + "correction " + line, b)
    plain, g0, _ = run(VERL_PPO, b, estimate=False)
    assert torch.equal(mask, b["mask"])
    assert out.loss.item() == pytest.approx(plain.loss.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(g, g0, rtol=1e-12, atol=1e-15)
    assert out.metrics["correction/mismatch_kl"] == 0.0


@pytest.mark.parametrize("line", ["reject(stat=token_k2, high=0.02)", "reject(stat=seq_mean_k1, high=1.2)",
                                  "importance(level=token, mode=mask, low=0.8, high=1.25)"])
def test_masks_zero_the_gradient_exactly_where_they_say(line):
    """objective reinforce: d/dlogp = -A w keep / n, so the gradient is 0 exactly off the kept set."""
    b = batch(2)
    out, g, mask = run("objective reinforce\ncorrection " + line, b)
    x = b["old"] - b["roll"]
    if line.startswith("importance"):
        keep = (torch.exp(x) >= 0.8) & (torch.exp(x) <= 1.25)
    elif "token_k2" in line:
        keep = x * x / 2 <= 0.02
    else:
        seq = -(x * b["mask"]).sum(-1, keepdim=True) / b["mask"].sum(-1, keepdim=True).clamp(min=1)
        keep = ((seq >= torch.log(torch.tensor(1 / 1.2, dtype=x.dtype)))
                & (seq <= torch.log(torch.tensor(1.2, dtype=x.dtype)))).expand_as(x)
    live = keep & (b["mask"] > 0) & (b["adv"] != 0)
    assert 0 < int(live.sum()) < int((b["mask"] > 0).sum())
    assert torch.equal(g != 0, live)


def test_compiled_equals_eager():
    b = {k: (v.float() if torch.is_tensor(v) else v) for k, v in batch(3).items()}
    spec = VERL_PPO + "correction importance(level=sequence, high=2.0, normalize=true), " \
                      "reject(stat=token_k3, high=0.05)"
    ours = []
    for compile in (False, True):
        fn = spec_fn(spec, name="cc", compile=compile)
        lp = b["logp"].clone().requires_grad_(True)
        out = fn.loss(lp, b["old"], b["adv"], b["mask"], rollout_logprobs=b["roll"])
        (g,) = torch.autograd.grad(out.loss, lp)
        ours.append((out.loss.detach(), g, out.metrics))
    (l0, g0, m0), (l1, g1, m1) = ours
    assert torch.allclose(l0, l1, rtol=1e-5) and torch.allclose(g0, g1, rtol=1e-4, atol=1e-7)
    assert m0.keys() == m1.keys() and all(m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-6) for k in m0)


def test_missing_inputs_are_named():
    b = batch(0)
    fn = spec_fn("correction reject(stat=token_k3, high=0.05)")
    with pytest.raises(ValueError, match="rollout_logprobs= for correction reject"):
        fn.loss(b["logp"], b["old"], b["adv"], b["mask"])
    with pytest.raises(ValueError, match="needs old_logprobs= for correction reject"):
        fn.estimate(torch.zeros(8), 1, b["mask"], rollout_logprobs=b["roll"])
    # without rollout logprobs estimate() leaves the mask alone (the loss applies the rejections)
    assert torch.equal(fn.estimate(torch.zeros(8), 1, b["mask"]).mask, b["mask"].float())
