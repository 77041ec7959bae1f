"""baseline: b subtracted from the sequence reward, broadcast over the response tokens.

Signature: ``(batch: AdvantageBatch) -> (advantages [B, T], returns [B, T])``. Outcome
baselines return ``returns == advantages`` (verl's convention); ``gae`` returns A + V.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_torch import torch
from ..ops import AdvantageBatch, group_view, keyed_groups, keyed_moments, keyed_sum, masked_whiten, moments
from ..registry import Bool, Choice, Field, Float, Requires, register

if TYPE_CHECKING:
    from torch import Tensor


def _broadcast(a: Tensor, batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    adv = a.unsqueeze(-1) * batch.mask  # [B, T]
    return adv, adv


def GroupBy(what: str = "compare") -> Field:
    """The ``group_by`` parameter of the components that compare a group's samples."""
    return Field(f"a data field: {what} the rows with the same value of it (across prompts) instead "
                 "of a prompt's G samples (the runtime's group_keys input)", needs=("group_keys",))


def _shifted(r: Tensor, keys: Tensor) -> Tensor:
    """``r`` minus the reward of its key-group's first row: a constant group gives exactly 0."""
    group, k = keyed_groups(keys)
    rows = torch.arange(r.shape[0], device=r.device)
    first = torch.full((k,), r.shape[0], dtype=rows.dtype, device=r.device).scatter_reduce(
        0, group, rows, reduce="amin")  # [K] first row of each group
    return r - r[first[group]]


