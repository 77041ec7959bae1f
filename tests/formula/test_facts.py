"""A formula answers for registry facts: what it reads decides ``needs``, ``uses_ratio``,
``sequence_level`` and ``per_token_only``, and every reader of facts (checker rules, code
generator, loss()/denominator() input checks, explain) sees them through ``SlotValue.spec``.
Also: the selection slot takes formulas (equal to the registry's off_policy_sequence), the
correction slot refuses them, and every slot is one or the other."""
from __future__ import annotations

import pytest
import torch

import rldsl
from rldsl import explain, registry
from rldsl.errors import SpecError
from rldsl.formula import hooks, lang

G = 4


def spec(body: str, parent: str = "grpo") -> rldsl.Algorithm:
    return rldsl.loads(f"algorithm f extends {parent}\n{body}", filename="f.rl")


def batch(B: int = 8, T: int = 7, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    logp = torch.log(0.05 + 0.9 * torch.rand(B, T, generator=g, dtype=torch.float64))
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).double()
    noise = lambda s: s * torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(logp=logp, old=logp + noise(0.2), roll=logp + noise(0.6), ref=logp + noise(0.3), mask=mask,
                ent=torch.rand(B, T, generator=g, dtype=torch.float64),
                adv=torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * mask)


def test_every_slot_takes_formulas_or_says_why_not() -> None:
    assert set(lang.SLOTS) | set(lang.NOT_FORMULAS) == set(registry.SLOTS)
    assert not set(lang.SLOTS) & set(lang.NOT_FORMULAS)
    assert list(lang.SLOTS) == [s for s in registry.SLOTS if s in lang.SLOTS]  # data-flow order
    for s, fs in lang.SLOTS.items():
        assert fs.stage == registry.SLOTS[s].stage, s


def test_needs_follow_the_inputs_read() -> None:
    algo = spec("  define kl_sq\n    beta = 0.1\n    kl = (logp - ref_logp) ^ 2\n  end\n"
                "  define ent_bonus\n    term = -0.01 * ent * G / G\n  end\n"
                "  kl       kl_sq\n  entropy  ent_bonus\n")
    assert algo["kl"].spec.facts.needs == ("ref_logprobs",)
    assert algo["entropy"].spec.facts.needs == ("entropy", "group_size")
    assert algo.uses_reference and algo.kl_in == "loss" and algo.uses_entropy
    assert algo.needs("loss") == ["ref_logprobs", "entropy", "group_size"]
    fn = rldsl.compile(algo, compile=False)
    b = batch()
    with pytest.raises(ValueError, match=r"loss\(\) needs ref_logprobs= for kl kl_sq"):
        fn.loss(b["logp"], b["old"], b["adv"], b["mask"], entropy=b["ent"], group_size=G)
    with pytest.raises(ValueError, match=r"loss\(\) needs entropy= and group_size= for entropy ent_bonus"):
        fn.loss(b["logp"], b["old"], b["adv"], b["mask"], ref_logprobs=b["ref"], group_size=G)
    out = fn.loss(b["logp"], b["old"], b["adv"], b["mask"], ref_logprobs=b["ref"], entropy=b["ent"],
                  group_size=G)
    assert torch.isfinite(out.loss) and "kl" in out.metrics
    notes = explain.fact_notes(algo["kl"].spec, algo["kl"].params)
    assert notes == ["needs ref_logprobs=", "no ratio"]


def test_uses_ratio_decides_whether_the_loss_computes_rho() -> None:
    reads = spec("  define pg\n    l = -A * w\n  end\n  objective  pg\n")
    assert reads["objective"].spec.facts.uses_ratio and reads.uses_ratio
    assert "rho = torch.exp(log_ratio)" in rldsl.compile(reads, compile=False).loss_source
    plain = spec("  define pg\n    l = -A * logp\n  end\n  objective  pg\n  trust_region none\n")
    assert not plain.uses_ratio
    assert "rho = w = None" in rldsl.compile(plain, compile=False).loss_source
    # the registry's own rule (facts, no names): a trust region next to an objective without a ratio
    with pytest.raises(SpecError, match="objective 'pg' has no ratio to put a trust region on"):
        spec("  define pg\n    l = -A * logp\n  end\n  objective  pg\n")
    # a trust-region formula reads rho but does not make the loss need it on its own
    gate = spec("  define gate\n    w = min(rho, 1.2)\n  end\n  trust_region gate\n")
    assert not gate["trust_region"].spec.facts.uses_ratio and gate.uses_ratio  # grpo's ppo reads w


