"""Formula specs end to end: the same losses, gradients and advantages as the registry spec
they re-express, compiled == eager, the examples, denominators and the loss's requirements."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rldsl
from rldsl.formula import hooks

ROOT = Path(__file__).resolve().parents[2]
GRPO_FORMULAS = str(ROOT / "tests" / "specs" / "formula" / "grpo_formulas.rl")
LOSS_SLOTS = str(ROOT / "tests" / "specs" / "formula" / "loss_slots.rl")
ADVANTAGE_SLOTS = str(ROOT / "tests" / "specs" / "formula" / "advantage_slots.rl")
EXAMPLES = sorted(str(p) for p in (ROOT / "algorithms" / "examples").glob("*.rl"))
G = 4

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
needs_compile = pytest.mark.compile  # compiled where RLDSL_COMPILE allows it, else skipped (tests/conftest.py)


def batch(B: int, T: int, seed: int, dtype=torch.float64, empty: tuple[int, ...] = ()) -> dict:
    g = torch.Generator().manual_seed(seed)
    logp = torch.log(0.05 + 0.9 * torch.rand(B, T, generator=g, dtype=dtype))
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    for i in empty:
        lengths[i] = 0
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).to(dtype)
    rewards = (torch.rand(B, generator=g) > 0.5).to(dtype)
    rewards[:G] = 1.0  # a constant group
    return dict(logp=logp, old=logp + 0.3 * torch.randn(B, T, generator=g, dtype=dtype),
                ref=logp + 0.3 * torch.randn(B, T, generator=g, dtype=dtype), mask=mask,
                ent=2 * torch.rand(B, T, generator=g, dtype=dtype), rewards=rewards)


def run(fn: rldsl.CompiledAlgorithm, b: dict) -> tuple[rldsl.LossOutput, torch.Tensor, torch.Tensor]:
    adv = fn.advantages(b["rewards"], G, b["mask"]).to(b["logp"].dtype)
    lp = b["logp"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], adv, b["mask"], ref_logprobs=b["ref"], entropy=b["ent"], group_size=G)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out, grad, adv


@pytest.mark.parametrize("seed,empty", [(0, ()), (1, (2,)), (2, tuple(range(8)))])
def test_grpo_as_formulas_equals_grpo(seed: int, empty: tuple) -> None:
    ours = rldsl.compile(rldsl.load(GRPO_FORMULAS), compile=False)
    theirs = rldsl.compile(rldsl.load("grpo"), compile=False)
    b = batch(8, 12, seed, empty=empty)
    (o1, g1, a1), (o2, g2, a2) = run(ours, b), run(theirs, b)
    torch.testing.assert_close(a1, a2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(o1.loss, o2.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-7)
    assert o1.metrics.keys() == o2.metrics.keys()
    for k in o1.metrics:
        assert o1.metrics[k] == pytest.approx(o2.metrics[k], rel=1e-6, abs=1e-7), k
    m = b["mask"]
    assert float(ours.denominator(m, G)) == float(theirs.denominator(m, G))


@pytest.mark.slow  # torch.compile of the spec: tens of seconds on a busy 2-core machine
@needs_compile
@pytest.mark.parametrize("spec", [GRPO_FORMULAS, LOSS_SLOTS], ids=lambda s: Path(s).stem)
def test_compiled_equals_eager(spec: str, compiled_algorithm, eager_algorithm) -> None:
    comp, eager = compiled_algorithm(spec), eager_algorithm(spec)
    assert comp.compiled and not eager.compiled
    for B, T, seed, empty in [(8, 16, 0, ()), (12, 24, 1, (3,)), (8, 16, 3, tuple(range(8)))]:
        b = batch(B, T, seed, dtype=torch.float32, empty=empty)
        (oc, gc, _), (oe, ge, _) = run(comp, b), run(eager, b)
        torch.testing.assert_close(oc.loss, oe.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)
        assert torch.isfinite(gc).all()


@pytest.mark.parametrize("spec", EXAMPLES + [LOSS_SLOTS, ADVANTAGE_SLOTS], ids=lambda s: Path(s).stem)
def test_formula_specs_train_a_step(spec: str) -> None:
    """Every example runs estimate + loss + backward and gives finite, non-zero gradients."""
    fn = rldsl.compile(rldsl.load(spec), compile=False)
    b = batch(8, 10, 5, dtype=torch.float32, empty=(6,))
    est = fn.estimate(b["rewards"], G, b["mask"], truncated=torch.zeros(8, dtype=torch.bool),
                      old_logprobs=b["old"], ref_logprobs=b["ref"],
                      ref_reward=b["rewards"].view(-1, G).mean(-1).repeat_interleave(G) - 0.1,  # contrastive_rewards
                      # the policy's probability of the reference answer, after the reasoning and alone: rlpr
                      answer_prob=torch.linspace(0.1, 0.9, 8), bare_answer_prob=torch.full((8,), 0.3),
                      self_certainty=2.0 - b["old"],  # the old policy's self-certainty: read by intuitor
                      # per-prompt statistics over the steps a prompt was seen: dcpo_sas
                      prompt_mean=torch.full((8,), 0.4), prompt_var=torch.full((8,), 0.2),
                      prompt_count=torch.full((8,), 8.0), prompt_steps=torch.full((8,), 2.0),
                      prompt_step_var=torch.full((8,), 0.25),
                      # a tree's per-node values and leaf counts (sampling tree): treerl
                      node_value=b["rewards"].unsqueeze(-1).expand(8, 10).clone(),
                      parent_value=torch.full((8, 10), 0.5), root_value=torch.full((8,), 0.5),
                      node_leaves=torch.ones(8, 10), parent_leaves=torch.full((8, 10), 2.0))
    assert torch.isfinite(est.advantages).all()
    lp = b["logp"].clone().requires_grad_(True)
    out = fn.loss(lp, b["old"], est.advantages, est.mask, ref_logprobs=b["ref"], entropy=b["ent"],
                  group_size=G, rollout_logprobs=b["old"] - 0.1,  # the engine's: read by vespo_is
                  teacher_logprobs=b["old"] - 0.3,  # a teacher's: read by opd_formula
                  old_entropy=b["ent"] * 1.1,  # the old policy's: read by erc (ratios inside its band)
                  sequence_rewards=b["rewards"],  # the sequences' rewards: read by gppo (its NLL on correct ones)
                  # the policy's top-K (K = 3), current and old, and is-top-1: read by simko
                  policy_topk_logprobs=b["old"].unsqueeze(-1) - torch.arange(3.0) - 0.05,
                  old_topk_logprobs=b["old"].unsqueeze(-1) - torch.arange(3.0),
                  is_top1=(b["old"] > b["old"].median()).float())
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all() and lp.grad.abs().sum() > 0
    assert (lp.grad[est.mask == 0] == 0).all(), "padding gets no gradient"


def test_examples_use_formulas_for_pieces_the_registry_lacks() -> None:
    assert len(EXAMPLES) >= 3
    for spec in EXAMPLES:
        algo = rldsl.load(spec)
        formulas = [v for vs in algo.slots.values() for v in vs if v.formula is not None]
        assert formulas, spec
        assert "arXiv" in algo.source, f"{spec} cites its paper"


def test_topr_tapers_only_negative_sequences() -> None:
    fn = rldsl.compile(rldsl.load(str(ROOT / "algorithms" / "examples" / "topr.rl")), compile=False)
    mask = torch.ones(2, 3)
    logp = torch.log(torch.full((2, 3), 0.5)).requires_grad_(True)
    old = torch.log(torch.full((2, 3), 0.25))  # pi / mu = 2 per token: 8 for the trajectory
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    fn.loss(logp, old, adv, mask).loss.backward()
    # d/dlogp of -w A logp, mean over 2 sequences: positives w = 1, negatives min(8, 1) = 1
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5] * 3, [0.5] * 3]))
    logp.grad = None
    old = torch.log(torch.full((2, 3), 0.9))  # pi / mu = (5/9)^3 for the trajectory
    fn.loss(logp, old, adv, mask).loss.backward()
    torch.testing.assert_close(logp.grad[1], torch.full((3,), 0.5 * (5 / 9) ** 3))
    torch.testing.assert_close(logp.grad[0], torch.full((3,), -0.5))


def test_kimi_length_penalty_rewards_short_correct_answers() -> None:
    fn = rldsl.compile(rldsl.load(str(ROOT / "algorithms" / "examples" / "kimi_length_penalty.rl")),
                       compile=False)
    mask = (torch.arange(8).expand(4, 8) < torch.tensor([[2], [8], [2], [8]])).float()
    est = fn.estimate(torch.tensor([1.0, 1.0, 0.0, 0.0]), 4, mask)
    # lambda = 0.5 (short) / -0.5 (long); correct: +lambda, wrong: min(0, lambda); weight 0.5
    torch.testing.assert_close(est.rewards, torch.tensor([1.25, 0.75, 0.0, -0.25]))


def test_a_formula_denominator_is_exact_across_micro_batches() -> None:
    fn = rldsl.compile(rldsl.load(LOSS_SLOTS), compile=False)
    b = batch(8, 10, 7, dtype=torch.float64, empty=(1,))
    adv = fn.advantages(b["rewards"], G, b["mask"]).double()
    lp = b["logp"].clone().requires_grad_(True)
    whole = fn.loss(lp, b["old"], adv, b["mask"], ref_logprobs=b["ref"], entropy=b["ent"], group_size=G).loss
    total = fn.denominator(b["mask"][:4], G) + fn.denominator(b["mask"][4:], G)
    torch.testing.assert_close(total, fn.denominator(b["mask"], G))
    parts = sum(fn.loss(lp[s], b["old"][s], adv[s], b["mask"][s], ref_logprobs=b["ref"][s],
                        entropy=b["ent"][s], group_size=G, denominator=total).loss
                for s in (slice(0, 4), slice(4, 8)))
    torch.testing.assert_close(parts, whole)


def test_a_loss_formula_that_reads_groups_needs_group_size() -> None:
    fn = rldsl.compile(rldsl.load(LOSS_SLOTS), compile=False)
    b = batch(8, 6, 0)
    with pytest.raises(ValueError, match=r"loss\(\) needs .*group_size= for "):
        fn.loss(b["logp"], b["old"], b["old"], b["mask"], ref_logprobs=b["ref"], entropy=b["ent"])
    with pytest.raises(ValueError, match=r"denominator\(\) needs .*group_size= for "):
        fn.denominator(b["mask"])


def test_facts_follow_what_the_formulas_read() -> None:
    topr = rldsl.load(str(ROOT / "algorithms" / "examples" / "topr.rl"))
    assert topr["objective"].formula.reads == {"A", "logp", "old_logp"}
    source = rldsl.compile(topr, compile=False).loss_source
    assert "rho = w = None" in source  # the objective reads neither: no ratio is computed
    kl = rldsl.load(LOSS_SLOTS)
    assert kl.kl_in == "loss" and kl.uses_reference and kl.uses_entropy
    assert "group_size" in kl.needs("loss")
    assert "group_size" not in rldsl.load(GRPO_FORMULAS).needs("loss")


def test_parameters_on_the_slot_line_override_the_defaults() -> None:
    text = ("algorithm o\n  define gate\n    high = 0.2\n    w = min(rho, 1 + high)\n  end\n"
            "  trust_region  gate(high=0.5)\n")
    algo = rldsl.loads(text)
    assert algo["trust_region"].params == {"high": 0.5}
    assert algo["trust_region"].formula.defaults == {"high": 0.2}
    assert "torch.clamp(rho, max=1.5)" in rldsl.compile(algo, compile=False).loss_source
    assert str(algo["trust_region"]) == "gate(high=0.5)"
