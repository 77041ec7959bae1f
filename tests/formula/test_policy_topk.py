"""The policy's top-K in the formula language: the K axis ([B, T, K]) of ``topk_logp`` /
``old_topk_logp``, the ``is_top1`` flag, the reductions over K (``k_sum``, ``k_mean``, ``k_max``,
``k_min``), the shape rules around them and the top-K size ``K`` a reading formula declares.

SimKO (Peng et al. 2025, arXiv 2510.14807; algorithms/examples/simko.rl) written as a spec equals
an independent float64 transcription of the authors' loss (``compute_policy_loss_simko`` of
github.com/CLR-Lab/SimKO, verl/trainer/ppo/core_algos.py at f4bf432, with the ``max_token`` and
top-K inputs dp_actor.py at c090978 feeds it), value and gradients, eager and compiled."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rldsl
from rldsl.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
SIMKO = ROOT / "algorithms" / "examples" / "simko.rl"
K = 3


def _batch(seed: int, B: int = 6, T: int = 9, V: int = 11):
    """Logits of the current and old policies over V tokens, sampled tokens (many of them the old
    policy's top-1), a right-padded mask with an empty row, per-sequence advantages of both signs,
    binary rewards; the top-K ids are the old policy's (as the runtime takes them)."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    z = (1.5 * torch.randn(B, T, V, generator=g, dtype=dt)).requires_grad_()
    z_old = z.detach() + 0.4 * torch.randn(B, T, V, generator=g, dtype=dt)
    y = torch.randint(0, V, (B, T), generator=g)
    top1 = torch.rand(B, T, generator=g) < 0.5
    y = torch.where(top1, z_old.argmax(-1), y)
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    lengths[2] = 0
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).to(dt)
    reward = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0], dtype=dt)[:B]
    a = torch.where(reward > 0, 0.5 + torch.rand(B, generator=g, dtype=dt), -0.5 - torch.rand(B, generator=g, dtype=dt))
    return z, z_old, y, mask, a.unsqueeze(-1) * mask, reward


def _forward(z: torch.Tensor, z_old: torch.Tensor, y: torch.Tensor):
    """logp, entropy, top-K logprobs at the old policy's top-K ids (current and old), is-top-1."""
    lsm = torch.log_softmax(z, -1)
    old = torch.log_softmax(z_old, -1)
    ids = old.topk(K, dim=-1).indices
    logp = lsm.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    is_top1 = (z_old.argmax(-1) == y).to(z.dtype)
    return logp, ent, lsm.gather(-1, ids), old.gather(-1, ids), old.gather(-1, y.unsqueeze(-1)).squeeze(-1), is_top1


def simko_reference(old_log_prob, old_log_probs_topk, log_prob, topk_log_probs, entropy, advantages, eos_mask,
                    reward, max_token, cliprange=0.2, mix_topk_coef=0.01, tau=0.8, lam=1.1):
    """The authors' ``compute_policy_loss_simko`` written again: the high-entropy tokens of each row
    (entropy above the row's tau-quantile of its response tokens, torch.quantile's linear rule), on
    correct rows the mixed ratio (1 - m) r + m / K sum_k sg(r) / (sg(r_k) + 1e-8) r_k with
    m = coef on those tokens, on rows whose advantages sum below 0 the advantage times lam where the
    sampled token is the top-1 at such a token; PPO's clip; the masked token mean."""
    Kk = topk_log_probs.shape[-1]
    valid = eos_mask > 0
    rows = []
    for b in range(entropy.shape[0]):
        xb = entropy[b][valid[b]]
        rows.append(torch.quantile(xb if xb.numel() else entropy[b], tau))
    high = entropy > torch.stack(rows).unsqueeze(-1)
    ratio = torch.exp(log_prob - old_log_prob)
    rk = torch.exp(topk_log_probs - old_log_probs_topk)
    topk_sum = (ratio.detach().unsqueeze(-1) / (rk.detach() + 1e-8) * rk).sum(-1)
    m = mix_topk_coef * high.to(ratio.dtype) * valid.to(ratio.dtype)
    correct = (reward == 1).unsqueeze(-1) & valid
    ratio = torch.where(correct, (1 - m) * ratio + m / Kk * topk_sum, ratio)
    neg = (advantages.sum(-1) < 0).unsqueeze(-1) & (max_token > 0) & high
    adv = advantages * torch.where(neg, lam, 1.0)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - cliprange, 1 + cliprange))
    return (pg * eos_mask).sum() / eos_mask.sum()


