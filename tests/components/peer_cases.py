"""The peers' options (TRL 1.16 GRPOConfig, verl 0.9.1 loss_mode / loss_agg_mode / kl_loss_type /
adv_estimator) each paired with the spec lines that reproduce it and the independent reference
in peer_refs.py. Used by test_peer_losses.py / test_peer_estimators.py and by
measure_peer_errors.py (which prints the table in docs/peers.md).

Batches are float64 for the losses (exactness is the point) and go through ``estimate`` (float32)
for the advantages. They hold the edge cases: an empty row, a zero-advantage row, log ratios of
+-25 (beyond verl's +-20 clamps and every clip bound), reference log ratios of 25 (beyond k3's
clamps), zero-variance, tied and all-zero reward groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

import correction_refs as CR
import peer_refs as R
from component_refs import spec_fn

T_MAX = 16  # max_completion_length / loss_scale_factor used by the cases


# ---------------------------------------------------------------------------- batches


def loss_batch(seed: int, B: int = 8, T: int = 12) -> dict[str, Tensor]:
    """float64 per-token inputs with every edge case of the losses (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    logp = (0.05 + 0.9 * torch.rand(B, T, generator=g, dtype=dt)).log()
    old = (logp + 0.7 * torch.randn(B, T, generator=g, dtype=dt)).clamp(max=-1e-3)
    ref = (logp + 0.5 * torch.randn(B, T, generator=g, dtype=dt)).clamp(max=-1e-3)
    # ratios far outside every bound: rho = e^25 (old far below) and rho = e^-25 (pi tiny);
    # the tiny-pi token also has log pi_ref - log pi = 25, beyond k3's exponent clamp
    old[1, 0] = logp[1, 0] - 25.0
    logp[2, 1], old[2, 1], ref[2, 1] = -27.0, -2.0, -2.0
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    lengths[3] = 0  # an empty row
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).to(dt)
    a = torch.randn(B, generator=g, dtype=dt)
    a[4] = 0.0  # a zero-advantage (zero-variance group) row
    ent = 2 * torch.rand(B, T, generator=g, dtype=dt)
    roll = old + 0.3 * torch.randn(B, T, generator=g, dtype=dt)  # the engine's logprobs (drawn last)
    return dict(logp=logp, old=old, ref=ref, mask=mask, a=a, adv=a.unsqueeze(-1) * mask, ent=ent, roll=roll)


def reward_batch(seed: int, G: int, P: int = 4, T: int = 10) -> dict[str, Tensor]:
    """float32 rewards in {0, 0.5, 1} (ties), group 0 constant, group 1 all zero when G > 1,
    an empty row, a right-padded mask; old/ref logprobs for KL in the reward; critic values."""
    g = torch.Generator().manual_seed(1000 + seed)
    B = P * G
    r = torch.randint(0, 3, (B,), generator=g).float() / 2
    if G > 1:
        r[:G] = r[0]
        r[G:2 * G] = 0.0
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[min(B - 1, 2 * G + 1)] = 0
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).float()
    old = -torch.rand(B, T, generator=g) * 3
    ref = old + 0.3 * torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    greedy = (torch.randint(0, 3, (P,), generator=g).float() / 2).repeat_interleave(G)  # one per prompt
    # sum_v pi_v^2 of the old policy: from ~pi^2 (the rest spread thin) to pi^2 + (1 - pi)^2 (the
    # rest on one other token); drawn after the fields above so they keep their values
    pi = old.exp()
    spp = pi ** 2 + (1 - pi) ** 2 * torch.rand(B, T, generator=g)
    # two reward functions (GDPO): column 0 is r itself, column 1 a length-like score in [-1, 0]
    # with ties; a zero-variance group in it too; w their weights (r is not their weighted sum:
    # the per-function estimators do not read it)
    fmt = -torch.randint(0, 5, (B,), generator=g).float() / 4
    fmt[2 * G:3 * G] = -0.5
    comps, w = torch.stack([r, fmt], dim=1), torch.tensor([1.0, 0.5])
    return dict(r=r, mask=mask, G=G, old=old, ref=ref, values=values, greedy=greedy, spp=spp, comps=comps, w=w)