def test_sequence_level_ratio_meets_per_token_trust_regions() -> None:
    seq = spec("  define geo\n    log_rho = seq_mean(logp - old_logp)\n  end\n  ratio geo\n")
    assert seq["ratio"].spec.flag("sequence_level", seq["ratio"].params)
    tok = spec("  define tok\n    log_rho = logp - old_logp\n  end\n  ratio tok\n")
    assert not tok["ratio"].spec.flag("sequence_level", tok["ratio"].params)
    # a registry per-token trust region under a sequence-level formula ratio
    with pytest.raises(SpecError, match="trust_region 'tv' is per token; it does not apply to a sequence ratio"):
        spec("  define geo\n    log_rho = seq_mean(logp - old_logp)\n  end\n  ratio geo\n  trust_region tv\n")
    # a per-token formula trust region under the registry's sequence ratio
    with pytest.raises(SpecError, match="trust_region 'div' is per token"):
        spec("  define div\n    w = where(abs(logp - old_logp) < 0.1, rho, sg(rho))\n  end\n"
             "  ratio sequence\n  trust_region div\n")
    spec("  define gate\n    w = min(rho, 1.2)\n  end\n  ratio sequence\n  trust_region gate\n")  # fine
    gmpo = rldsl.load("algorithms/examples/gmpo.rl")  # reads logp, not rho: its own ratio
    assert not gmpo["trust_region"].spec.flag("per_token_only", gmpo["trust_region"].params)


def test_a_group_reading_aggregation_makes_the_trainer_keep_groups_whole() -> None:
    algo = rldsl.load("tests/specs/formula/loss_slots.rl")
    # runtime/train/passes.py reads exactly this fact to split micro-batches at group bounds
    assert "group_size" in algo["aggregation"].spec.facts.needs


def test_selection_formula_equals_the_registry_off_policy_sequence() -> None:
    registry_spec = spec("  kl none\n  selection off_policy_sequence(threshold=0.1)\n")
    formula_spec = spec("  kl none\n  define drift_mask\n    threshold = 0.1\n"
                        "    drift = seq_sum(sg(rollout_logp - logp)) / max(L, 1)\n"
                        "    keep = max(where(seq_sum(A) >= 0, 1, 0), where(drift <= threshold, 1, 0)) > 0\n"
                        "  end\n  selection drift_mask(threshold=0.1)\n")
    assert formula_spec["selection"][0].spec.facts.needs == ("rollout_logprobs",)
    b = batch(seed=3)
    results = []
    for algo in (registry_spec, formula_spec):
        fn = rldsl.compile(algo, compile=False)
        lp = b["logp"].clone().requires_grad_(True)
        out = fn.loss(lp, b["old"], b["adv"], b["mask"], rollout_logprobs=b["roll"])
        results.append((out.loss, torch.autograd.grad(out.loss, lp)[0]))
    (la, ga), (lb, gb) = results
    torch.testing.assert_close(la, lb, rtol=0, atol=1e-12)
    torch.testing.assert_close(ga, gb, rtol=0, atol=1e-12)
    kept = (ga != 0).any(-1)
    assert 0 < int(kept.sum()) < int((b["mask"].sum(-1) > 0).sum())  # the selection removed some rows
    with pytest.raises(ValueError, match=r"loss\(\) needs rollout_logprobs= for selection drift_mask"):
        rldsl.compile(formula_spec, compile=False).loss(b["logp"], b["old"], b["adv"], b["mask"])


def test_correction_refuses_a_formula_at_the_slot_line() -> None:
    with pytest.raises(SpecError) as e:
        spec("  define tis\n    w = 1\n  end\n  correction tis\n")
    err = e.value.errors[0] if hasattr(e.value, "errors") else e.value
    text = str(err)
    assert "slot 'correction' cannot take a formula: its rejections also run in estimate()" in text
    assert "f.rl:5:14" in text and "formulas fill: shaping, baseline" in text and "selection" in text


def test_the_derived_entry_is_one_per_formula() -> None:
    algo = spec("  define gate\n    high = 0.3\n    w = min(rho, 1 + high)\n  end\n  trust_region gate(high=0.25)\n")
    v = algo["trust_region"]
    assert v.spec is v.spec and v.spec is hooks.component(v)
    assert v.spec.params["high"].default == 0.3 and v.params == {"high": 0.25}
    assert v.spec.formula_with(v.params) == "w = min(rho, 1 + 0.25)"
    assert v.spec.source.startswith("formula, define gate (f.rl:")