def _check_simko(fn: rldsl.CompiledAlgorithm, seed: int) -> None:
    z, z_old, y, mask, adv, reward = _batch(seed)
    logp, ent, topk, old_topk, old_logp, is_top1 = _forward(z, z_old, y)
    # every regime of the method is reached on this batch
    q = torch.stack([torch.quantile(ent[b][mask[b] > 0], 0.8) if mask[b].any() else ent[b].max()
                     for b in range(len(ent))]).unsqueeze(-1)
    high = (ent > q) & (mask > 0)
    assert bool((high & (reward == 1).unsqueeze(-1)).any())
    assert bool((high & (reward == 0).unsqueeze(-1) & (is_top1 > 0)).any())
    r = torch.exp(logp - old_logp)[mask > 0]
    assert bool(((r < 0.8) | (r > 1.2)).any())

    out = fn.loss(logp, old_logp.detach(), adv, mask, entropy=ent.detach(), group_size=1, denominator=mask.sum(),
                  sequence_rewards=reward, policy_topk_logprobs=topk, old_topk_logprobs=old_topk.detach(),
                  is_top1=is_top1)
    (grad,) = torch.autograd.grad(out.loss, z)
    logp2, ent2, topk2, _, _, _ = _forward(z, z_old, y)
    want = simko_reference(old_logp.detach(), old_topk.detach(), logp2, topk2, ent2.detach(), adv, mask, reward,
                           is_top1)
    (grad_ref,) = torch.autograd.grad(want, z)
    assert abs(float(out.loss.detach()) - float(want.detach())) < 1e-6
    torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=0)
    assert float(grad.abs().max()) > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simko_equals_the_authors_loss(seed: int) -> None:
    _check_simko(rldsl.compile(rldsl.load(SIMKO), compile=False), seed)


@pytest.mark.compile
def test_simko_compiled_equals_the_authors_loss() -> None:
    fn = rldsl.compile(rldsl.load(SIMKO))
    assert fn.compiled
    _check_simko(fn, 0)


def test_the_top_k_mass_gets_the_gradient_of_every_candidate() -> None:
    """The top-K term alone: on a correct row the mixed ratio's gradient reaches each of the K
    candidates' logits (the mass over the top-K is lifted), which a plain PPO ratio never does."""
    z, z_old, y, mask, adv, reward = _batch(0)
    logp, ent, topk, old_topk, old_logp, is_top1 = _forward(z, z_old, y)
    spec = SIMKO.read_text().replace("coef = 0.01", "coef = 1.0").replace("tau = 0.8", "tau = 0")
    fn = rldsl.compile(rldsl.loads(spec, filename="simko_all.rl"), compile=False)
    out = fn.loss(logp, old_logp.detach(), adv, mask, entropy=ent.detach(), group_size=1, denominator=mask.sum(),
                  sequence_rewards=reward, policy_topk_logprobs=topk, old_topk_logprobs=old_topk.detach(),
                  is_top1=is_top1)
    (g,) = torch.autograd.grad(out.loss, topk)
    row = 0  # a correct row: every candidate of its high-entropy tokens has a gradient
    assert reward[row] == 1 and bool((g[row].abs().sum(-1) > 0).any())
    assert float(g[1].abs().max()) == 0.0  # a wrong row: the top-K term is off


# ----------------------------------------------------------------------------- the K reductions


def _spec(body: str, extra: str = "") -> str:
    lines = "\n".join("    " + b for b in body.strip().splitlines())
    return f'algorithm t extends grpo\n  "top-K"\n  define tk\n{lines}\n  end\n  objective tk\n  kl none\n{extra}'


def test_k_reductions_and_broadcasts_compute_what_they_say() -> None:
    """k_sum / k_mean / k_max / k_min over K, a [B, T] value against [B, T, K] ones (a token's value
    on each candidate), and [] constants, against torch on the same tensors."""
    spec = _spec("""
K = 3
s = k_sum(exp(topk_logp)) + k_mean(old_topk_logp - logp) * 2
m = k_max(topk_logp - old_logp) - k_min(where(old_topk_logp > logp, topk_logp, 0))
l = -A * rho + s + m + is_top1
""")
    fn = rldsl.compile(rldsl.loads(spec, filename="k.rl"), compile=False)
    g = torch.Generator().manual_seed(3)
    B, T = 3, 4
    logp = torch.randn(B, T, generator=g, dtype=torch.float64).requires_grad_()
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    top = torch.randn(B, T, K, generator=g, dtype=torch.float64).requires_grad_()
    old_top = torch.randn(B, T, K, generator=g, dtype=torch.float64)
    top1 = (torch.rand(B, T, generator=g) < 0.5).double()
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    out = fn.loss(logp, old, adv, mask, group_size=1, policy_topk_logprobs=top, old_topk_logprobs=old_top,
                  is_top1=top1)
    rho = torch.exp(torch.clamp(logp - old, -20, 20))
    s = top.exp().sum(-1) + (old_top - logp.unsqueeze(-1)).mean(-1) * 2
    m = (top - old.unsqueeze(-1)).amax(-1) - torch.where(old_top > logp.unsqueeze(-1), top, 0.0).amin(-1)
    per_token = -adv * rho + s + m + top1
    want = (per_token.mean(-1)).mean()  # grpo's seq_mean_token_mean
    assert abs(float(out.loss) - float(want)) < 1e-9
    got = torch.autograd.grad(out.loss, (logp, top))
    ref = torch.autograd.grad(want, (logp, top))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