def token_level_rewards(r: Tensor, mask: Tensor) -> Tensor:
    """verl's layout: the outcome reward on the last response token (column 0 of an empty row)."""
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    lengths = mask.sum(-1).long()
    for i in range(B):
        out[i, max(int(lengths[i]) - 1, 0)] = float(r[i])
    return out


# ---------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class LossCase:
    peer: str
    option: str
    spec: str                        # slot lines, one per line
    ref: Callable[[dict], Tensor]    # batch -> scalar loss, differentiable in b["logp"]
    kw: dict = field(default_factory=dict)  # what fn.loss needs besides the four tensors

    @property
    def name(self) -> str:
        return f"{self.peer} {self.option}"


@dataclass(frozen=True)
class AdvCase:
    peer: str
    option: str
    spec: str
    ref: Callable[[dict], Tensor]    # batch -> advantages [B, T] (float64)
    group_sizes: tuple[int, ...] = (1, 4)
    estimate_kw: tuple[str, ...] = ()  # "kl" (old/ref logprobs), "values", "greedy" (reward_baselines),
    #                                    "otb" (old_logprobs, sum_pi_squared) or "comps" (reward_components, reward_weights)

    @property
    def name(self) -> str:
        return f"{self.peer} {self.option}"


TRL, VERL = "TRL", "verl"
A = "ratio token(clamp=80.0)\n"  # TRL does not clamp log rho; 80 is out of reach (and float32-safe)


def _trl(**kw):
    return lambda b: R.trl_loss(b["logp"], b["old"], b["a"], b["mask"], ref_per_token_logps=b["ref"],
                                entropies=b["ent"], **kw)


def _verl(fn, **kw):
    return lambda b: fn(b["old"], b["logp"], b["adv"], b["mask"], **kw)


def _verl_kl(kind: str, beta: float = 0.1):
    """verl actor loss with use_kl_loss: gpg policy loss + kl_loss_coef * agg(kl_penalty)."""
    return lambda b: (R.verl_gpg_loss(b["old"], b["logp"], b["adv"], b["mask"])
                      + beta * R.verl_agg_loss(R.verl_kl_penalty(b["logp"], b["ref"], kind), b["mask"],
                                               "token-mean"))