@register("baseline", off=True)
def none(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    """No baseline: the advantage is the reward itself.

    formula: A_i = r_i
    source: REINFORCE (Williams 1992)
    shapes: r [B] -> A [B, T]
    """
    return _broadcast(batch.rewards, batch)


@register("baseline")
def batch_mean(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    """Mean reward of the whole batch.

    formula: A_i = r_i - (1/B) sum_j r_j
    source: REINFORCE with a batch baseline; ROLL norm_mean_type=batch
    shapes: r [B] -> A [B, T]
    """
    d = batch.rewards - batch.rewards[:1]  # shifted by one sample: a constant batch gives exactly 0
    mean, _, _ = moments(d, batch.valid_rows)
    return _broadcast(d - mean, batch)


@register("baseline", decay=Float(0.9, "weight of the previous average", ge=0, lt=1),
          group_by=GroupBy("keep one average for"))
def ema(batch: AdvantageBatch, decay: float, group_by: str | None = None) -> tuple[Tensor, Tensor]:
    """Exponential moving average of past batch-mean rewards (state kept across steps).

    formula: A_i = r_i - b_{k-1};  b_k = {decay} b_{k-1} + (1 - {decay}) mean(r)
    source: REINFORCE with a running-average baseline (Williams 1992; Sutton & Barto 13.4);
      with group_by, one average per value of the field: per-role baselines of multi-agent and
      self-play training (e.g. MARFT, SPIRAL's role-conditioned advantage estimation)
    shapes: r [B] -> A [B, T]
    edge cases: the first batch uses b_0 = mean(r) of that batch (A has zero mean);
      with group_by=FIELD: b_k(v) = {decay} b_{k-1}(v) + (1 - {decay}) mean_{j: FIELD_j = v} r_j and
      A_i = r_i - b_{k-1}(FIELD_i), a value first seen starting from its own batch mean, a value
      absent from a batch keeping its average; rows whose reward failed leave every mean.
      The state is saved in checkpoints through CompiledAlgorithm.state_dict().
    """
    r = batch.rewards
    if group_by is not None:
        return _broadcast(r - _keyed_ema(batch, decay), batch)
    mean = moments(r, batch.valid_rows)[0].reshape(())
    prev = batch.state.get("ema_baseline")
    b = mean.detach() if prev is None else prev.to(r)
    batch.state["ema_baseline"] = (decay * b + (1 - decay) * mean).detach()
    return _broadcast(r - b, batch)


def _keyed_ema(batch: AdvantageBatch, decay: float) -> Tensor:
    """[B] each row's previous average b_{k-1}(key); moves the state (``ema_keys`` [K] int64 in
    ascending order, ``ema_values`` [K]) to b_k."""
    r, keys = batch.rewards.detach(), batch.group_keys.to(torch.int64)
    uniq = torch.unique(keys, sorted=True)  # [K]
    group, k = keyed_groups(keys)
    v = batch.valid_rows.to(r.dtype)
    n = keyed_sum(v, group, k)  # [K]
    mean = keyed_sum(r * v, group, k) / n.clamp_min(1)  # [K]
    old_keys = batch.state.get("ema_keys", torch.zeros(0, dtype=torch.int64)).to(keys.device)
    old = batch.state.get("ema_values", torch.zeros(0, dtype=r.dtype)).to(r)
    match = uniq.unsqueeze(-1) == old_keys.unsqueeze(0)  # [K, K_old]
    seen = match.any(-1)
    prev = torch.where(seen, old[match.to(torch.int64).argmax(-1)] if old.numel() else mean, mean)  # [K]
    new = torch.where(n > 0, decay * prev + (1 - decay) * mean, prev)
    keep = ~(old_keys.unsqueeze(-1) == uniq.unsqueeze(0)).any(-1)  # old keys absent from this batch
    scored = seen | (n > 0)  # a key never scored gets no average
    all_keys = torch.cat([old_keys[keep], uniq[scored]])
    order = torch.argsort(all_keys)
    batch.state["ema_keys"] = all_keys[order]
    batch.state["ema_values"] = torch.cat([old[keep], new[scored]])[order].detach()
    return prev[group]


SINGLETON = ("zero", "reward")


@register("baseline", per_group=True,
          singleton=Choice(SINGLETON, "zero",
                           "a group of one: A = 0 (TRL) or A = r (verl grpo: its mean is taken as 0)"),
          group_by=GroupBy())
def group_mean(batch: AdvantageBatch, singleton: str = "zero",
               group_by: str | None = None) -> tuple[Tensor, Tensor]:
    """Mean reward of the G responses to the same prompt.

    formula: A_i = r_i - mean_{j in g(i)} r_j
    source: GRPO (Shao et al. 2024); verl adv_estimator=grpo (norm_adv_by_std_in_grpo=False
      without a normalizer); TRL GRPOTrainer scale_rewards="none"; ROLL norm_mean_type=group
    shapes: r [B] -> A [B, T], groups contiguous (B = P*G)
    edge cases: a group of one is its own mean: A = 0 (TRL also gives 0); singleton=reward
      gives verl's grpo / reinforce_plus_plus_baseline / gpg rule (mean taken as 0: A = r).
      group_by=FIELD: g(i) is every row of the batch whose FIELD equals row i's (across
      prompts, any size); rows whose reward failed leave the mean; a row with no other scorable
      row in its group is a group of one.
    """
    if group_by is not None:
        keys = batch.group_keys
        d = _shifted(batch.rewards, keys)  # [B]; exactly 0 for a constant group
        mean, _, n = keyed_moments(d, batch.valid_rows, keys)
        alone = batch.rewards if singleton == "reward" else torch.zeros_like(d)
        return _broadcast(torch.where(n > 1, d - mean, alone), batch)
    if singleton == "reward" and batch.group_size == 1:
        return _broadcast(batch.rewards, batch)
    r = group_view(batch.rewards, batch.group_size)  # [P, G]
    # Shift by one member first: the float mean of equal rewards (8 x 0.1) is not exactly 0.1,
    # and the ~1e-8 left in r - mean would be blown up to ~1e-2 by group_std (eps 1e-6).
    d = r - r[:, :1]  # [P, G]; exactly 0 for a constant group
    a = (d - d.mean(dim=1, keepdim=True)).reshape(-1)  # [B]
    return _broadcast(a, batch)


@register("baseline", per_group=True,
          singleton=Choice(("zero", "reward"), "zero",
                           "advantage of a sample with no scorable other in its group: 0 (TRL) "
                           "or its own reward (verl rloo)"),
          group_by=GroupBy())
def leave_one_out(batch: AdvantageBatch, singleton: str, group_by: str | None = None) -> tuple[Tensor, Tensor]:
    """Mean reward of the other G-1 responses to the same prompt.

    formula: A_i = r_i - (1/(G-1)) sum_{j in g(i), j != i} r_j  =  G/(G-1) (r_i - mean_g r)
    source: RLOO (Ahmadian et al. 2024; Kool et al. 2019); verl adv_estimator=rloo;
      TRL RLOOTrainer
    shapes: r [B] -> A [B, T]
    edge cases: samples whose reward failed are left out: K-1 counts the scorable others (TRL).
      A sample with no scorable other (a group of one, or the only scorable sample of its
      group) has no baseline: A = 0 with singleton=zero (TRL: advantages 0 when
      num_generations is 1; no gradient from an unbaselined reward), A = r with
      singleton=reward (verl rloo; verl's rloo_vectorized gives 0). group_by=FIELD: g(i) is
      every row whose FIELD equals row i's (across prompts, any size).
    """
    if group_by is not None:
        keys, v = batch.group_keys, batch.valid_rows
        d = _shifted(batch.rewards, keys)  # [B]
        group, n_groups = keyed_groups(keys)
        k = keyed_sum(v.to(d.dtype), group, n_groups)[group]  # [B] valid members (K)
        total = keyed_sum(d * v.to(d.dtype), group, n_groups)[group]  # [B]
        others = (total - d) / (k - 1).clamp_min(1)
        alone = batch.rewards if singleton == "reward" else torch.zeros_like(d)
        return _broadcast(torch.where(k > 1, d - others, alone), batch)
    G = batch.group_size
    r, v = group_view(batch.rewards, G), group_view(batch.valid_rows, G)  # [P, G]
    d = r - r[:, :1]  # shifted by one member so a constant group gives exactly 0
    _, _, k = moments(d, v)  # [P, 1] valid members (K)
    total = (d * v).sum(dim=1, keepdim=True)  # [P, 1]
    others = (total - d) / (k - 1).clamp_min(1)  # [P, G] mean of the other K-1
    alone = r if singleton == "reward" else torch.zeros_like(r)  # [P, G] no other sample
    a = torch.where(k > 1, d - others, alone)
    return _broadcast(a.reshape(-1), batch)


@register("baseline", needs=("values",), token_rewards=True,
          gamma=Float(1.0, "discount", ge=0, le=1),
          lam=Float(0.95, "GAE lambda", ge=0, le=1))
def gae(batch: AdvantageBatch, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation with a critic, over the response tokens.

    formula: delta_t = r_t + {gamma} V_{t+1} - V_t;  A_t = delta_t + {gamma}*{lam} A_{t+1};  returns R_t = A_t + V_t
    source: Schulman et al. 2016 (GAE), PPO for RLHF; verl compute_gae_advantage_return
      (masked tokens carry V and A through unchanged); ROLL lambd=0.95, verl default lam=1.0
    shapes: token_rewards [B, T], values [B, T] -> A [B, T], R [B, T]
    """
    if batch.values is None:
        raise ValueError("baseline gae needs critic values: pass values= to estimate()")
    r, v, m = batch.token_rewards, batch.values.detach().to(batch.token_rewards), batch.mask
    B, T = r.shape
    adv = torch.zeros_like(r)
    next_value = torch.zeros(B, dtype=r.dtype, device=r.device)
    last = torch.zeros(B, dtype=r.dtype, device=r.device)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        cand = delta + gamma * lam * last
        next_value = v[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last = cand * m[:, t] + (1 - m[:, t]) * last
        adv[:, t] = last
    returns = adv + v
    return adv * m, returns * m


@register("baseline", token_rewards=True, gamma=Float(1.0, "discount per response token", ge=0, le=1))
def return_to_go(batch: AdvantageBatch, gamma: float) -> tuple[Tensor, Tensor]:
    """Discounted return-to-go of the token rewards, no baseline (REINFORCE++).

    formula: G_t = r_t + {gamma} G_t',  t' the next response token (mask 1) after t;  A_t = R_t = G_t
    source: REINFORCE++ (Hu 2025, arXiv 2501.03262); verl adv_estimator=reinforce_plus_plus
      (algorithm.gamma; whitened afterwards: pair with `normalizer whiten`)
    shapes: token_rewards [B, T] -> A [B, T], R [B, T] (0 on padding)
    edge cases: masked positions are skipped: their reward is dropped and they add no discount
      step (verl carries the running return through observation tokens unchanged). With an
      outcome reward and no KL in the reward, every token of a row gets r (for gamma = 1).
    """
    r, m = batch.token_rewards, batch.mask
    B, T = r.shape
    out = torch.zeros_like(r)
    running = torch.zeros(B, dtype=r.dtype, device=r.device)
    for t in reversed(range(T)):
        new = r[:, t] + gamma * running
        out[:, t] = new * m[:, t]
        running = torch.where(m[:, t] > 0, new, running)
    return out, out


@register("baseline", per_group=True)
def length_weighted_mean(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    """Length-weighted mean reward of the group: OPO's optimal baseline.

    formula: A_i = r_i - sum_{j in g(i)} L_j r_j / sum_{j in g(i)} L_j,  L_j = response length
    source: OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585);
      verl adv_estimator=opo
    shapes: r [B], mask [B, T] -> A [B, T]
    edge cases: a group of one has baseline 0 (A = r, verl); a group whose responses are all
      empty has baseline 0 (verl divides 0 by 0); samples whose reward failed are left out of
      the weighted mean; a constant group gives exactly 0.
    """
    G = batch.group_size
    r = group_view(batch.rewards, G)  # [P, G]
    w = group_view(batch.lengths * batch.valid_rows.to(batch.lengths.dtype), G)  # [P, G]
    if G == 1:
        return _broadcast(batch.rewards, batch)
    d = r - r[:, :1]  # shifted by one member so a constant group gives exactly 0
    total = w.sum(dim=1, keepdim=True)  # [P, 1]
    b = (w * d).sum(dim=1, keepdim=True) / total.clamp_min(1)
    a = torch.where(total > 0, d - b, r)
    return _broadcast(a.reshape(-1), batch)


@register("baseline", per_group=True)
def leave_one_out_max(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    """Max-reward leave-one-out: only each group's best sample gets its margin over the second best.

    formula: A_i = max_{j in g(i)} r_j - max_{j in g(i), j != i} r_j  (= r_max - r_2nd for the argmax, 0 for the others)
    source: verl adv_estimator=grpo_passk (pass@k training; its docstring cites arXiv 2503.19595):
      the leave-one-out gradient of E[max of the group's rewards]; with `normalizer group_std`
      it is verl's norm_adv_by_std_in_grpo=True (the default)
    shapes: r [B] -> A [B, T]
    edge cases: needs G >= 2 (verl raises too); ties for the best give 0 to every sample; the
      first of equal maxima is the argmax; samples whose reward failed are never the best, and
      a group with fewer than two scorable samples gets 0.
    """
    G = batch.group_size
    if G < 2:
        raise ValueError("baseline leave_one_out_max needs at least 2 samples per group (rollout.n >= 2)")
    v = group_view(batch.valid_rows, G)  # [P, G]
    r = group_view(batch.rewards, G).masked_fill(~v, -float("inf"))  # [P, G]
    top = torch.topk(r, 2, dim=1).values  # [P, 2]
    margin = torch.where(v.sum(dim=1) >= 2, top[:, 0] - top[:, 1], torch.zeros_like(top[:, 0]))  # [P]
    best = torch.nn.functional.one_hot(r.argmax(dim=1), G).to(r.dtype)  # [P, G]
    a = (best * margin.unsqueeze(-1)).reshape(-1)  # [B]
    return _broadcast(a, batch)


@register("baseline", needs=("reward_baselines",), token_rewards=True)
def greedy_reward(batch: AdvantageBatch) -> tuple[Tensor, Tensor]:
    """Reward of a greedy (temperature 0) rollout of the same prompt: ReMax.

    formula: R_t = sum_{t' >= t} r_t' (response tokens);  A_t = R_t - r_greedy,  r_greedy = reward of the greedy response to the prompt
    source: ReMax (Li et al. 2023, arXiv 2310.10505); verl adv_estimator=remax
      (compute_remax_outcome_advantage: reverse cumsum of the token rewards minus the baseline
      on every response token, not whitened; the trainer generates one greedy response per
      prompt with do_sample=False and scores it with the same reward function)
    shapes: token_rewards [B, T], reward_baselines [B] -> A [B, T], R [B, T] (returns, as verl)
    edge cases: the baseline is the same for the G samples of a prompt (verl repeats it); a
      KL in the reward enters through the token rewards as in verl; a non-finite baseline (the
      greedy reward failed) gives A = 0 on that row (no baseline, no gradient) -- verl has no rule.
    """
    if batch.reward_baselines is None:
        raise ValueError("baseline greedy_reward needs reward_baselines= (the greedy rollout's reward "
                         "of each row's prompt) in estimate()")
    m = batch.mask
    returns = (batch.token_rewards * m).flip(-1).cumsum(-1).flip(-1)  # [B, T] reward-to-go
    b = batch.reward_baselines.to(returns)  # [B]
    ok = torch.isfinite(b)
    adv = returns - torch.where(ok, b, torch.zeros_like(b)).unsqueeze(-1) * m  # [B, T]
    adv = torch.where(ok.unsqueeze(-1), adv, torch.zeros_like(adv))
    return adv, returns


ALIGN = ("position", "response_token")


@register("baseline", needs=("old_logprobs", "sum_pi_squared"), per_group=True, token_rewards=True,
          zero_tail=Bool(True, "a group's single longest response gets no baseline past the "
                               "second longest (verl handle_zero_tail)"),
          align=Choice(ALIGN, "position",
                       "match the group's samples at the same response position (verl "
                       "optimal_token_baseline) or at their k-th unmasked token, skipping "
                       "masked holes such as tool outputs (verl tir_optimal_token_baseline)"),
          epsilon=Float(1e-8, "added to the weights' sum", gt=0))
def optimal_token(batch: AdvantageBatch, zero_tail: bool, align: str,
                  epsilon: float) -> tuple[Tensor, Tensor]:
    """Optimal token baseline: a per-position group baseline weighted by the realized energy W_t.

    formula: G_t = sum_{t' >= t} r_t';  w_j = 1 - 2 pi_j + sum_v pi_{j,v}^2 (old policy, tempered);  W_t = sum_{j <= t} w_j;  B_t = sum_{i in g} G_t^i W_t^i / (sum_{i in g} W_t^i + {epsilon});  A_t = G_t - B_t
    source: OTB (Li et al. 2026, arXiv 2602.07078); verl adv_estimator=optimal_token_baseline
      (compute_optimal_token_baseline_advantage; actor.calculate_sum_pi_squared=True) and,
      with align=response_token, adv_estimator=tir_optimal_token_baseline
      (compute_multi_turn_optimal_token_baseline_advantage); pi_j = exp(old logprob)
    shapes: token_rewards [B, T], mask [B, T], old_logprobs [B, T], sum_pi_squared [B, T] -> A [B, T], R [B, T] (returns, as verl)
    edge cases: a group of one has baseline 0 (A = G_t); zero_tail: when one response of a
      group is strictly the longest, its baseline is 0 from the second longest length on (A =
      G_t there); align=response_token leaves empty responses out of the group (its group
      size and zero_tail count only non-empty ones); padding gets A = 0. verl also scales w by
      the squared rollout IS weights when its rollout correction computes them: not done here.
    """
    if batch.old_logprobs is None or batch.sum_pi_squared is None:
        raise ValueError("baseline optimal_token needs old_logprobs= and sum_pi_squared= (sum_v pi_v^2 "
                         "of the old policy at each response token) in estimate()")
    m = batch.mask  # [B, T]
    B, T = m.shape
    G = batch.group_size
    returns = (batch.token_rewards * m).flip(-1).cumsum(-1).flip(-1)  # [B, T] reward-to-go
    w = 1 - 2 * batch.old_logprobs.detach().to(m).exp() + batch.sum_pi_squared.detach().to(m)  # [B, T]
    W = (w * m).cumsum(-1)  # [B, T] realized energy
    lengths = m.sum(-1)  # [B]
    if align == "response_token":  # the k-th unmasked token of every row at column k
        k = (m.cumsum(-1) - 1).clamp_min(0).long()  # [B, T]
        slot = torch.where(m > 0, k, torch.full_like(k, T))  # masked -> a dump column
        R = returns.new_zeros(B, T + 1).scatter_(1, slot, returns * m)[:, :T]  # [B, T] compacted
        Wc = W.new_zeros(B, T + 1).scatter_(1, slot, W * m)[:, :T]  # [B, T]
        mc = (torch.arange(T, device=m.device) < lengths.unsqueeze(-1)).to(m)  # [B, T]
        member = lengths > 0  # empty responses leave the group
    else:
        R, Wc, mc = returns, W, m
        member = torch.ones_like(lengths, dtype=torch.bool)
    Rg, Wg, mg = (x.view(-1, G, T) for x in (R, Wc, mc))  # [P, G, T]
    b = (Rg * Wg * mg).sum(1, keepdim=True) / ((Wg * mg).sum(1, keepdim=True) + epsilon)  # [P, 1, T]
    inside = group_view(member, G)  # [P, G]
    n = inside.sum(1, keepdim=True)  # [P, 1] group size
    b = torch.where(n.unsqueeze(-1) > 1, b, torch.zeros_like(b)).expand(-1, G, -1)  # [P, G, T]
    if zero_tail:
        L = group_view(lengths, G).masked_fill(~inside, -1.0)  # [P, G]; non-members never count
        top = torch.topk(L, min(2, G), dim=1).values  # [P, 2] longest, second longest
        longest, second = top[:, :1], top[:, -1:]  # [P, 1]
        alone = (L == longest) & ((L == longest).sum(1, keepdim=True) == 1) & (longest > second) & (n > 1)
        cols = torch.arange(T, device=m.device).view(1, 1, T)
        b = torch.where(alone.unsqueeze(-1) & (cols >= second.unsqueeze(-1)), torch.zeros_like(b), b)
    adv = Rg - b  # [P, G, T]
    if align == "response_token":
        adv = adv.reshape(B, T).gather(1, torch.where(m > 0, k, torch.zeros_like(k)))  # back to positions
    return adv.reshape(B, T) * m, returns
WHITEN = ("none", "samples", "tokens")


@register("baseline", per_group=True, needs=("reward_components", "reward_weights"),
          requires=Requires("normalizer", "none", "the component scales and whitens the advantage itself"),
          eps=Float(1e-6, "added to each reward function's group std (verl 1e-6, TRL 1e-4)", ge=0),
          std=Bool(True, "divide by the group std (verl norm_adv_by_std_in_grpo; TRL always)"),
          singleton=Choice(SINGLETON, "reward",
                           "a group of one: A_k = 0 (TRL: std 0) or A_k = r_k / (1 + eps) (verl: mean 0, std 1)"),
          whiten=Choice(WHITEN, "tokens", "after the weighted sum: none, over the batch's samples "
                        "(TRL, std + whiten_eps) or over its response tokens (verl masked_whiten)"),
          whiten_eps=Float(1e-8, "TRL 1e-4 added to the std (samples); verl 1e-8 added to the variance (tokens)",
                           ge=0))
def per_reward_group(batch: AdvantageBatch, eps: float, std: bool, singleton: str, whiten: str,
                     whiten_eps: float) -> tuple[Tensor, Tensor]:
    """GDPO: normalise each reward function's column per group, sum with the weights, whiten.

    formula: A_ik = (r_ik - mean_{j in g(i)} r_jk) / (std_{j in g(i)} r_jk + {eps});  S_i = sum_k w_k A_ik;  A_i = whiten(S) ({whiten}, {whiten_eps})
    source: GDPO (NVIDIA 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization
      for Multi-reward RL Optimization", arXiv 2601.05242); verl adv_estimator=gdpo
      (compute_gdpo_outcome_advantage: grpo per gdpo_reward_keys column, gdpo_reward_weights,
      masked_whiten over response tokens); TRL multi_objective_aggregation="normalize_then_sum"
      with reward_weights (eps 1e-4 on the group std, then (S - mean S) / (std S + 1e-4) over samples)
    shapes: reward_components [B, K], reward_weights [K] -> A [B, T] (returns == A)
    edge cases: stds are Bessel's; a zero-variance column gives A_ik = 0; a non-finite r_ik is
      left out of its column's statistics and of the sum (TRL's nanmean/nanstd/nansum); rows
      whose reward failed (valid False) leave every statistic; `rewards` (the weighted sum and
      its shaping) is not read, as in both peers; whiten=tokens with < 2 tokens leaves S as is.
    """
    comps = batch.reward_components
    if comps is None:
        raise ValueError("baseline per_reward_group needs reward_components= ([B, K], one column per "
                         "reward function) in estimate()")
    G, K = batch.group_size, comps.shape[1]
    w = (torch.ones(K) if batch.reward_weights is None else batch.reward_weights).to(torch.float32)
    x = comps.to(torch.float32)  # [B, K]
    ok = torch.isfinite(x) & batch.valid_rows.unsqueeze(-1)  # [B, K]
    xc = torch.where(ok, x, torch.zeros_like(x))
    xg = xc.view(-1, G, K).transpose(1, 2)  # [P, K, G]
    og = ok.view(-1, G, K).transpose(1, 2)
    mean, s, n = moments(xg, og, True)  # [P, K, 1]
    if singleton == "reward":
        mean = torch.where(n < 2, torch.zeros_like(mean), mean)  # verl: mean 0, std 1
    else:
        s = torch.where(n < 2, torch.zeros_like(s), s)  # TRL: std 0 (the numerator is 0)
    a = xg - mean
    if std:
        a = a / (s + eps)
    a = torch.where(og, a, torch.zeros_like(a)).transpose(1, 2).reshape(-1, K)  # [B, K]
    summed = (a * w.to(a).unsqueeze(0)).sum(-1)  # [B]
    if whiten == "samples":
        m, sd, _ = moments(summed, batch.valid_rows, True)
        summed = (summed - m) / (sd + whiten_eps)
        adv = summed.unsqueeze(-1) * batch.mask
        return adv, adv
    adv = summed.unsqueeze(-1) * batch.mask  # [B, T]
    if whiten == "tokens":
        adv = masked_whiten(adv, batch.mask, whiten_eps)
    return adv, adv
