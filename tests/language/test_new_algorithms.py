"""The language's own test on new algorithms (docs/new_algorithms.md).

Eleven RL-for-LLM policy-optimization methods published since June 2025 that the library had no
component for, each written as a spec from docs/ alone (algorithms/examples/<name>.rl), checked
here against an independent reference transcribed from the authors' released code (file and commit
in each reference's docstring) on one fixed batch, eager and compiled (the compiled twin of each
spec built once per session, marked slow): the advantages (estimate(), float32 stage) and
the loss mask to 1e-6, the loss and its gradient (float64, through the logits, so a spec reading
the entropy gets the entropy's gradient too) to 1e-6. No model, no training: a few compiled specs
(eager) and hand-made tensors.

The batch: 4 prompts x G = 4 answers, right-padded responses of 3..10 tokens over a vocabulary of
6, binary rewards with a hard group (1 of 4 right), an easy one (3 of 4), a mixed one and one all
right (zero variance); old and reference logits perturbed from the current ones so that ratios
fall on both sides of every clip range used (Pass@k Training: the same rows as 2 groups of 8).
"""
from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest
import torch

import rldsl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "algorithms" / "examples"
G = 4
TOL = 1e-6
DT = torch.float64


_BUILT: dict = {}


#: The modes a check runs in. This first round runs eager in the suite: its compiled twin (18
#: compiled specs, M2PO's budgets three of them) took ~9 minutes of the suite's time on 2 cores;
#: ``RLDSL_NEW_ALGORITHMS_COMPILED=1`` adds it. The second round (test_new_algorithms_2.py) runs
#: both modes always.
EAGER_AND_COMPILED = ["eager", pytest.param("compiled", marks=[pytest.mark.compile, pytest.mark.slow])]
MODES = EAGER_AND_COMPILED if os.environ.get("RLDSL_NEW_ALGORITHMS_COMPILED") == "1" else ["eager"]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """A check runs on the eager spec (and on its torch.compile'd twin where MODES says so:
    compiled once per session and reused; tests marked ``compile`` run with torch.compile where
    RLDSL_COMPILE allows it)."""
    return request.param


def _spec(name: str, mode: str = "eager", **replace: str):
    key = (name, mode, tuple(sorted(replace.items())))
    if key not in _BUILT:
        text = (EXAMPLES / f"{name}.rl").read_text()
        for old, new in replace.items():
            assert old in text, old
            text = text.replace(old, new)
        fn = rldsl.compile(rldsl.loads(text, filename=f"{name}.rl"), compile=mode == "compiled")
        assert fn.compiled == (mode == "compiled")
        _BUILT[key] = fn
    return _BUILT[key]


def _batch(seed: int = 0, spread: float = 0.5) -> dict:
    g = torch.Generator().manual_seed(seed)
    B, T, V = 4 * G, 10, 6
    z = 1.5 * torch.randn(B, T, V, generator=g, dtype=DT)
    z_old = z + spread * torch.randn(B, T, V, generator=g, dtype=DT)
    z_ref = z + 0.3 * torch.randn(B, T, V, generator=g, dtype=DT)
    y = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([3, 7, 10, 5, 9, 4, 6, 10, 8, 3, 5, 7, 10, 6, 4, 9])
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).to(DT)
    r = torch.tensor([1, 0, 0, 0, 1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 1, 1], dtype=DT)
    return dict(z=z, z_old=z_old, z_ref=z_ref, y=y, mask=mask, r=r)


