"""The language's own test on new algorithms, second round (docs/new_algorithms.md, second table).

Ten more RL-for-LLM policy-optimization methods of 2025 that neither the library nor the first
round had, each either written as a spec from docs/ alone (algorithms/examples/<name>.rl) and
checked here against a reference transcribed from the authors' released code (file and commit in
each reference's docstring, float64, no rldsl code), or listed in docs/new_algorithms.md as not
writable with the construct it lacks. Checked: the advantages (estimate(), float32 stage) and the
loss mask, the loss and its gradient through the logits (float64), eager and compiled (each spec
compiled once per session and reused), on the first round's fixed batch (``_batch``), on a batch
whose log-ratios pass the default ratio slot's clamp (+-20, ``_past_the_clamp``), and on batches
that reach each regime of a method (asserted).

On the batch past the clamp the ratios reach e^22, so the loss and its gradient are compared
relative to their size there (1e-6 of max(1, |value|)), as everywhere else; below 1 that is the
absolute 1e-6 of the first round.
"""
from __future__ import annotations

from functools import partial

import pytest
import torch
from test_new_algorithms import DT, EAGER_AND_COMPILED, G, TOL, _batch, _logp_ent, _old_ref, _spec, grpo_adv, token_mean


@pytest.fixture(params=EAGER_AND_COMPILED)
def mode(request: pytest.FixtureRequest) -> str:
    """Every check of this round runs on the eager spec and on its torch.compile'd twin (compiled
    once per session and reused)."""
    return request.param


def _past_the_clamp(b: dict) -> dict:
    """The batch with six tokens whose log-ratio log pi - log pi_old lies beyond +-20: three where
    pi_old of the sampled token is pushed ~e^-22 below pi (ratio ~e^22) and three where pi is
    (ratio ~e^-22); the default ``ratio token(clamp=20)`` would clamp them."""
    b = {k: v.clone() for k, v in b.items()}
    y = b["y"]
    for row, t in [(1, 0), (6, 2), (12, 4)]:
        b["z_old"][row, t, y[row, t]] -= 26.0
    for row, t in [(3, 1), (8, 3), (13, 2)]:
        b["z"][row, t, y[row, t]] -= 26.0
    old, _ = _old_ref(b)
    lr = (_logp_ent(b["z"], b["y"])[0] - old)[b["mask"] > 0]
    assert int((lr > 20).sum()) == 3 and int((lr < -20).sum()) == 3
    return b


def _close(got: float, want: float, what: str) -> float:
    d = abs(got - want)
    assert d <= TOL * max(1.0, abs(want)), (what, got, want)
    return d


def _check(fn, b: dict, adv: torch.Tensor, reference, group_size: int = G) -> tuple[float, float]:
    """The spec's loss and gradient (w.r.t. the logits) against ``reference(logp, ent, old, ref,
    adv, mask)`` in float64; returns the two differences."""
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
    out = fn.loss(logp, old, adv, b["mask"], group_size=group_size, **kw)
    (grad,) = torch.autograd.grad(out.loss, z)
    z2 = b["z"].clone().requires_grad_(True)
    logp2, ent2 = _logp_ent(z2, b["y"])
    want = reference(logp2, ent2, old, ref, adv, b["mask"])
    (grad_ref,) = torch.autograd.grad(want, z2)
    d_loss = _close(float(out.loss.detach()), float(want.detach()), "loss")
    scale = max(1.0, float(grad_ref.abs().max()))
    d_grad = float((grad - grad_ref).abs().max())
    assert d_grad <= TOL * scale, ("gradient", d_grad, scale)
    assert float(grad_ref.abs().max()) > 1e-4  # the gradient is not trivially zero (NFT divides by 1000)
    return d_loss, d_grad


def _check_adv(fn, b: dict, want: torch.Tensor, group_size: int = G, rel: bool = False, **inputs) -> torch.Tensor:
    """estimate()'s advantages (float32) against ``want`` (float64) to 1e-6 (relative to
    max(1, |A|) where ``rel``: float32 holds an advantage of 30 to 2e-6 only), and its mask."""
    est = fn.estimate(b["r"].float(), group_size, b["mask"].float(), **{k: v.float() for k, v in inputs.items()})
    got = est.advantages.double()
    if rel:
        assert float(((got - want).abs() / want.abs().clamp(min=1.0)).max()) <= TOL
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    torch.testing.assert_close(est.mask.double(), b["mask"], rtol=0, atol=0)
    return want


def _differs(b: dict, adv: torch.Tensor, ref_a, ref_b) -> float:
    """How far two references' gradients lie apart on this batch (the method's own piece must
    matter on the batch the check passes on)."""
    old, ref = _old_ref(b)
    grads = []
    for f in (ref_a, ref_b):
        z = b["z"].clone().requires_grad_(True)
        lp, ent = _logp_ent(z, b["y"])
        grads.append(torch.autograd.grad(f(lp, ent, old, ref, adv, b["mask"]), z)[0])
    return float((grads[0] - grads[1]).abs().max())