LOSS_CASES: list[LossCase] = [
    # ---------------------------------------------------------------- TRL GRPOTrainer
    LossCase(TRL, 'loss_type="grpo"', A + "trust_region clip(low=0.2, high=0.28)\n"
             "aggregation seq_mean_token_mean(count_empty=true)", _trl(loss_type="grpo", epsilon_high=0.28)),
    LossCase(TRL, 'loss_type="bnpo"', A + "trust_region clip(low=0.2, high=0.28)\naggregation token_mean",
             _trl(loss_type="bnpo", epsilon_high=0.28)),
    LossCase(TRL, 'loss_type="dr_grpo"', A + "trust_region clip(low=0.2, high=0.2)\n"
             f"aggregation token_sum_norm(max_tokens={T_MAX})",
             _trl(loss_type="dr_grpo", max_completion_length=T_MAX)),
    LossCase(TRL, 'loss_type="dapo"', A + "trust_region clip(low=0.2, high=0.28)\naggregation token_mean",
             _trl(loss_type="dapo", epsilon_high=0.28)),
    LossCase(TRL, 'loss_type="cispo", epsilon_high=5.0', A + "objective is_weighted\n"
             "trust_region truncate(high=4.0)\naggregation token_mean", _trl(loss_type="cispo", epsilon_high=5.0)),
    LossCase(TRL, 'loss_type="cispo", epsilon_high=None (cap 0.2)', A + "objective is_weighted\n"
             "trust_region truncate(high=-0.8)\naggregation token_mean", _trl(loss_type="cispo")),
    LossCase(TRL, 'loss_type="sapo"', A + "trust_region soft_gate(tau_pos=1.0, tau_neg=1.05)\n"
             "aggregation seq_mean_token_mean(count_empty=true)", _trl(loss_type="sapo")),
    LossCase(TRL, 'loss_type="luspo", importance_sampling_level="sequence"',
             "ratio sequence(clamp=80.0)\ntrust_region clip(low=0.2, high=0.28)\n"
             "aggregation seq_mean_token_sum(count_empty=true)",
             _trl(loss_type="luspo", epsilon_high=0.28, importance_sampling_level="sequence")),
    LossCase(TRL, 'loss_type="vespo"', "ratio product(clamp=20.0)\nobjective is_weighted\n"
             "trust_region gamma_weight(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)\n"
             "aggregation token_mean", _trl(loss_type="vespo")),
    LossCase(TRL, 'importance_sampling_level="sequence" (GSPO)', "ratio sequence(clamp=80.0)\n"
             "trust_region clip(low=0.0003, high=0.0004)\naggregation seq_mean_token_mean(count_empty=true)",
             _trl(loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence")),
    LossCase(TRL, "delta=4.0 (INTELLECT-2)", A + "trust_region dual_clip(low=0.2, high=0.28, c=4.0)\n"
             "aggregation token_mean", _trl(loss_type="dapo", epsilon_high=0.28, delta=4.0)),
    LossCase(TRL, "delta=1.1 < 1 + epsilon_high", A + "trust_region dual_clip(low=0.2, high=0.1, c=1.28)\n"
             "aggregation token_mean", _trl(loss_type="dapo", epsilon_high=0.28, delta=1.1)),
    LossCase(TRL, "beta=0.04 (use_bias_correction_kl=True)", A + "trust_region clip(low=0.2, high=0.2)\n"
             "kl k3(beta=0.04, where=loss, ratio_weighted=true)\naggregation token_mean",
             _trl(loss_type="dapo", beta=0.04), kw={"ref": True}),
    LossCase(TRL, "beta=0.04, use_bias_correction_kl=False", A + "trust_region clip(low=0.2, high=0.2)\n"
             "kl k3(beta=0.04, where=loss)\naggregation token_mean",
             _trl(loss_type="dapo", beta=0.04, use_bias_correction_kl=False), kw={"ref": True}),
    LossCase(TRL, "entropy_coef=0.01", A + "trust_region clip(low=0.2, high=0.2)\n"
             "entropy bonus(coef=0.01)\naggregation token_mean",
             _trl(loss_type="dapo", entropy_coef=0.01), kw={"entropy": True}),
    LossCase(TRL, "top_entropy_quantile=0.2", A + "trust_region clip(low=0.2, high=0.2)\naggregation token_mean\n"
             "selection top_entropy(quantile=0.2)", lambda b: CR.trl_selected(b, top_entropy_quantile=0.2),
             kw={"entropy": True}),
    LossCase(TRL, "off_policy_mask_threshold=0.1 (vLLM sampling logprobs)", A + "trust_region clip(low=0.2, high=0.2)\n"
             "aggregation token_mean\nselection off_policy_sequence(threshold=0.1)",
             lambda b: CR.trl_selected(b, off_policy_mask_threshold=0.1, sampling=b["roll"]), kw={"roll": True}),
    # ---------------------------------------------------------------- verl loss_mode
    LossCase(VERL, "loss_mode=vanilla", "trust_region dual_clip(low=0.2, high=0.28, c=3.0)",
             _verl(R.verl_vanilla, clip_ratio_high=0.28)),
    LossCase(VERL, "loss_mode=gspo (seq-mean-token-mean)", "ratio sequence(clamp=10.0)\n"
             "trust_region clip(low=0.0003, high=0.0004)\naggregation seq_mean_token_mean",
             _verl(R.verl_gspo)),
    LossCase(VERL, "loss_mode=gspo (token-mean, verl's default agg)", "ratio sequence(clamp=10.0)\n"
             "trust_region clip(low=0.0003, high=0.0004)\naggregation token_mean",
             _verl(R.verl_gspo, agg="token-mean")),
    LossCase(VERL, "loss_mode=sapo", "trust_region soft_gate(tau_pos=1.0, tau_neg=1.05)\n"
             "aggregation seq_mean_token_mean", _verl(R.verl_sapo)),
    LossCase(VERL, "loss_mode=gpg", "objective reinforce", _verl(R.verl_gpg_loss)),
    LossCase(VERL, "loss_mode=cispo (clip_ratio_low=10)", "objective is_weighted\ntrust_region truncate(high=0.2)",
             _verl(R.verl_cispo, clip_ratio_low=10.0, clip_ratio_high=0.2)),
    LossCase(VERL, "loss_mode=cispo (two-sided 0.2/0.28)", "objective is_weighted\n"
             "trust_region truncate(low=0.2, high=0.28)", _verl(R.verl_cispo, clip_ratio_high=0.28)),
    LossCase(VERL, "loss_mode=dro (dro_beta=0.05)", "ratio token(clamp=80.0)\nobjective dro(beta=0.05)",
             _verl(R.verl_dro, dro_beta=0.05)),
    LossCase(VERL, "loss_mode=dppo_tv", "objective is_weighted\ntrust_region tv(low=0.15, high=0.15, cap=3.0)",
             _verl(R.verl_dppo, kind="tv", low=0.15, high=0.15)),
    LossCase(VERL, "loss_mode=dppo_kl", "objective is_weighted\ntrust_region kl_div(low=0.05, high=0.05, cap=3.0)",
             _verl(R.verl_dppo, kind="kl", low=0.05, high=0.05)),
    LossCase(VERL, "loss_mode=geo_mean (GMPO, clip_ratio 0.4, no clamp)", "ratio geo_mean(low=0.4, high=0.4)\n"
             "aggregation seq_mean_token_mean(count_empty=true)", _verl(R.verl_geo_mean)),
    LossCase(VERL, "loss_mode=geo_mean (clip_ratio_low/high 0.2/0.28, +-20 clamp on)",
             "ratio geo_mean(low=0.2, high=0.28, clamp=20.0)\naggregation seq_mean_token_mean(count_empty=true)",
             _verl(R.verl_geo_mean, clip_ratio_low=0.2, clip_ratio_high=0.28, clamp_20=True)),
    LossCase(VERL, "loss_mode=clip_cov (clip_cov_ratio=0.05, lb 1, ub 5)", A + "trust_region clip(low=0.2, high=0.2)\n"
             "selection clip_cov(ratio=0.05, lb=1.0, ub=5.0, seed=3)",
             _verl(R.verl_clip_cov, seed=3, clip_cov_ratio=0.05)),
    LossCase(VERL, "loss_mode=clip_cov (defaults: clip_cov_ratio=2e-4, one token)", A + "trust_region clip(low=0.2, high=0.2)\n"
             "selection clip_cov(seed=7)", _verl(R.verl_clip_cov, seed=7)),
    LossCase(VERL, "loss_mode=kl_cov (kl_cov_ratio=0.05, ppo_kl_coef=1)", A + "objective kl_cov(ratio=0.05, coef=1.0)",
             _verl(R.verl_kl_cov, kl_cov_ratio=0.05, ppo_kl_coef=1.0)),
    LossCase(VERL, "loss_mode=kl_cov (defaults: kl_cov_ratio=2e-4, one token; ppo_kl_coef=0.1)", A + "objective kl_cov",
             _verl(R.verl_kl_cov)),
    LossCase(VERL, "loss_mode=bypass_mode, loss_type=ppo_clip", "trust_region dual_clip(low=0.2, high=0.28, c=3.0)\n"
             "correction bypass", lambda b: CR.verl_bypass(b, "ppo_clip"), kw={"roll": True}),
    LossCase(VERL, 'loss_mode=bypass_mode, ppo_clip, rollout_rs="token_k1", "0.5_2.0"',
             "trust_region dual_clip(low=0.2, high=0.28, c=3.0)\ncorrection bypass, reject(stat=token_k1, low=0.5, high=2.0)",
             lambda b: CR.verl_bypass(b, "ppo_clip", rs=[dict(rollout_rs="token_k1", threshold=2.0, threshold_lower=0.5)]),
             kw={"roll": True}),
    LossCase(VERL, 'loss_mode=bypass_mode, loss_type=reinforce, rollout_is="token", 2.0',
             "objective reinforce\ncorrection bypass, importance(level=token, high=2.0)",
             lambda b: CR.verl_bypass(b, "reinforce", is_kw=dict(rollout_is="token")), kw={"roll": True}),
    # ---------------------------------------------------------------- verl loss_agg_mode
    LossCase(VERL, "loss_agg_mode=token-sum", "trust_region dual_clip\naggregation token_sum",
             _verl(R.verl_vanilla, agg="token-sum")),
    LossCase(VERL, "loss_agg_mode=seq-mean-token-sum", "trust_region dual_clip\naggregation seq_mean_token_sum",
             _verl(R.verl_vanilla, agg="seq-mean-token-sum")),
    LossCase(VERL, "loss_agg_mode=seq-mean-token-mean (in the trainer)", "trust_region dual_clip\n"
             "aggregation seq_mean_token_mean(count_empty=true)",
             _verl(R.verl_vanilla, agg="seq-mean-token-mean", global_batch_size=8)),
    LossCase(VERL, f"loss_agg_mode=seq-mean-token-sum-norm, loss_scale_factor={T_MAX}", "trust_region dual_clip\n"
             f"aggregation token_sum_norm(max_tokens={T_MAX})",
             _verl(R.verl_vanilla, agg="seq-mean-token-sum-norm", loss_scale_factor=T_MAX, global_batch_size=8)),
    # ---------------------------------------------------------------- verl kl_loss_type
    *[LossCase(VERL, f"kl_loss_type={k}", f"objective reinforce\nkl {spec}", _verl_kl(k), kw={"ref": True})
      for k, spec in [("k1", "k1(beta=0.1, where=loss)"), ("abs", "abs(beta=0.1, where=loss)"),
                      ("mse", "k2(beta=0.1, where=loss)"),
                      ("low_var_kl", "k3(beta=0.1, where=loss, clamp=true)"),
                      ("k1+", "k1(beta=0.1, where=loss, straight_through=true)"),
                      ("abs+", "abs(beta=0.1, where=loss, straight_through=true)"),
                      ("k3+", "k3(beta=0.1, where=loss, clamp=true, straight_through=true)")]],
]


def _tlr(b):
    return token_level_rewards(b["r"], b["mask"])


def _idx(b):
    return [i // b["G"] for i in range(b["r"].shape[0])]


def _m(b):
    return b["mask"].double()


def _verl_kl_rewards(b, beta=0.1):
    """apply_kl_penalty: token rewards minus beta * k1(old, ref) on the response tokens."""
    return _tlr(b) - beta * (b["old"].double() - b["ref"].double()) * _m(b)


ADV_CASES: list[AdvCase] = [
    AdvCase(TRL, 'scale_rewards="group"', "baseline group_mean\nnormalizer group_std(eps=0.0001)",
            lambda b: R.trl_advantages(b["r"].double(), b["G"], "group").unsqueeze(-1) * _m(b)),
    AdvCase(TRL, 'scale_rewards="batch"', "baseline group_mean\nnormalizer batch_std(eps=0.0001)",
            lambda b: R.trl_advantages(b["r"].double(), b["G"], "batch").unsqueeze(-1) * _m(b)),
    AdvCase(TRL, 'scale_rewards="none"', "baseline group_mean",
            lambda b: R.trl_advantages(b["r"].double(), b["G"], "none").unsqueeze(-1) * _m(b)),
    AdvCase(VERL, "adv_estimator=grpo", "baseline group_mean(singleton=reward)\nnormalizer group_std(eps=1e-6)",
            lambda b: R.verl_grpo(_tlr(b), _m(b), _idx(b))),
    AdvCase(VERL, "adv_estimator=grpo, norm_adv_by_std_in_grpo=False", "baseline group_mean(singleton=reward)",
            lambda b: R.verl_grpo(_tlr(b), _m(b), _idx(b), norm_adv_by_std_in_grpo=False)),
    AdvCase(VERL, "adv_estimator=rloo", "baseline leave_one_out(singleton=reward)",
            lambda b: R.verl_rloo(_tlr(b), _m(b), _idx(b))),
    AdvCase(VERL, "adv_estimator=rloo_vectorized", "baseline leave_one_out(singleton=zero)",
            lambda b: R.verl_rloo_vectorized(_tlr(b), _m(b), _idx(b))),
    AdvCase(VERL, "adv_estimator=opo", "baseline length_weighted_mean",
            lambda b: R.verl_opo(_tlr(b), _m(b), _idx(b))),
    AdvCase(VERL, "adv_estimator=grpo_passk", "baseline leave_one_out_max\nnormalizer group_std(eps=1e-6)",
            lambda b: R.verl_grpo_passk(_tlr(b), _m(b), _idx(b)), group_sizes=(2, 4)),
    AdvCase(VERL, "adv_estimator=grpo_passk, norm_adv_by_std_in_grpo=False", "baseline leave_one_out_max",
            lambda b: R.verl_grpo_passk(_tlr(b), _m(b), _idx(b), norm_adv_by_std_in_grpo=False),
            group_sizes=(2, 4)),
    AdvCase(VERL, "adv_estimator=gpg", "baseline group_mean(singleton=reward)\nnormalizer nonzero_rate",
            lambda b: R.verl_gpg(_tlr(b), _m(b), _idx(b))),
    AdvCase(VERL, "adv_estimator=gpg, f_norm=2", "baseline group_mean(singleton=reward)\n"
            "normalizer nonzero_rate(f_norm=2.0)", lambda b: R.verl_gpg(_tlr(b), _m(b), _idx(b), f_norm=2.0)),
    AdvCase(VERL, "adv_estimator=reinforce_plus_plus (gamma 0.9, k1 KL in the reward)",
            "baseline return_to_go(gamma=0.9)\nnormalizer whiten\nkl k1(beta=0.1, where=reward)",
            lambda b: R.verl_reinforce_plus_plus(_verl_kl_rewards(b), _m(b), gamma=0.9), estimate_kw=("kl",)),
    AdvCase(VERL, "adv_estimator=reinforce_plus_plus (outcome reward only)",
            "baseline return_to_go(gamma=1.0)\nnormalizer whiten",
            lambda b: R.verl_reinforce_plus_plus(_tlr(b), _m(b), gamma=1.0)),
    AdvCase(VERL, "adv_estimator=reinforce_plus_plus_baseline", "baseline group_mean(singleton=reward)\n"
            "normalizer whiten", lambda b: R.verl_reinforce_plus_plus_baseline(_tlr(b), _m(b), _idx(b))),
    AdvCase(VERL, "adv_estimator=remax", "baseline greedy_reward",
            lambda b: R.verl_remax(_tlr(b), b["greedy"].double(), _m(b))[0], estimate_kw=("greedy",)),
    AdvCase(VERL, "adv_estimator=remax, use_kl_in_reward (k1)", "baseline greedy_reward\nkl k1(beta=0.1, where=reward)",
            lambda b: R.verl_remax(_verl_kl_rewards(b), b["greedy"].double(), _m(b))[0],
            estimate_kw=("greedy", "kl")),
    AdvCase(VERL, "adv_estimator=optimal_token_baseline", "baseline optimal_token",
            lambda b: R.verl_optimal_token_baseline(_tlr(b), _m(b), _idx(b), b["old"].double(),
                                                    b["spp"].double())[0], estimate_kw=("otb",)),
    AdvCase(VERL, "adv_estimator=tir_optimal_token_baseline", "baseline optimal_token(align=response_token)",
            lambda b: R.verl_tir_optimal_token_baseline(_tlr(b), _m(b), _idx(b), b["old"].double(),
                                                        b["spp"].double())[0], estimate_kw=("otb",)),
    AdvCase(TRL, 'multi_objective_aggregation="normalize_then_sum" (GDPO), reward_weights',
            "baseline per_reward_group(eps=0.0001, singleton=zero, whiten=samples, whiten_eps=0.0001)\n"
            "normalizer none", lambda b: R.trl_normalize_then_sum(b["comps"].double(), b["G"], b["w"].double())
            .unsqueeze(-1) * _m(b), estimate_kw=("comps",)),
    AdvCase(VERL, "adv_estimator=gdpo, gdpo_reward_keys, gdpo_reward_weights",
            "baseline per_reward_group\nnormalizer none",
            lambda b: R.verl_gdpo([token_level_rewards(c, b["mask"]) for c in b["comps"].T], _m(b), _idx(b),
                                  b["w"].tolist()), estimate_kw=("comps",)),
    AdvCase(VERL, "adv_estimator=gdpo, norm_adv_by_std_in_grpo=False",
            "baseline per_reward_group(std=false)\nnormalizer none",
            lambda b: R.verl_gdpo([token_level_rewards(c, b["mask"]) for c in b["comps"].T], _m(b), _idx(b),
                                  b["w"].tolist(), norm_adv_by_std_in_grpo=False), estimate_kw=("comps",)),
    AdvCase(VERL, "adv_estimator=gae (gamma 1, lam 0.95)", "baseline gae(gamma=1.0, lam=0.95)\n"
            "normalizer whiten\ncritic value", lambda b: R.verl_gae(_tlr(b), b["values"].double(), _m(b), 1.0, 0.95)
            * _m(b), estimate_kw=("values",)),
]


# Rows of the peers' option lists that no spec reproduces (printed by measure_peer_errors.py).
NOT_EXPRESSIBLE: list[tuple[str, str, str]] = [
    (VERL, "kl_loss_type=full", "not implemented in verl either"),
]


# ---------------------------------------------------------------------------- runners

_FNS: dict[str, object] = {}


def fn_for(spec: str):
    """The eager CompiledAlgorithm of a spec (cached per process)."""
    if spec not in _FNS:
        _FNS[spec] = spec_fn(spec, name="peer")
    return _FNS[spec]


def run_loss(case: LossCase, b: dict) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(ours, reference) loss values and d loss / d logp [B, T] (padding included), float64."""
    fn = fn_for(case.spec)
    kw = {"group_size": 1}
    if case.kw.get("ref"):
        kw["ref_logprobs"] = b["ref"]
    if case.kw.get("entropy"):
        kw["entropy"] = b["ent"]
    if case.kw.get("roll"):
        kw["rollout_logprobs"] = b["roll"]
    lp = b["logp"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], b["adv"], b["mask"], **kw)
    (g,) = torch.autograd.grad(out.loss, lp)
    lp_ref = b["logp"].clone().requires_grad_(True)
    want = case.ref({**b, "logp": lp_ref})
    (g_ref,) = torch.autograd.grad(want, lp_ref)
    return out.loss.detach(), want.detach(), g, g_ref


def estimate_kwargs(case: AdvCase, b: dict) -> dict[str, Tensor]:
    """The optional estimate() inputs ``case`` needs, from the batch ``b``."""
    kw = {}
    if "kl" in case.estimate_kw:
        kw.update(old_logprobs=b["old"], ref_logprobs=b["ref"])
    if "values" in case.estimate_kw:
        kw["values"] = b["values"]
    if "greedy" in case.estimate_kw:
        kw["reward_baselines"] = b["greedy"]
    if "otb" in case.estimate_kw:
        kw.update(old_logprobs=b["old"], sum_pi_squared=b["spp"])
    if "comps" in case.estimate_kw:
        kw.update(reward_components=b["comps"], reward_weights=b["w"])
    return kw


def run_adv(case: AdvCase, b: dict) -> tuple[Tensor, Tensor]:
    """(ours via estimate(), reference) advantages [B, T], compared on response tokens."""
    est = fn_for(case.spec).estimate(b["r"], b["G"], b["mask"], **estimate_kwargs(case, b))
    return est.advantages.double() * _m(b), case.ref(b) * _m(b)