def _logp_ent(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lsm = torch.log_softmax(z, -1)
    return lsm.gather(-1, y.unsqueeze(-1)).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


def _old_ref(b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return _logp_ent(b["z_old"], b["y"])[0], _logp_ent(b["z_ref"], b["y"])[0]


def grpo_adv(r: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6, center=None) -> torch.Tensor:
    """verl compute_grpo_outcome_advantage (norm_adv_by_std_in_grpo=True): per prompt group,
    (score - mean) / (std + eps), torch.std (Bessel); ``center`` replaces the mean (QAE)."""
    out = torch.empty_like(r)
    for p in range(r.shape[0] // G):
        s = r[p * G:(p + 1) * G]
        m = torch.mean(s) if center is None else center(s)
        out[p * G:(p + 1) * G] = (s - m) / (torch.std(s) + eps)
    return out.unsqueeze(-1) * mask


def verl_vanilla(logp, old, adv, mask, low, high, c=None):  # noqa: ANN001, ANN201
    """verl compute_policy_loss_vanilla: |log ratio| <= 20, PPO clip, dual clip c (None: off)."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(pg1, pg2)
    if c is None:
        return clip1
    return torch.where(adv < 0, torch.min(-adv * c, clip1), clip1)


def token_mean(x, mask):  # noqa: ANN001, ANN201
    return (x * mask).sum() / mask.sum()


def _check(fn, b: dict, adv: torch.Tensor, reference, *, ref_kl: bool = False) -> tuple[float, float]:
    """The spec's loss and gradient (w.r.t. the logits) against ``reference(logp, ent, old, ref,
    adv, mask)``; returns the two differences."""
    old, ref = _old_ref(b)
    z = b["z"].clone().requires_grad_(True)
    logp, ent = _logp_ent(z, b["y"])
    kw = {}
    needs = set(fn.algorithm.needs("loss"))
    if "entropy" in needs:
        kw["entropy"] = ent
    if "ref_logprobs" in needs:
        kw["ref_logprobs"] = ref
    if "sequence_rewards" in needs:
        kw["sequence_rewards"] = b["r"]
    out = fn.loss(logp, old, adv, b["mask"], group_size=G, **kw)
    (grad,) = torch.autograd.grad(out.loss, z)
    z2 = b["z"].clone().requires_grad_(True)
    logp2, ent2 = _logp_ent(z2, b["y"])
    want = reference(logp2, ent2, old, ref, adv, b["mask"])
    (grad_ref,) = torch.autograd.grad(want, z2)
    d_loss = abs(float(out.loss.detach()) - float(want.detach()))
    d_grad = float((grad - grad_ref).abs().max())
    assert d_loss < TOL, (float(out.loss), float(want))
    assert d_grad < TOL
    assert float(grad_ref.abs().max()) > 1e-3  # the gradient is not trivially zero
    return d_loss, d_grad


def _check_adv(fn, b: dict, want: torch.Tensor) -> torch.Tensor:
    est = fn.estimate(b["r"].float(), G, b["mask"].float())
    torch.testing.assert_close(est.advantages.double(), want, rtol=0, atol=TOL)
    torch.testing.assert_close(est.mask.double(), b["mask"], rtol=0, atol=0)
    return want


def _differs(b: dict, adv: torch.Tensor, ref_a, ref_b) -> float:
    """How far two references' gradients lie apart on this batch: the method's own piece must
    matter here (else the check above would pass for the plain method too)."""
    old, ref = _old_ref(b)
    grads = []
    for f in (ref_a, ref_b):
        z = b["z"].clone().requires_grad_(True)
        lp, ent = _logp_ent(z, b["y"])
        grads.append(torch.autograd.grad(f(lp, ent, old, ref, adv, b["mask"]), z)[0])
    return float((grads[0] - grads[1]).abs().max())


# ------------------------------------------------------------------ 1. W-REINFORCE


def w_reinforce_reference(logp, ent, old, ref, adv, mask, clip=0.2, entropy_coeff=0.001):  # noqa: ANN001, ANN201
    """github.com/TianHongZXY/RLVR-Decomposed @ a5d4e7c, verl/trainer/ppo/core_algos.py
    compute_policy_loss (positive_learning_weight=None: masked_mean(max(pg, pg_clipped))) and
    verl/workers/actor/dp_actor.py: policy_loss = pg_loss - masked_mean(entropy) * entropy_coeff
    (ppo_trainer.yaml entropy_coeff 0.001, clip_ratio 0.2, use_kl_loss False)."""
    ratio = torch.exp(logp - old)
    pg = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip))
    return token_mean(pg, mask) - token_mean(ent, mask) * entropy_coeff


def w_reinforce_adv(r, mask, lam=0.1):  # noqa: ANN001, ANN201
    """Same file, compute_psr_nsr_outcome_advantage(advantage='weighted', gamma=1): the returns
    (the outcome reward on every response token), times lam where the score is 1, minus 1 where
    it is 0."""
    A = r.clone()
    A[r == 1] *= lam
    A[r == 0] -= 1
    return A.unsqueeze(-1) * mask


def test_w_reinforce(mode: str) -> None:
    fn, b = _spec("w_reinforce", mode), _batch(1)
    adv = _check_adv(fn, b, w_reinforce_adv(b["r"], b["mask"]))
    _check(fn, b, adv, w_reinforce_reference)
    no_bonus = lambda *a: w_reinforce_reference(*a, entropy_coeff=0.0)  # noqa: E731
    assert _differs(b, adv, w_reinforce_reference, no_bonus) > 2 * TOL  # the 0.001 entropy bonus is seen


# ------------------------------------------------------------------ 2. QAE


def test_qae_quantile_baseline(mode: str) -> None:
    """github.com/junkangwu/QAE (README "One-Line Core Change", verl core_algos.py
    compute_grpo_outcome_advantage): id2mean[idx] = torch.quantile(scores, quantile_k), K = 0.4,
    then verl's (score - baseline) / (std + 1e-6); the loss is verl's DAPO recipe (clip 0.2 / 0.28,
    clip_ratio_c 10, token mean)."""
    fn, b = _spec("qae", mode), _batch(2)
    adv = _check_adv(fn, b, grpo_adv(b["r"], b["mask"], center=lambda s: torch.quantile(s, 0.4)))
    # the quantile baseline differs from the mean: a hard group reinforces its one success only
    assert (adv[:G].abs().sum(-1) > 0).sum() == 1
    _check(fn, b, adv, lambda lp, e, o, rf, a, m: token_mean(verl_vanilla(lp, o, a, m, 0.2, 0.28, 10.0), m))


# ------------------------------------------------------------------ 3. CE-GPPO and 4. GPPO


def ce_gppo_reference(logp, ent, old, ref, adv, mask, low=0.2, high=0.2, beta1=0.5, beta2=1.0, c=10.0,
                      r=None, positive_loss_coeff=0.1):  # noqa: ANN001, ANN201
    """github.com/Kwai-Klear/KlearReasoner @ 3422f6d, verl/trainer/ppo/core_algos.py
    compute_gppo_loss_general_beta (the loss of github.com/Kwai-Klear/CE-GPPO's
    1_5B_perf_run_gppo_v1_beta1_05_beta2_1_ours_math.sh: loss_func gppo_general, beta1 0.5,
    beta2 1.0, clip 0.2 / 0.2, clip_ratio_c 10, token mean), plus the script's positive_loss_coeff
    0.1 NLL on correct answers (:func:`positive_loss`)."""
    ratio = torch.exp(logp - old)
    ratio_detached = ratio.detach()
    low_mask = (ratio < (1 - low)) & (adv < 0)
    high_mask = (ratio > (1 + high)) & (adv > 0)
    other_mask = ~(low_mask | high_mask)
    clip1 = torch.zeros_like(adv)
    clip1[low_mask] = -beta1 * (1 - low) / ratio_detached[low_mask] * ratio[low_mask] * adv[low_mask]
    clip1[high_mask] = -beta2 * (1 + high) / ratio_detached[high_mask] * ratio[high_mask] * adv[high_mask]
    clip1[other_mask] = -ratio[other_mask] * adv[other_mask]
    pg = torch.where(adv < 0, torch.min(-adv * c, clip1), clip1)
    return token_mean(pg, mask) + positive_loss_coeff * positive_loss(logp, mask, r)


def positive_loss(logp, mask, r, correct_score=1.0):  # noqa: ANN001, ANN201
    """KlearReasoner @ 3422f6d, verl/workers/actor/dp_actor.py update_policy: the answers whose
    reward (token_level_rewards summed) equals scoring_config.correct_score (1.0,
    verl/utils/reward_score/reward_config.py); agg_loss(-log_prob over them, token-mean); 0 when
    none is correct. The scripts add positive_loss_coeff (0.1) times it to the policy loss."""
    right = r == correct_score
    if not bool(right.any()):
        return torch.zeros((), dtype=logp.dtype)
    return token_mean(-logp[right], mask[right])


def gppo_reference(logp, ent, old, ref, adv, mask, low=0.2, high=0.28, c=10.0, r=None,
                   positive_loss_coeff=0.1):  # noqa: ANN001, ANN201
    """github.com/Kwai-Klear/KlearReasoner @ 3422f6d, verl/trainer/ppo/core_algos.py
    compute_gppo_loss (only_high False; recipe/dapo/perf_run_dapo_ours_math.sh: clip 0.2 / 0.28,
    clip_ratio_c 10, token mean); as CE-GPPO, with the script's positive_loss_coeff NLL term.
    As released the function tests an undefined name `only_higher` (a NameError when called); read
    here as its parameter only_high = False."""
    ratio = torch.exp(logp - old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, (1 - low) / ratio.detach() * ratio, (1 + high) / ratio.detach() * ratio)
    clip1 = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.min(-adv * c, clip1), clip1)
    return token_mean(pg, mask) + positive_loss_coeff * positive_loss(logp, mask, r)


def _clipped_share(b: dict, low: float, high: float) -> float:
    old, _ = _old_ref(b)
    lr = _logp_ent(b["z"], b["y"])[0] - old
    rho = torch.exp(lr)[b["mask"] > 0]
    return float(((rho < 1 - low) | (rho > 1 + high)).double().mean())


def test_ce_gppo(mode: str) -> None:
    fn, b = _spec("ce_gppo", mode), _batch(3)
    adv = _check_adv(fn, b, grpo_adv(b["r"], b["mask"]))
    assert _clipped_share(b, 0.2, 0.2) > 0.2  # the preserved gradients matter
    _check(fn, b, adv, partial(ce_gppo_reference, r=b["r"]))
    # the NLL on correct answers is part of it: without it the spec's loss would be off
    assert _differs(b, adv, partial(ce_gppo_reference, r=b["r"]), partial(ce_gppo_reference, r=b["r"], positive_loss_coeff=0.0)) > 1e-3
    # against PPO's clip the gradient differs: the clipped tokens keep theirs
    z = b["z"].clone().requires_grad_(True)
    lp, _ = _logp_ent(z, b["y"])
    old, _ = _old_ref(b)
    (g_ppo,) = torch.autograd.grad(token_mean(verl_vanilla(lp, old, adv, b["mask"], 0.2, 0.2, 10.0), b["mask"]), z)
    z2 = b["z"].clone().requires_grad_(True)
    lp2, _ = _logp_ent(z2, b["y"])
    (g_ce,) = torch.autograd.grad(ce_gppo_reference(lp2, None, old, None, adv, b["mask"], r=b["r"], positive_loss_coeff=0.0), z2)
    assert float((g_ppo - g_ce).abs().max()) > 1e-3


def test_gppo(mode: str) -> None:
    fn, b = _spec("gppo", mode), _batch(4)
    adv = _check_adv(fn, b, grpo_adv(b["r"], b["mask"]))
    _check(fn, b, adv, partial(gppo_reference, r=b["r"]))
    assert _differs(b, adv, partial(gppo_reference, r=b["r"]), partial(gppo_reference, r=b["r"], positive_loss_coeff=0.0)) > 1e-3
    ppo = lambda lp, e, o, rf, a, m: token_mean(verl_vanilla(lp, o, a, m, 0.2, 0.28, 10.0), m)  # noqa: E731
    assert _differs(b, adv, partial(gppo_reference, r=b["r"], positive_loss_coeff=0.0), ppo) > 1e-3


# ------------------------------------------------------------------ 5. Delta-L Normalization


def delta_l_adv(r, mask, alpha=0.75, eps=1e-6):  # noqa: ANN001, ANN201
    """github.com/zerolllin/Delta-L-Normalization @ 89da5b9, verl/trainer/ppo/core_algos.py
    compute_grpo_outcome_advantage(use_grpopp=True, grpopp_config.alpha=0.75): GRPO scores times
    (1 / (L_i / mean L)^alpha) / mean_j (1 / (L_j / mean L)^alpha), lengths and means in Python
    floats over the whole batch."""
    A = grpo_adv(r, torch.ones_like(mask[:, :1]), eps).squeeze(-1)
    lengths = mask.sum(dim=1).tolist()
    mean_length = float(sum(lengths) / len(lengths))
    recip = [1 / ((length / mean_length) ** alpha) for length in lengths]
    recip_mean = float(sum(recip) / len(recip))
    scale = torch.tensor([x / recip_mean for x in recip], dtype=DT)
    return (A * scale).unsqueeze(-1) * mask


def delta_l_reference(logp, ent, old, ref, adv, mask):  # noqa: ANN001, ANN201
    """Same file, compute_policy_loss with use_grpopp: verl's dual clip (clip 0.2 / 0.3,
    clip_ratio_c 10 as recipe/dapo/math-dapo-3b-delta-L-norm-alpha-0.75.sh), then
    verl_F.masked_mean_allavg = (values * mask).mean() over all B * T entries."""
    pg = verl_vanilla(logp, old, adv, mask, 0.2, 0.3, 10.0)
    return (pg * mask).mean()


def test_delta_l_normalization(mode: str) -> None:
    fn, b = _spec("delta_l_norm", mode), _batch(5)
    adv = _check_adv(fn, b, delta_l_adv(b["r"], b["mask"]))
    _check(fn, b, adv, delta_l_reference)
    assert float((adv - grpo_adv(b["r"], b["mask"])).abs().max()) > 0.1  # the length weights act


# ------------------------------------------------------------------ 6. DCPO (its clipping)


def dcpo_reference(logp, ent, old, ref, adv, mask, eps_low=0.16, eps_high=0.2, c=3.0):  # noqa: ANN001, ANN201
    """github.com/lime-RL/DCPO @ 01787b0, verl/trainer/ppo/core_algos.py get_clip_low_high and
    compute_policy_loss_dcpo(clip_type="dynamic", clip_ratio_c=3.0), token mean."""
    ref_prob = torch.exp(old)
    low_c_ref = torch.where(ref_prob != 0, 4 * eps_low / (ref_prob), 0)
    low_c_ref = 1 - low_c_ref
    low_c_ref = low_c_ref * (low_c_ref >= 0)
    high_c_ref = torch.where(ref_prob != 0, 1 + 4 * eps_high / ref_prob, float("inf"))
    lo = (1 + torch.sqrt(low_c_ref)) / 2
    hi = torch.clamp((1 + torch.sqrt(high_c_ref)) / 2, 0, max(c, 10))
    ratio = torch.exp(logp - old)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, lo, hi)
    clip1 = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.min(-adv * c, clip1), clip1)
    return token_mean(pg, mask)


def test_dcpo_dynamic_adaptive_clipping(mode: str) -> None:
    fn, b = _spec("dcpo", mode), _batch(6, spread=0.8)
    adv = _check_adv(fn, b, grpo_adv(b["r"], b["mask"]))
    _check(fn, b, adv, dcpo_reference)
    fixed = lambda lp, e, o, rf, a, m: token_mean(verl_vanilla(lp, o, a, m, 0.16, 0.2, 3.0), m)  # noqa: E731
    assert _differs(b, adv, dcpo_reference, fixed) > 1e-3  # the bounds move with pi_old


# ------------------------------------------------------------------ 7. BAPO


def bapo_reference(logp, ent, old, ref, adv, mask, low=0.8, low_max=0.95, low_step=0.05, high=1.2,  # noqa: ANN001, ANN201, PLR0913
                   high_max=2.0, high_step=0.1, target=0.5, eps=1e-8, c=3.0, found=None):
    """github.com/WooooDyy/BAPO @ 3b8389c, recipe/bapo/policy_loss.py compute_policy_loss_bapo and
    _compute_effective_advantage (one rank), with recipe/bapo/run_bapo_example.sh's bounds: low
    0.8 -> 0.95 step 0.05, high 1.2 -> 2.0 step 0.1, target 0.5; eps 1e-8, clip_ratio_c 3."""
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))

    def pos_neg(lo: float, hi: float) -> float:
        eff = torch.where(adv >= 0, torch.minimum(ratio, ratio.new_tensor(hi)),
                          torch.maximum(ratio, ratio.new_tensor(lo))).detach() * adv * mask
        pos, neg = eff.clamp(min=0).sum(), (-eff.clamp(max=0)).sum()
        return float("inf") if bool(neg <= 0) else float(pos / (neg + eps))

    pn = pos_neg(low, high)
    while pn < target and low < low_max:
        low = min(low + low_step, low_max)
        pn = pos_neg(low, high)
    while pn < target and high < high_max:
        high = min(high + high_step, high_max)
        pn = pos_neg(low, high)
    if found is not None:
        found.append((low, high))
    pg1 = -adv * ratio
    clip1 = torch.maximum(pg1, -adv * torch.clamp(ratio, low, high))
    pg = torch.where(adv < 0, torch.min(-adv * c, clip1), clip1)
    return token_mean(pg, mask)


@pytest.mark.parametrize("tilt,pair", [(0.0, (0.8, 1.2)), (-0.02, (0.95, 1.4)), (-0.04, (0.95, 1.7)),
                                        (-0.6, (0.95, 2.0))])
def test_bapo_searched_clip_bounds(mode: str, tilt: float, pair: tuple) -> None:
    """Batches whose search ends at different pairs: the first, two after the lower bound's and
    some of the upper bound's steps, and (tilted to negative advantages) the last pair, where the
    condition never holds. (Raising the lower bound only adds negative contribution, so the
    authors' search never stops inside its first loop but at its first pair.)"""
    fn, b = _spec("bapo", mode), _batch(7, spread=0.6)
    adv = _check_adv(fn, b, grpo_adv(b["r"], b["mask"]))
    adv = adv + tilt * b["mask"]  # the loss's own check: a batch leaning to one sign
    found: list = []
    old, _ = _old_ref(b)
    bapo_reference(_logp_ent(b["z"], b["y"])[0].detach(), None, old, None, adv, b["mask"], found=found)
    assert found[0] == (pytest.approx(pair[0]), pytest.approx(pair[1]))
    _check(fn, b, adv, bapo_reference)


# ------------------------------------------------------------------ 8. ASPO


def aspo_reference(logp, ent, old, ref, adv, mask, kl_coef=0.001, q=0.8):  # noqa: ANN001, ANN201
    """github.com/wizard-III/Archer2.0 @ b08d963: verl/workers/actor/dp_actor.py (the entropy
    mask: masked_entropy <= torch.nanquantile(row, 0.8) -- "high_entropy_mask", True on the low-
    entropy tokens; use_token_entropy_separate unset: the KL over every token) and
    verl/trainer/ppo/core_algos.py compute_policy_loss_archer (clip 0.2 / 0.4, c 3 / 3) and
    kl_penalty(low_var_kl); scripts/train/run_archer2.0_qwen2.5_1.5b_math.sh: kl_loss_coef 0.001,
    token mean."""
    response_mask = mask.bool()
    masked_entropy = torch.where(response_mask, ent.detach(), torch.nan)
    q80 = torch.nanquantile(masked_entropy, q=q, dim=-1, keepdim=True)
    high_entropy_mask = (masked_entropy <= q80) & response_mask
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    ncr = torch.where(high_entropy_mask, torch.clamp(ratio, min=1 - 0.2, max=None), torch.clamp(ratio, min=1 - 0.4, max=None))
    pcr = torch.where(high_entropy_mask, torch.clamp(ratio, min=None, max=1 + 0.2), torch.clamp(ratio, min=None, max=1 + 0.4))
    neg_clip = -adv * ncr
    pos_clip = -adv * (pcr / pcr.detach()) / pcr.detach()
    neg_dual = torch.clamp(ncr, min=None, max=3.0)
    neg = torch.where(torch.gt(ncr, neg_dual), -adv * neg_dual.detach() * logp, neg_clip)
    pos_dual = torch.clamp(1 / pcr, min=None, max=3.0)
    pos = torch.where(torch.gt(1 / pcr, pos_dual), -adv * pos_dual.detach() * logp, pos_clip)
    pg = torch.where(adv < 0, neg, pos)
    kl = ref - logp
    kld = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    return token_mean(pg, mask) + token_mean(kld, mask) * kl_coef


def test_aspo(mode: str) -> None:
    fn, b = _spec("aspo", mode), _batch(8, spread=1.2)
    adv = _check_adv(fn, b, grpo_adv(b["r"], b["mask"]))
    old, _ = _old_ref(b)
    rho = torch.exp(_logp_ent(b["z"], b["y"])[0] - old)[b["mask"] > 0]
    assert bool((rho > 3).any()) and bool((rho < 1 / 3).any())  # both soft dual clips act
    _check(fn, b, adv, aspo_reference)


# ------------------------------------------------------------------ 9. Archer


def archer_reference(logp, ent, old, ref, adv, mask, kl_coef=0.001, q=0.8):  # noqa: ANN001, ANN201
    """github.com/wizard-III/ArcherCodeR (the fork github.com/Jinxiaolong1129/ArcherCodeR @
    f646719, its loss code unchanged since the authors' 1bc04d9): verl/workers/actor/dp_actor.py
    (entropy mask: masked_entropy <= nanquantile(row, 0.8), "high_entropy_mask" True on the low-
    entropy tokens; KL: agg_loss(kld, high_entropy_mask) * kl_loss_coef + agg_loss(kld,
    low_entropy_mask) * high_entropy_kl_loss_scale_coef) and verl/trainer/ppo/core_algos.py
    compute_policy_loss(use_token_entropy_separate=True) and kl_penalty(low_var_kl);
    scripts/train/run_archer_qwen2.5_1.5b_code.sh: clip 0.2 (low entropy) / 0.5 (high),
    clip_ratio_c 10, kl_loss_coef 0.001, high_entropy_kl_loss_scale_coef 0, token mean."""
    response_mask = mask.bool()
    masked_entropy = torch.where(response_mask, ent.detach(), torch.nan)
    q80 = torch.nanquantile(masked_entropy, q=q, dim=-1, keepdim=True)
    high_entropy_mask = (masked_entropy <= q80) & response_mask
    low_entropy_mask = (masked_entropy > q80) & response_mask
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    pg1 = -adv * ratio
    clip_ratio = torch.where(high_entropy_mask.bool(), torch.clamp(ratio, 1 - 0.2, 1 + 0.2),
                             torch.clamp(ratio, 1 - 0.5, 1 + 0.5))
    clip1 = torch.maximum(pg1, -adv * clip_ratio)
    pg = torch.where(adv < 0, torch.min(-adv * 10.0, clip1), clip1)
    kl = torch.clamp(ref - logp, min=-20, max=20)
    kld = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    return (token_mean(pg, mask) + token_mean(kld, high_entropy_mask.to(DT)) * kl_coef
            + token_mean(kld, low_entropy_mask.to(DT)) * 0.0)


def test_archer(mode: str) -> None:
    fn, b = _spec("archer", mode), _batch(10, spread=1.2)
    adv = _check_adv(fn, b, grpo_adv(b["r"], b["mask"]))
    _check(fn, b, adv, archer_reference)
    one_clip = lambda lp, e, o, rf, a, m: token_mean(verl_vanilla(lp, o, a, m, 0.2, 0.2, 10.0), m)  # noqa: E731
    assert _differs(b, adv, archer_reference, one_clip) > 1e-3  # the entropy split acts


# ------------------------------------------------------------------ 10. M2PO


def m2po_reference(logp, ent, old, ref, adv, mask, budget=0.04, miniclip_low=0.3, miniclip_high=0.5,  # noqa: ANN001, ANN201
                   found=None):
    """github.com/Infini-AI-Lab/M2PO @ 4514ce2, verl/trainer/ppo/core_algos.py
    _get_trust_region_tokens_delta_sq, _solve_tau_from_sorted_delta2, kpo_clip_harmful_tokens and
    compute_m2po_policy_loss (miniclip 0.3 / 0.5: dp_actor passes none; M2_budget 0.04 as
    train-scripts/m2po-*.sh), token mean. One change: exp(-tau), exp(tau) in float64 where the
    authors round them through a float32 tensor (torch.tensor(python float))."""
    mask_b = mask.bool()
    adv_example = adv[:, 0]
    pos_adv_mask, neg_adv_mask = adv_example > 1e-12, adv_example < -1e-12
    delta = (old - logp).detach()
    ratio = torch.exp(-delta)
    pos = delta.pow(2)[pos_adv_mask][(ratio[pos_adv_mask] > 1.0 + 1e-12) & mask_b[pos_adv_mask]]
    neg = delta.pow(2)[neg_adv_mask][(ratio[neg_adv_mask] < 1.0 - 1e-12) & mask_b[neg_adv_mask]]
    d2 = torch.cat([pos, neg])
    n = d2.numel()
    if n == 0 or float(d2.sum() / n) <= budget + 1e-12:
        clip_low, clip_high = 0.0, 100000
    else:
        target = budget * float(n)
        s, _ = torch.sort(d2)
        csum = torch.cumsum(s, dim=0)
        for k in range(n):
            if (s[k].item() - 1e-12) * (n - k - 1) + float(csum[k].item()) >= target - 1e-12:
                tau = 0.0 if k == 0 else float(s[k - 1].item() - 1e-12) ** 0.5
                break
        clip_low = float(torch.exp(torch.tensor(-tau, dtype=DT)))
        clip_high = float(torch.exp(torch.tensor(tau, dtype=DT)))
    clip_low, clip_high = max(1 - clip_low, miniclip_low), max(clip_high - 1, miniclip_high)
    if found is not None:
        found.append((1 - clip_low, 1 + clip_high))
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    return token_mean(pg, mask)


@pytest.mark.parametrize("budget,spread,bounds", [(0.04, 0.5, "floors"), (0.5, 1.5, "tau"), (50.0, 0.5, "free")])
def test_m2po_second_moment_trust_region(mode: str, budget: float, spread: float, bounds: str) -> None:
    """Three regimes: the budget's bounds inside the floors 0.7 / 1.5 (the authors' runs), bounds
    set by tau beyond them, and a budget the batch already meets (no clip)."""
    fn = _spec("m2po", mode, **{"budget = 0.04": f"budget = {budget}"})
    b = _batch(9, spread=spread)
    adv = _check_adv(fn, b, grpo_adv(b["r"], b["mask"]))
    found: list = []
    old, _ = _old_ref(b)
    m2po_reference(_logp_ent(b["z"], b["y"])[0], None, old, None, adv, b["mask"], budget=budget, found=found)
    lo, hi = found[0]
    if bounds == "floors":
        assert (lo, hi) == (pytest.approx(0.7), pytest.approx(1.5))
    elif bounds == "tau":
        assert lo < 0.7 and hi > 1.5
    else:
        assert (lo, hi) == (0.0, 100000)
    _check(fn, b, adv, lambda *a: m2po_reference(*a, budget=budget))


# ------------------------------------------------------------------ 11. Pass@k Training


def _comb(N: int, k: int) -> float:
    """scipy.special.comb(N, k) (exact=False) on integers: 0 where N < 0, k < 0 or k > N."""
    import math

    return 0.0 if N < 0 or k < 0 or k > N else float(math.comb(N, k))


def passk_adv(r, mask, n: int, k: int = 4):  # noqa: ANN001, ANN201
    """github.com/RUCAIBox/Passk_Training @ c3ba575, code/passk_adv.py calc_adv and
    compute_advantage (numpy, float64), scipy's comb replaced by the same values (_comb)."""
    import numpy as np

    out = torch.empty_like(r)
    for g in range(r.shape[0] // n):
        val = r[g * n:(g + 1) * n].numpy()
        c = len(np.where(val == 1)[0])
        rho = 1 - _comb(n - c, k) / _comb(n, k)
        sigma = np.sqrt(rho * (1 - rho))
        adv_p = (1 - rho) / (sigma + 1e-6)
        adv_n = (1 - rho - _comb(n - c - 1, k - 1) / _comb(n - 1, k - 1)) / (sigma + 1e-6)
        new_val = np.where(val == 1, adv_p, val)
        new_val = np.where(new_val == 0, adv_n, new_val)
        out[g * n:(g + 1) * n] = torch.from_numpy(np.asarray(new_val, dtype=np.float64))
    return out.unsqueeze(-1) * mask


def grpo_loss_reference(logp, ent, old, ref, adv, mask):  # noqa: ANN001, ANN201
    """grpo.rl's loss (the authors release the advantage only): verl's clip 0.2 without dual
    clip, k3 KL 0.04 in the loss, each sequence's token mean, then the mean over sequences."""
    pg = verl_vanilla(logp, old, adv, mask, 0.2, 0.2)
    x = ref - logp
    per_token = (pg + 0.04 * (torch.exp(x) - x - 1)) * mask
    return (per_token.sum(-1) / mask.sum(-1)).mean()


@pytest.mark.parametrize("rewards", [[1, 0, 0, 0, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1],
                                     [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                                     [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 1, 1, 0]])
def test_passk_training_analytical_advantage(mode: str, rewards: list) -> None:
    """Groups of n = 8 with c = 4, 7, 1, 8, 0 and 4 right answers (k = 4): the closed form's
    every branch, the ratios that vanish where C(n - c, k) or C(n - c - 1, k - 1) is 0 included."""
    n = 8
    fn, b = _spec("passk_training", mode), _batch(11)
    b["r"] = torch.tensor(rewards, dtype=DT)
    want = passk_adv(b["r"], b["mask"], n)
    est = fn.estimate(b["r"].float(), n, b["mask"].float())
    torch.testing.assert_close(est.advantages.double(), want, rtol=0, atol=TOL)
    torch.testing.assert_close(est.mask.double(), b["mask"], rtol=0, atol=0)
    assert float(want.abs().max()) > 0.1
    old, ref = _old_ref(b)
    z = b["z"].clone().requires_grad_(True)
    logp, _ = _logp_ent(z, b["y"])
    out = fn.loss(logp, old, want, b["mask"], ref_logprobs=ref, group_size=n)
    (grad,) = torch.autograd.grad(out.loss, z)
    z2 = b["z"].clone().requires_grad_(True)
    lp2, _ = _logp_ent(z2, b["y"])
    loss_ref = grpo_loss_reference(lp2, None, old, ref, want, b["mask"])
    (grad_ref,) = torch.autograd.grad(loss_ref, z2)
    assert abs(float(out.loss.detach()) - float(loss_ref.detach())) < TOL
    assert float((grad - grad_ref).abs().max()) < TOL


# ------------------------------------------------------------------ explain A B on the new constructs


def test_explain_diffs_the_new_constructs_slot_by_slot() -> None:
    """`rldsl explain A B` on two of these specs: a first_of search against grpo's registry clip
    (one binding, its candidates shown), and the sorted-cumsum trust region against itself with
    another budget and another line."""
    from rldsl import explain

    d = explain.diff(rldsl.load("grpo"), rldsl.load(EXAMPLES / "bapo.rl"))
    s = next(x for x in d["slots"] if x["slot"] == "objective")
    assert s["status"] == "component differs" and s["a"] == "ppo"
    assert "low, high = first_of([(0.8, 1.2), (0.85, 1.2)" in s["b_formula"]
    assert {x["slot"] for x in d["slots"] if x["status"] != "same"} == {"trust_region", "objective", "kl",
                                                                        "aggregation"}
    a = rldsl.load(EXAMPLES / "m2po.rl")
    text = (EXAMPLES / "m2po.rl").read_text()
    b = rldsl.loads(text.replace("budget = 0.04", "budget = 0.1"), filename="b.rl")
    s = next(x for x in explain.diff(a, b)["slots"] if x["slot"] == "trust_region")
    assert s["status"] == "params differ" and s["params"] == [{"param": "budget", "a": 0.04, "b": 0.1}]
    c = rldsl.loads(text.replace("(n - j - 1)", "(n - j)"), filename="c.rl")
    s = next(x for x in explain.diff(a, c)["slots"] if x["slot"] == "trust_region")
    assert s["status"] == "formula differs" and [x["binding"] for x in s["bindings"]] == ["k"]
    assert s["bindings"][0]["a"].startswith("batch_min(where(j < n, where((s - tiny) * (n - j - 1) + c")