def verl_ppo(logp, old, adv, low, high, c=None, clamp=None):  # noqa: ANN001, ANN201
    """verl's compute_policy_loss as the authors' copies have it: PPO clip (low, high), the dual
    clip c where given (None: none), the log-ratio clamped at +-clamp where given (None: none)."""
    lr = logp - old if clamp is None else torch.clamp(logp - old, -clamp, clamp)
    ratio = torch.exp(lr)
    clip1 = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))
    if c is None:
        return clip1
    return torch.where(adv < 0, torch.min(-adv * c, clip1), clip1)


def low_var_kl(logp, ref, clamp_x=None):  # noqa: ANN001, ANN201
    """verl kl_penalty(kl_penalty="low_var_kl"): x = ref - logp (clamped to +-clamp_x in some
    copies), (exp(x) - x - 1) clamped to [-10, 10]."""
    x = ref - logp if clamp_x is None else torch.clamp(ref - logp, -clamp_x, clamp_x)
    return torch.clamp(torch.exp(x) - x - 1, min=-10, max=10)


# ------------------------------------------------------------------ 1. Unlikeliness reward


def unlikeliness_adv(r, mask, old, n=G, penalty=0.25, eps=1e-6):  # noqa: ANN001, ANN201
    """github.com/AndreHe02/rewarding-unlikely-release @ ca1cff0, verl/trainer/ppo/ray_lean_trainer.py
    _compute_advantages (lean.rank_penalty 0.25, examples/lean/grpo.sh): the old log-probs'
    masked mean per answer, group_ranks = argsort(argsort(...)) / len(group), scores * (1 - ranks *
    rank_penalty), then (score - mean) / (std + eps) over the group (torch.std, Bessel)."""
    old_mean = (old * mask).sum(-1) / mask.sum(-1)
    out = torch.empty_like(r)
    for g in range(r.shape[0] // n):
        sl = slice(g * n, (g + 1) * n)
        ranks = torch.argsort(torch.argsort(old_mean[sl])) / n
        s = r[sl] * (1 - ranks * penalty)
        out[sl] = (s - torch.mean(s)) / (torch.std(s) + eps)
    return out.unsqueeze(-1) * mask


def unlikeliness_reference(logp, ent, old, ref, adv, mask):  # noqa: ANN001, ANN201
    """Same repository, verl/trainer/ppo/core_algos.py compute_policy_loss (clip 0.2, no log-ratio
    clamp, use_token_level_loss True: masked mean) and verl/workers/actor/dp_actor.py (entropy_coeff
    0.0, use_kl_loss with kl_loss_coef 0.1, low_var_kl, masked mean) as examples/lean/grpo.sh."""
    pg = verl_ppo(logp, old, adv, 0.2, 0.2)
    return token_mean(pg, mask) + 0.1 * token_mean(low_var_kl(logp, ref), mask)


@pytest.mark.parametrize("batch", ["fixed", "past_the_clamp"])
def test_unlikeliness_reward(mode: str, batch: str) -> None:
    fn = _spec("unlikeliness", mode)
    b = _batch(21) if batch == "fixed" else _past_the_clamp(_batch(21))
    old, _ = _old_ref(b)
    adv = _check_adv(fn, b, unlikeliness_adv(b["r"], b["mask"], old), old_logprobs=old)
    # the regime GRPO has not: an all-right group ranks its answers, and only the least likely keeps r = 1
    assert float(adv[3 * G:].abs().max()) > 0.1
    assert float((adv - grpo_adv(b["r"], b["mask"])).abs().max()) > 0.1
    _check(fn, b, adv, unlikeliness_reference)


# ------------------------------------------------------------------ 2. Advantage Reweighting


def ar_adv(r, mask, old, k=0.2, tau=0.8):  # noqa: ANN001, ANN201
    """github.com/zhyang2226/AR-Lopti @ cbeb333, verl/trainer/ppo/ray_trainer.py
    compute_reweight_advantage(reweight_method="both_linear_normal", reweight_k=0.2,
    reweight_tau=0.8, neg_adv_weight=1.0) on core_algos.compute_grpo_outcome_advantage (eps 1e-6):
    (k * exp(old_log_probs) + tau) * advantage, positive and negative parts alike."""
    return (k * torch.exp(old) + tau) * grpo_adv(r, mask)


def ar_reference(logp, ent, old, ref, adv, mask):  # noqa: ANN001, ANN201
    """Same repository, verl/trainer/ppo/core_algos.py compute_policy_loss (no log-ratio clamp,
    clip 0.2 / 0.24, clip_ratio_c 10, agg_loss token-mean) and kl_penalty(low_var_kl: x clamped to
    +-5), verl/workers/actor/dp_actor.py (importance_sampling "on", entropy_coeff 0, kl_loss_coef
    0.001 aggregated token-mean); scripts/train_kklogic_AR_4x80GB.sh."""
    pg = verl_ppo(logp, old, adv, 0.2, 0.24, c=10.0)
    return token_mean(pg, mask) + 0.001 * token_mean(low_var_kl(logp, ref, clamp_x=5.0), mask)


@pytest.mark.parametrize("batch", ["fixed", "past_the_clamp"])
def test_advantage_reweighting(mode: str, batch: str) -> None:
    fn = _spec("advantage_reweighting", mode)
    b = _batch(22) if batch == "fixed" else _past_the_clamp(_batch(22))
    old, ref = _old_ref(b)
    adv = _check_adv(fn, b, ar_adv(b["r"], b["mask"], old), old_logprobs=old)
    assert float((adv - grpo_adv(b["r"], b["mask"])).abs().max()) > 0.1  # the reweighting acts
    _check(fn, b, adv, ar_reference)


# ------------------------------------------------------------------ 3. BNPO


def bnpo_adv(r, mask, n=G, min_value=0.0, max_value=1.0):  # noqa: ANN001, ANN201
    """github.com/changyi7231/BNPO @ a9c51b9, recipe/bnpo/src/bnpo_ray_trainer.py
    compute_bnpo_outcome_advantage: p per prompt (its mean score), the prompts' mean and variance
    (torch .var, Bessel), alpha = clamp(1 + a / 3, min=1), beta likewise, weight =
    clamp(1 / Beta(alpha, beta).log_prob(p).exp(), 0, 1e6), scores = weight * (score - p)."""
    scores = (r - min_value) / (max_value - min_value)
    ps = [torch.mean(scores[g * n:(g + 1) * n]) for g in range(r.shape[0] // n)]
    all_p = torch.stack(ps)
    p_mean = all_p.mean() if all_p.shape[0] > 1 else torch.tensor(0.0, dtype=DT)
    p_var = all_p.var() if all_p.shape[0] > 1 else torch.tensor(1.0, dtype=DT)
    a = (p_mean * (1 - p_mean) / p_var - 1) * p_mean
    b = (p_mean * (1 - p_mean) / p_var - 1) * (1 - p_mean)
    alpha = torch.clamp(1 + a / 3, min=1.0)
    beta = torch.clamp(1 + b / 3, min=1.0)
    out = torch.empty_like(r)
    for i in range(r.shape[0]):
        p = ps[i // n]
        weight = torch.distributions.Beta(alpha, beta).log_prob(p).exp()
        weight = torch.clamp(1 / weight, min=0, max=1e6)
        out[i] = weight * (scores[i] - p)
    return out.unsqueeze(-1) * mask, (float(alpha), float(beta))


def bnpo_reference(logp, ent, old, ref, adv, mask):  # noqa: ANN001, ANN201
    """BNPO's verl copy (same commit), verl/trainer/ppo/core_algos.py compute_policy_loss (no
    log-ratio clamp; recipe/bnpo/run.sh: clip 0.2 / 0.28, clip_ratio_c 10) and agg_loss
    ("seq-mean-token-sum": torch.mean over the rows of each row's token sum); no KL, no entropy."""
    pg = verl_ppo(logp, old, adv, 0.2, 0.28, c=10.0)
    return torch.sum(pg * mask, dim=-1).mean()


BNPO_REWARDS = {
    # p = 0, 1/4, 1, 1: the prompts' p spread wider than a Beta of their mean allows (v > m (1 - m)),
    # a and b < 0, alpha = beta = 1 (their floor: a flat density, weight 1, A = r - p)
    "alpha_floor": [0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
    # p = 1/4, 1/2, 1/2, 3/4: v small, alpha and beta above 1
    "alpha_fitted": [1, 0, 0, 0, 1, 0, 1, 0, 0, 1, 1, 0, 1, 1, 0, 1],
}


@pytest.mark.parametrize("regime", ["alpha_floor", "alpha_fitted", "past_the_clamp"])
def test_bnpo_beta_normalization(mode: str, regime: str) -> None:
    fn = _spec("bnpo", mode)
    b = _batch(23) if regime != "past_the_clamp" else _past_the_clamp(_batch(23))
    b["r"] = torch.tensor(BNPO_REWARDS.get(regime, BNPO_REWARDS["alpha_fitted"]), dtype=DT)
    want, (alpha, beta) = bnpo_adv(b["r"], b["mask"])
    if regime == "alpha_floor":
        assert alpha == 1.0 and beta == 1.0
    else:
        assert alpha > 1.0 and beta > 1.0
    adv = _check_adv(fn, b, want)
    assert float(adv.abs().max()) > 0.5
    _check(fn, b, adv, bnpo_reference)


# ------------------------------------------------------------------ 4. KRPO


def krpo_adv(r, mask, n=G, process_var=1e-5, meas_var=1e-2, eps=1e-8):  # noqa: ANN001, ANN201
    """github.com/billhhh/KRPO_LLMs_RL @ df1ae2b, train.py KalmanFilter (init_mean 0, init_var 1)
    and group_advantages (called on each prompt's returns, a new filter per prompt): for each r in
    order, P_pred = P + Q, K = P_pred / (P_pred + R), x += K (r - x), P = (1 - K) P_pred, advantage
    (r - x) / (sqrt(P) + eps). Here in float64 (the authors' tensors are float32)."""
    out = torch.empty_like(r)
    for g in range(r.shape[0] // n):
        x, P = torch.tensor(0.0, dtype=DT), torch.tensor(1.0, dtype=DT)
        for i in range(g * n, (g + 1) * n):
            P_pred = P + process_var
            K = P_pred / (P_pred + meas_var)
            x = x + K * (r[i] - x)
            P = (1 - K) * P_pred
            out[i] = (r[i] - x) / (torch.sqrt(P) + eps)
    return out.unsqueeze(-1) * mask


def krpo_reference(logp, ent, old, ref, adv, mask, clip_eps=0.2, kl_weight=0.01):  # noqa: ANN001, ANN201
    """Same repository, loss.py GRPOLoss and approx_kl_divergence (k3 of the masked log-ratio):
    -min(ratio A, clamp(ratio, 1 - 0.2, 1 + 0.2) A) + 0.01 kl, masked mean per answer, then the
    mean (train.py: clip_eps 0.2, kl_weight 0.01)."""
    log_ratio = (ref - logp) * mask
    kl = log_ratio.exp() - log_ratio - 1
    ratio = (logp - old).exp()
    loss = -torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv) + kl_weight * kl
    return ((loss * mask).sum(-1) / mask.sum(-1)).mean()


@pytest.mark.parametrize("group_size,batch", [(4, "fixed"), (8, "fixed"), (16, "fixed"), (4, "past_the_clamp")])
def test_krpo_kalman_baseline(mode: str, group_size: int, batch: str) -> None:
    """Groups of 4, 8 and 16 (the closed form at every position the filter reaches in a group of
    up to 16), and the batch past the clamp."""
    fn = _spec("krpo", mode)
    b = _batch(24) if batch == "fixed" else _past_the_clamp(_batch(24))
    want = krpo_adv(b["r"], b["mask"], n=group_size)
    adv = _check_adv(fn, b, want, group_size=group_size, rel=True)
    assert float(adv.abs().max()) > 5  # late rows: a small filter variance P makes large advantages
    _check(fn, b, adv, krpo_reference, group_size=group_size)


# ------------------------------------------------------------------ 5. NFT


def clamp_preserve_grad(x, min_val=None, max_val=None):  # noqa: ANN001, ANN201
    """NFT dp_actor.py: the clamped value with x's gradient."""
    clipped = torch.clamp(x, min=min_val, max=max_val)
    return x + (clipped - x).detach()


def nft_reference(logp, ent, old, ref, adv, mask, r=None, neg_weight=1.0, clamp_negative=1.0,  # noqa: ANN001, ANN201
                  clamp_positive=0.0, n=G):
    """github.com/NVlabs/NFT @ b358fae, dp_actor.py update_policy (neg_weight >= 0, ratio_type
    "token", normalize 1) with ray_nft_trainer.py compute_dapo_nft_outcome_advantage (correct_rate
    = (group mean of the +-1 scores + 1) / 2) and correct_mask = (score + 1) / 2; train_7B.sh:
    neg_weight 1, clamp_negative 1, clamp_positive 0, entropy_coeff 0, no KL. The reduction: the
    sum over each row's tokens / 1000, summed over rows."""
    rate = torch.stack([torch.mean(r[g * n:(g + 1) * n]) for g in range(r.shape[0] // n)]).repeat_interleave(n)
    correct_rate = ((rate + 1.0) / 2.0).unsqueeze(-1)
    correct_mask = (r + 1) / 2
    ratio = torch.exp((logp - old).clamp(max=10.0))
    correct_rate = torch.clamp(correct_rate, min=0.02, max=0.98)
    negative_rate = 1.0 - correct_rate
    proxy = (1.0 - correct_rate * ratio) / (1.0 - correct_rate * 1.0)
    negative_loss = -torch.log(clamp_preserve_grad(proxy, min_val=abs(clamp_negative)))
    positive_loss = -torch.log(clamp_preserve_grad(ratio, min_val=clamp_positive))
    pg_losses = negative_loss * (1.0 - correct_mask[:, None]) * neg_weight + correct_mask[:, None] * positive_loss
    pg_losses = pg_losses * negative_rate
    return torch.sum(torch.sum(pg_losses * mask, dim=1) / 1000.0)


NFT_REWARDS = {  # +-1 rewards; groups mixed (the authors assert 0 < correct_rate < 1: DAPO's filter)
    "fixed": [1, -1, -1, -1, 1, 1, -1, 1, -1, 1, 1, -1, 1, -1, 1, 1],
    # a group of 1 in 16 right: q = 1/16 inside the clamp; and the batch past the clamp (ratio e^22 -> e^10)
    "rare": [1] + [-1] * 15,
}


@pytest.mark.parametrize("regime", ["fixed", "rare", "past_the_clamp"])
def test_nft_negative_aware(mode: str, regime: str) -> None:
    n = 16 if regime == "rare" else G
    fn = _spec("nft", mode)
    b = _batch(25, spread=0.8) if regime != "past_the_clamp" else _past_the_clamp(_batch(25, spread=0.8))
    b["r"] = torch.tensor(NFT_REWARDS.get(regime, NFT_REWARDS["fixed"]), dtype=DT)
    adv = _check_adv(fn, b, grpo_adv_n(b["r"], b["mask"], n), group_size=n)
    old, _ = _old_ref(b)
    ratio = torch.exp(_logp_ent(b["z"], b["y"])[0] - old)[b["mask"] > 0]
    wrong = (b["r"] < 0).unsqueeze(-1).expand_as(b["mask"])[b["mask"] > 0]
    assert bool((ratio[wrong] > 1).any()) and bool((ratio[wrong] < 1).any())  # the floor at 1 acts, and not everywhere
    ref = partial(nft_reference, r=b["r"], n=n)
    _check(fn, b, adv, ref, group_size=n)
    assert _differs(b, adv, ref, partial(nft_reference, r=b["r"], n=n, clamp_negative=1e-6)) > 1e-5  # the value-only floor changes the gradient (which is ~1e-3: / 1000)


def grpo_adv_n(r, mask, n, eps=1e-6):  # noqa: ANN001, ANN201
    """grpo_adv for groups of n (verl compute_grpo_outcome_advantage)."""
    out = torch.empty_like(r)
    for p in range(r.shape[0] // n):
        s = r[p * n:(p + 1) * n]
        out[p * n:(p + 1) * n] = (s - s.mean()) / (s.std() + eps)
    return out.unsqueeze(-1) * mask


# ------------------------------------------------------------------ 6. RLPR


def rlpr_score_b(logp_in_answer: torch.Tensor) -> float:
    """github.com/OpenBMB/RLPR @ 8490fca, verl/workers/reward_manager/prob.py compute_scoreB
    (compute_score_name mean_exp_log_softmax): the old policy's logprobs of the reference answer's
    tokens (ground_truth_mask_pr; none: an invalid completion, score 0) in float32, the mean of their
    exp, then rounded to bfloat16 (``torch.tensor(scoreB, dtype=torch.bfloat16).item()``)."""
    if logp_in_answer.numel() == 0:
        return 0.0
    score = torch.mean(torch.exp(logp_in_answer.to(torch.float32))).item()
    return torch.tensor(score, dtype=torch.bfloat16).item()


def rlpr_score_a(logp_in_answer: torch.Tensor) -> float:
    """Same repository, verl/trainer/ppo/ray_trainer.py get_scoreA: the answer right after the
    prompt, the mean of exp(logprob) over its tokens (no bfloat16 rounding)."""
    return torch.mean(torch.exp(logp_in_answer.to(torch.float32))).item()


def rlpr_rewards(score_b, score_a, format_score, format_coefficient=0.1):  # noqa: ANN001, ANN201
    """prob.py ProbRewardManager.__call__ (shaping threshold_0: ``0 if x < 0 else x``, the script's
    reward_manager_shaping_function_name; format_coefficient 0.1, main_ppo.py's default):
    (1 - c) * shaped(scoreB - scoreA) + c * format_score."""
    out = []
    for b, a, f in zip(score_b, score_a, format_score):
        delta = b - a
        delta = 0 if delta < 0 else delta
        out.append((1 - format_coefficient) * delta + format_coefficient * float(f))
    return torch.tensor(out, dtype=DT)


def rlpr_adv(scores, mask, std_filter=1e-6, eps=1e-6):  # noqa: ANN001, ANN201
    """verl/trainer/ppo/core_algos.py compute_grpo_outcome_advantage as RLPR has it: per group,
    torch.std (Bessel); a group whose std is below std_filter gets score 0, the others
    (score - mean) / (std + eps); then over the response mask. Also each row's group std
    (``final_reward_stds``, what the filter reads)."""
    out, stds = torch.empty_like(scores), torch.empty_like(scores)
    for p in range(scores.shape[0] // G):
        s = scores[p * G:(p + 1) * G]
        std = torch.std(s)
        out[p * G:(p + 1) * G] = 0.0 if std < std_filter else (s - torch.mean(s)) / (std + eps)
        stds[p * G:(p + 1) * G] = std
    return out.unsqueeze(-1) * mask, stds


def rlpr_kept_groups(stds, lower_bound):  # noqa: ANN001, ANN201
    """ray_trainer.py filter (filter_target final_reward_std): a group stays when the mean of its
    rows' stds (its std) is >= accuracy_lower_bound (the authors' EMA x std_filter_beta)."""
    per_group = stds.view(-1, G).mean(-1)
    return (per_group >= lower_bound) & ~(torch.isnan(per_group) | torch.isinf(per_group))


def rlpr_reference(logp, ent, old, ref, adv, mask, clip_low=0.2, clip_high=0.27, entropy_coeff=0.001):  # noqa: ANN001, ANN201
    """core_algos.py compute_policy_loss (ratio exp(logp - old), no clamp; clip_ratio_low 0.2 and
    clip_ratio_high 0.27 as examples/RLPR/reproduce_qwen.sh; agg_loss token-mean) and
    verl/workers/actor/dp_actor.py: pg_loss - entropy_loss * entropy_coeff (ppo_trainer.yaml 0.001),
    kl_loss_coef 0 (KL_COEF=0: no term)."""
    ratio = torch.exp(logp - old)
    pg = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    return token_mean(pg, mask) - token_mean(ent, mask) * entropy_coeff


#: each row's logprobs of its reference answer's tokens under the old policy: after its own reasoning
#: (scoreB) and right after the prompt (scoreA); an empty one is a completion without one answer tag
def _rlpr_answer_logps(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    after, bare = [], []
    for i in range(4 * G):
        n = 1 + i % 4
        after.append(-2.0 * torch.rand(n, generator=g, dtype=DT))
        bare.append(-2.5 * torch.rand(n, generator=g, dtype=DT) - 0.3)
    after[2] = after[2][:0]          # no answer tag: scoreB 0
    for i in range(3 * G, 4 * G):    # group 3: the reasoning never helps, every delta clipped at 0
        after[i] = bare[i] - 1.0
    return after, bare


RLPR_REGIMES = {"fixed": ("std_floor = 0.0", 0.0), "std_floor": ("std_floor = 0.0", 0.12),
                "tiny_spread": ("std_floor = 0.0", 0.0), "past_the_clamp": ("std_floor = 0.0", 0.0)}
#: tiny_spread: group 3's probabilities given as they are (exact in float32): its rewards differ by
#: 0.9 x 2^-21, a std of 2.5e-7, under the std_filter's 1e-6, where plain GRPO gives A = +-0.17
RLPR_TINY = ([0.5, 0.5 + 2.0 ** -21, 0.5, 0.5 + 2.0 ** -21], [0.25] * 4)


@pytest.mark.parametrize("regime", list(RLPR_REGIMES))
def test_rlpr_probability_reward(mode: str, regime: str) -> None:
    """RLPR on the runtime's inputs: answer_prob (the authors' scoreB, here with their bfloat16
    rounding, which the inputs carry exactly in float32) and bare_answer_prob (scoreA); the format
    reward is the batch's r. Regimes: a row without an answer tag (scoreB 0), a group whose deltas
    are all clipped at 0 (its rewards equal: std 0, the std_filter's A = 0), a group whose rewards
    differ by less than the std_filter's 1e-6 (A = 0 where GRPO standardises), and with a std floor of
    0.12 the filter drops a group that has a spread (0.098) and keeps the others."""
    old_text, floor = RLPR_REGIMES[regime]
    fn = _spec("rlpr", mode, **({old_text: f"std_floor = {floor}"} if floor else {}))
    b = _batch(27) if regime != "past_the_clamp" else _past_the_clamp(_batch(27))
    after, bare = _rlpr_answer_logps(27)
    score_b = [rlpr_score_b(x) for x in after]
    score_a = [rlpr_score_a(x) for x in bare]
    if regime == "tiny_spread":
        score_b[3 * G:], score_a[3 * G:] = RLPR_TINY
    scores = rlpr_rewards(score_b, score_a, b["r"])
    want, stds = rlpr_adv(scores, b["mask"])
    kept = rlpr_kept_groups(stds, floor).repeat_interleave(G)
    probs = dict(answer_prob=torch.tensor(score_b, dtype=DT), bare_answer_prob=torch.tensor(score_a, dtype=DT))
    est = fn.estimate(b["r"].float(), G, b["mask"].float(), **{k: v.float() for k, v in probs.items()})
    assert float(want[3 * G:].abs().max()) == 0.0  # std_filter's A = 0 on group 3
    if regime == "tiny_spread":  # where it is not GRPO's: a spread under 1e-6 standardised would be +-0.17
        s3 = scores[3 * G:]
        assert 0 < float(torch.std(s3)) < 1e-6 and float(((s3 - s3.mean()) / (torch.std(s3) + 1e-6)).abs().max()) > 0.1
    else:
        assert float(stds.view(-1, G)[3].max()) == 0.0
    assert score_b[2] == 0.0 and float(scores[2]) == 0.1 * float(b["r"][2])  # no answer tag
    keep_mask = b["mask"] * kept.unsqueeze(-1).to(DT)
    torch.testing.assert_close(est.mask.double(), keep_mask, rtol=0, atol=0)
    got = est.advantages.double()
    d_adv = float(((got - want) * keep_mask).abs().max())
    assert d_adv <= TOL, d_adv
    if regime == "std_floor":  # the floor acts on a group with a spread, and not on every one
        assert kept.view(-1, G)[:, 0].tolist().count(False) == 2 and bool(kept.any())
        assert float(stds.view(-1, G)[~kept.view(-1, G)[:, 0]].max()) > 0
    else:
        assert bool(kept.all())
    assert float((want - grpo_adv(b["r"], b["mask"])).abs().max()) > 0.1  # not GRPO on the format reward
    _check(fn, dict(b, mask=keep_mask), want, rlpr_reference)


# ------------------------------------------------------------------ 7. DCPO's smooth advantage standardization


def get_mean_std(old_mean, old_std, times, new_mean, new_std):  # noqa: ANN001, ANN201
    """github.com/lime-RL/DCPO @ 2778707, verl/trainer/ppo/core_algos.py get_mean_std: the
    prompt's history (old_mean, old_std over times - 1 earlier steps) mixed with this step's."""
    old_times = times - 1
    if old_times == 0:
        return new_mean, new_std
    mean = (old_mean * old_times + new_mean) / (old_times + 1)
    var = old_times * (old_std ** 2) + (new_std ** 2) + old_times / times * (new_mean - old_mean) ** 2
    return mean, (var / times) ** 0.5


def dcpo_sas_adv(r, mask, keys, history, n=G, picks=None):  # noqa: ANN001, ANN201
    """Same file, compute_dcpo_outcome_advantage (norm_adv_by_std_in_grpo, user_old_mean_ratio 1),
    with recipe/dcpo/src/dcpo_ray_trainer.py's history (use_old_mean): ``history`` maps a prompt to
    its (mean, std, times), read and then updated as the trainer's old_mean_std is. ``picks``
    collects, where the two mixtures differ, whether the first (weighted to the cumulative z) won."""
    out = torch.empty_like(r)
    for p, key in enumerate(keys):
        scores = r[p * n:(p + 1) * n]
        old_mean, old_std, times = history.get(key, (0.0, 0.0, 0))
        new_mean, new_std = scores.mean(), torch.std(scores)
        mean, std = get_mean_std(old_mean, old_std, times + 1, new_mean, new_std)
        for i in range(n):
            s_new = (scores[i] - new_mean) / new_std if new_std > 0 else torch.tensor(0.0, dtype=DT)
            s_old = (scores[i] - mean) / std if std > 0 else torch.tensor(0.0, dtype=DT)
            s1 = 1 / (times + 1) * s_old + (1 - 1 / (times + 1)) * s_new
            s2 = 1 / (times + 1) * s_new + (1 - 1 / (times + 1)) * s_old
            out[p * n + i] = torch.where(abs(s1) < abs(s2), s1, s2)
            if picks is not None and abs(float(s1) - float(s2)) > 1e-3:
                picks.append(bool(abs(s1) < abs(s2)))
        history[key] = (mean, std, times + 1)
    return out.unsqueeze(-1) * mask


#: three steps of four prompts (G = 4): prompt a is seen 3 times, b 3, c 2, d 2, e 2; c's first
#: group agrees (all 1, no history: A = 0) and so does b's second (all 0.75, its step-1 mean 0.5:
#: the step's z is 0, the cumulative one not); rewards in [0, 1], not only 0 and 1
DCPO_STEPS = [
    (["a", "b", "c", "d"], [1, 0, 0, 1, 0.3, 0.9, 0.6, 0.2, 1, 1, 1, 1, 0, 0, 1, 0]),
    (["a", "b", "e", "c"], [1, 1, 1, 0, 0.75, 0.75, 0.75, 0.75, 0.7, 0.1, 0.4, 0.4, 0, 1, 1, 1]),
    (["a", "e", "d", "b"], [0, 0, 1, 0, 0.8, 0.8, 0.2, 0.6, 1, 1, 0, 1, 0.1, 0.9, 0.5, 0.5]),
]


def test_dcpo_smooth_advantage_standardization(mode: str) -> None:
    """dcpo_sas.rl reads the run's per-prompt statistics (records/prompt_stats.PromptStats, folded
    and read as `rldsl run` does each step) and equals the authors' SAS, carried over three steps,
    to 1e-6; on the last step its loss and gradient are DCPO's (dcpo.rl's clipping)."""
    from rldsl.runtime.records.prompt_stats import PromptStats, prompt_key
    from test_new_algorithms import dcpo_reference

    fn, stats, history, picks = _spec("dcpo_sas", mode), PromptStats(), {}, []
    for step, (names, rewards) in enumerate(DCPO_STEPS):
        b = _batch(30 + step, spread=0.8)
        b["r"] = torch.tensor(rewards, dtype=DT)
        keys = [prompt_key(x) for x in names]
        stats.update(keys, b["r"])
        want = dcpo_sas_adv(b["r"], b["mask"], names, history, picks=picks)
        adv = _check_adv(fn, b, want, **stats.read(keys, G))[:, 0]
        grpo = grpo_adv_n(b["r"], b["mask"], G, eps=0.0)[:, 0].nan_to_num(0.0)
        for p, x in enumerate(names):  # GRPO's z (no eps) at a first sight; the history moves it after
            moved = float((adv - grpo)[p * G:(p + 1) * G].abs().max())
            assert (moved > 1e-3) if history[x][2] > 1 else (moved < 1e-6), (step, x, moved)
        if step == 0:
            assert torch.equal(adv[8:12], torch.zeros(G, dtype=DT))  # c agrees, no history
        if step == 1:  # b agrees with history: A = w z_all, the same nonzero value on each row
            assert float(adv[4:8].abs().min()) > 0.1 and float(adv[4:8].max() - adv[4:8].min()) == 0
    assert True in picks and False in picks  # each mixture is the smaller somewhere
    _check(fn, b, adv.unsqueeze(-1) * b["mask"], dcpo_reference)


def test_dcpo_sas_a_group_whose_rewards_all_failed_reads_zero() -> None:
    """A prompt whose every reward failed has no step yet (prompt_steps 0): its rows leave the loss
    and read A = 0, not the NaN of 1 / 0 (the authors raise there; a run skips a failed reward)."""
    from rldsl.runtime.records.prompt_stats import PromptStats, prompt_key

    b = _batch(30, spread=0.8)
    r = torch.tensor(DCPO_STEPS[0][1], dtype=torch.float32)
    r[4:8] = float("nan")
    keys = [prompt_key(x) for x in DCPO_STEPS[0][0]]
    stats = PromptStats()
    stats.update(keys, r)
    est = _spec("dcpo_sas").estimate(r, G, b["mask"].float(), **stats.read(keys, G))
    assert torch.equal(est.advantages[4:8], torch.zeros(G, b["mask"].shape[1]))
    assert torch.equal(est.mask[4:8], torch.zeros(G, b["mask"].shape[1]))
    assert bool(torch.isfinite(est.advantages).all())


# ------------------------------------------------------------------ 8. Intuitor


def self_certainty_from_logits(logits, temperature=1.0):  # noqa: ANN001, ANN201
    """github.com/sunblaze-ucb/Intuitor @ 3f0cdd7, verl-intuitor/verl/utils/torch_functional.py
    self_certainty_from_logits on the logits verl/workers/actor/dp_actor.py _forward_micro_batch
    divided by the temperature and cut to the positions predicting the response
    ([:, -response_length - 1:-1]; here ``logits`` are those already): logsumexp - mean."""
    z = logits / temperature
    return torch.logsumexp(z, dim=-1) - z.mean(dim=-1)


def intuitor_adv(self_certaintys, mask, n=G, epsilon=1e-6):  # noqa: ANN001, ANN201
    """Same repository, verl/trainer/ppo/ray_trainer.py compute_advantage(INTUITOR):
    sentence_wise_mean = verl_F.masked_mean(self_certaintys, response_mask, axis=-1) (sum / (count
    + 1e-8)), scattered on each answer's last token (lengths - 1) as its token-level reward, then
    core_algos.compute_grpo_outcome_advantage: scores = the token rewards' sum, per prompt
    (score - mean) / (torch.std([scores]) + epsilon) (Bessel), times the response mask."""
    sentence_wise_mean = (self_certaintys * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    eos_mask_id = mask.sum(-1).long() - 1
    token_level_rewards = torch.zeros_like(self_certaintys)
    token_level_rewards.scatter_(-1, eos_mask_id.unsqueeze(-1), sentence_wise_mean.unsqueeze(-1))
    scores = token_level_rewards.sum(-1)
    out = torch.empty_like(scores)
    for g in range(scores.shape[0] // n):
        s = scores[g * n:(g + 1) * n]
        out[g * n:(g + 1) * n] = (s - torch.mean(s)) / (torch.std(s.unsqueeze(0)) + epsilon)
    return out.unsqueeze(-1) * mask


def intuitor_reference(logp, ent, old, ref, adv, mask, kl_coef=0.005, c=3.0):  # noqa: ANN001, ANN201
    """Same repository, verl/trainer/ppo/core_algos.py compute_policy_loss (log-ratio clamped at
    +-20, clip 0.2 / 0.2, clip_ratio_c 3.0, agg_loss token-mean: verl/trainer/config/actor/dp_actor.yaml)
    and kl_penalty("low_var_kl": ref - logp clamped at +-20, exp(x) - x - 1 clamped at +-10), the
    actor's kl_loss_coef 0.005 (token mean), entropy_coeff 0: math_intuitor.sh."""
    pg = verl_ppo(logp, old, adv, 0.2, 0.2, c=c, clamp=20.0)
    x = torch.clamp(ref - logp, min=-20, max=20)
    kld = torch.clamp(torch.exp(x) - x - 1, min=-10, max=10)
    return token_mean(pg, mask) + kl_coef * token_mean(kld, mask)


@pytest.mark.parametrize("batch", ["fixed", "past_the_clamp"])
def test_intuitor_self_certainty(mode: str, batch: str) -> None:
    """The advantage is GRPO's on each answer's mean self-certainty (of the old policy's logits),
    whatever the verifier's reward; the loss verl's with a dual clip and low-variance KL. The input
    is made here as KL(U || pi) + log V = -mean_v log pi_v (another form of logsumexp - mean);
    estimate() holds it in float32, as the runtime's forward makes it. A group's answers differ by
    a few hundredths around ~2.7 here (std down to 0.09): the spec centres the values on their
    batch mean before its float32 token mean, else float32 lands at ~9e-7 of the reference."""
    fn = _spec("intuitor", mode)
    b = _batch(26, spread=0.8) if batch == "fixed" else _past_the_clamp(_batch(26, spread=0.8))
    sc = -torch.log_softmax(b["z_old"], -1).mean(-1)  # [B, T]
    torch.testing.assert_close(sc, self_certainty_from_logits(b["z_old"]), rtol=0, atol=1e-12)
    want = intuitor_adv(self_certainty_from_logits(b["z_old"]), b["mask"])
    adv = _check_adv(fn, b, want, self_certainty=sc)
    assert float(adv.abs().max()) > 0.5
    flipped = dict(b, r=1 - b["r"])  # the verifier's reward does not reach the advantage
    torch.testing.assert_close(_check_adv(fn, flipped, want, self_certainty=sc), adv, rtol=0, atol=0)
    if batch == "past_the_clamp":  # the dual clip binds: A < 0 at a ratio above c = 3
        old, _ = _old_ref(b)
        ratio = torch.exp(_logp_ent(b["z"], b["y"])[0] - old)
        assert bool(((adv < 0) & (ratio > 3.0) & (b["mask"] > 0)).any())
    _check(fn, b, adv, intuitor_reference)
    assert _differs(b, adv, intuitor_reference, partial(intuitor_reference, c=1e9)) > 1e-4 or batch == "fixed"