@pytest.mark.parametrize("body,message,at", [
    ("K = 3\nl = -A * rho + topk_logp", "'l' must be a value per token [B, T], got [B, T, K]", "-A * rho"),
    ("K = 3\nl = -A * rho + seq_sum(topk_logp)", "seq_sum reduces [B] or [B, T] values, got [B, T, K]", "topk_logp"),
    ("K = 3\nl = -A * rho * k_sum(batch_rank(old_topk_logp))", "batch_rank orders [B] or [B, T] values",
     "old_topk_logp"),
    ("K = 3\nl = -A * rho + k_sum(topk_logp - seq_mean(A))",
     "seq_mean(A) is [B] and meets a [B, T, K] value in topk_logp - seq_mean(A)", "seq_mean(A)"),
    ("K = 3\nl = -A * rho + k_sum(where(seq_mean(A) > 0, topk_logp, 0))", "seq_mean(A) > 0 is [B]",
     "seq_mean(A) > 0"),
    ("K = 3\nl = -A * rho + k_mean(max(topk_logp, reward))", "reward is [B] and meets a [B, T, K] value", "reward"),
    ("l = -A * rho + k_sum(A)", "k_sum reduces the top-K axis of a [B, T, K] value, got [B, T]", "A)"),
    ("l = -A * rho + k_max(topk_logp)", "define tk reads topk_logp [B, T, K]: it needs a parameter 'K'", None),
    ("K = 2.5\nl = -A * rho + k_max(topk_logp)", "'K' (the top-K size of define tk) must be a whole number", "2.5"),
    ("K = 0\nl = -A * rho + k_max(old_topk_logp)", "must be a whole number from 1 to 1024, got 0", "0"),
])
def test_shape_errors_name_the_place(body: str, message: str, at: str | None) -> None:
    """Each misuse of the K axis is an error at file:line:col of its sub-expression (the slot line
    when the formula lacks K)."""
    with pytest.raises(SpecError) as e:
        rldsl.loads(_spec(body), filename="bad.rl")
    text = str(e.value)
    assert message in text, text
    lines = body.splitlines()
    if at is None:  # `objective tk`, after the define's lines and its `end`
        where = f"bad.rl:{4 + len(lines) + 1}:13"
    else:
        i = next(n for n, line in enumerate(lines) if at in line)
        where = f"bad.rl:{4 + i}:{5 + lines[i].rindex(at) if at != '-A * rho' else 9}"
    assert where in text, text


def test_formulas_of_one_spec_agree_on_k() -> None:
    spec = _spec("K = 3\nl = -A * rho + k_max(topk_logp)", extra="""  selection keepk
  define keepk
    K = 4
    keep = k_max(old_topk_logp) > -5
  end
""")
    with pytest.raises(SpecError) as e:
        rldsl.loads(spec, filename="two.rl")
    assert "sets K = 4.0 but objective 'tk' 3.0" in str(e.value)
    fn = rldsl.compile(rldsl.loads(spec.replace("K = 4", "K = 3"), filename="two.rl"), compile=False)
    assert fn.data.policy_topk == 3


def test_a_spec_without_top_k_plans_none_and_takes_no_top_k_argument() -> None:
    fn = rldsl.compile(rldsl.load("grpo"), compile=False)
    assert fn.data.policy_topk is None
    assert "topk_logp" not in fn.loss_source and "is_top1" not in fn.loss_source
    simko = rldsl.compile(rldsl.load(SIMKO), compile=False)
    assert simko.data.policy_topk == K
    assert {"policy_topk_logprobs", "old_topk_logprobs", "is_top1"} <= set(simko.algorithm.needs("loss"))


def test_explain_shows_the_top_k_inputs_and_their_code() -> None:
    from typer.testing import CliRunner

    from rldsl.cli import app

    res = CliRunner().invoke(app, ["explain", str(SIMKO)])
    assert res.exit_code == 0, res.output
    assert "k_sum(sg(ratio) / (sg(rk) + 1e-8) * rk)" in res.output
    code = CliRunner().invoke(app, ["explain", "--code", str(SIMKO)])
    assert code.exit_code == 0, code.output
    assert "fx.k_sum(" in code.output and "pol_topk_logp" in code.output and "[B, T, K]" in code.output
