"""Loss benchmark: rldsl's compiled loss vs the same loss written by hand in eager PyTorch.

For every library algorithm, one step = forward + backward of the policy loss (and the value
loss for ppo) on CPU at B x T (default 256 x 4096), including the diagnostics each side
reports (clip fraction, ratio mean/min/max, approx KL, KL), converted to Python floats.

    .venv/bin/python bench/loss.py                       # every library algorithm
    .venv/bin/python bench/loss.py --algos grpo,dapo --B 64 --T 1024 --repeats 5 --threads 2
    .venv/bin/python bench/loss.py --algos none --threads 1    # only the formula row

The formula row: a spec whose loss is written entirely as formulas
(``tests/specs/formula/grpo_formulas.rl``: ratio, trust region, objective, KL and
aggregation as ``define`` blocks) against the registry spec it re-expresses (``grpo``), both
compiled, timed interleaved on the same batch after checking they agree (loss, gradient and
metrics, rtol 1e-4). ``--formula SPEC=REGISTRY`` picks another pair, ``--formula none`` skips it.

The eager side is written the way a person writes it without rldsl, in verl's style
(``verl/trainer/ppo/core_algos.py``): ``torch.maximum`` of the two PPO surrogates, verl's
``agg_loss`` modes as masked sums, metrics as masked means. Before timing, both sides are run
once on the same batch and must agree (loss and gradient, rtol 1e-4), so the two columns time
the same mathematics.

Timing: ``--warmup`` untimed steps (the first compiled call pays torch.compile), then the
median time of ``--repeats`` steps; eager and compiled steps are interleaved so that background
load hits both alike. ``--clock wall`` (default) is elapsed time (``time.perf_counter``);
``--clock cpu`` is the process's CPU time (``time.process_time``, summed over threads), which
is much steadier when other jobs share the cores (use it with ``--threads 1`` for a pure
work comparison).

Memory: peak *extra* bytes of one step, from ``torch.profiler.profile(profile_memory=True)``.
With memory profiling on, the CPU allocator reports every allocation and free to the profiler,
which keeps a running "Total Allocated" counter of the bytes allocated since the profiler
started and not yet freed (it starts at 0, so tensors that existed before -- the inputs -- are
not counted). Its maximum over the step (read from the exported trace's ``[memory]`` events) is
the most memory the step held at once on top of its inputs: saved activations, temporaries and
the returned gradients (the gradient of logprobs is itself one input-sized tensor). It is printed
as a multiple of the bytes of the input tensors passed to the loss (logprobs, old logprobs,
advantages, mask, and ref logprobs / values / returns / old values where the algorithm uses them).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import rldsl

Tensor = torch.Tensor

# ---------------------------------------------------------------------------------------
# Hand-written eager losses (verl style)


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str, group_size: int = 1, max_tokens: int = 1) -> Tensor:
    """verl agg_loss, plus ScaleRL's prompt-level mean."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        lengths = mask.sum(-1)
        seq = (loss_mat * mask).sum(-1) / lengths.clamp(min=1)
        return seq.sum() / (lengths > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        seq = (loss_mat * mask).sum(-1)
        return seq.sum() / (mask.sum(-1) > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-sum-norm":  # Dr. GRPO with loss_scale_factor = max_tokens
        return (loss_mat * mask).sum() / (mask.shape[0] * max_tokens)
    if mode == "prompt-mean":
        tok = (loss_mat * mask).sum(-1).view(-1, group_size).sum(-1)
        n = mask.sum(-1).view(-1, group_size).sum(-1)
        return (tok / n.clamp(min=1)).sum() / (n > 0).sum().clamp(min=1)
    raise ValueError(mode)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


# --metrics off: neither side computes diagnostics (rldsl: fn.loss(..., metrics=False))
WITH_METRICS = True


def ratio_metrics(neg_kl: Tensor, ratio: Tensor, clipped: Tensor, mask: Tensor) -> dict[str, Tensor]:
    if not WITH_METRICS:
        return {}
    with torch.no_grad():
        valid = mask > 0
        return {"clip_fraction": masked_mean(clipped.float(), mask),
                "ratio_mean": masked_mean(ratio, mask),
                "ratio_max": torch.where(valid, ratio, -float("inf")).max(),
                "ratio_min": torch.where(valid, ratio, float("inf")).min(),
                "approx_kl": masked_mean(-neg_kl, mask)}


def vanilla_ppo(logp, old, adv, mask, lo=0.2, hi=0.2):
    """compute_policy_loss_vanilla without the dual clip: max(-A r, -A clip(r))."""
    neg_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - lo, 1 + hi)
    return torch.maximum(pg1, pg2), ratio_metrics(neg_kl, ratio, pg2 > pg1, mask)


def truncated_is(logp, old, adv, mask, cap):
    """CISPO: -sg(min(r, cap)) A logp."""
    neg_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    w = torch.clamp(ratio, max=cap).detach()
    return -w * adv * logp, ratio_metrics(neg_kl, ratio, ratio > cap, mask)


def reinforce_pg(logp, old, adv, mask):
    """-A logp: no ratio, so nothing to clip (both sides report clip_fraction 0)."""
    return -adv * logp, ({"clip_fraction": torch.zeros(())} if WITH_METRICS else {})


def dppo_tv(logp, old, adv, mask, delta=0.15):
    neg_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    with torch.no_grad():
        diff = torch.exp(logp) - torch.exp(old)
        valid = torch.where(adv > 0, diff <= delta, diff >= -delta)
    return -adv * ratio * valid, ratio_metrics(neg_kl, ratio, ~valid, mask)


def k3(logp, ref):
    x = ref - logp
    return torch.exp(x) - x - 1


def eager_loss(name: str, d: dict[str, Tensor], G: int) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
    """The library algorithm ``name`` written by hand: (loss, value_loss, metrics)."""
    logp, old, adv, mask = d["logp"], d["old"], d["adv"], d["mask"]
    value_loss = None
    if name == "grpo":
        pg, m = vanilla_ppo(logp, old, adv, mask)
        kl = k3(logp, d["ref"])
        loss = agg_loss(pg + 0.04 * kl, mask, "seq-mean-token-mean")
        pg_loss = agg_loss(pg.detach(), mask, "seq-mean-token-mean")
        if WITH_METRICS:
            m["kl"] = masked_mean(kl.detach(), mask)
    elif name in ("dapo", "lite_ppo", "maxrl"):
        pg, m = vanilla_ppo(logp, old, adv, mask, 0.2, 0.28 if name == "dapo" else 0.2)
        loss = agg_loss(pg, mask, "token-mean")
    elif name == "dr_grpo":
        pg, m = vanilla_ppo(logp, old, adv, mask)
        loss = agg_loss(pg, mask, "seq-mean-token-sum-norm", max_tokens=4096)
    elif name == "cispo":
        pg, m = truncated_is(logp, old, adv, mask, 1.2)
        loss = agg_loss(pg, mask, "token-mean")
    elif name == "scalerl":
        pg, m = truncated_is(logp, old, adv, mask, 5.0)
        loss = agg_loss(pg, mask, "prompt-mean", group_size=G)
    elif name == "dppo":
        pg, m = dppo_tv(logp, old, adv, mask)
        loss = agg_loss(pg, mask, "seq-mean-token-mean")
    elif name in ("reinforce", "rloo"):
        pg, m = reinforce_pg(logp, old, adv, mask)
        loss = agg_loss(pg, mask, "seq-mean-token-sum")
    elif name == "ppo":
        pg, m = vanilla_ppo(logp, old, adv, mask)
        loss = agg_loss(pg, mask, "seq-mean-token-mean")
        v, R, v_old = d["values"], d["returns"], d["old_values"]
        v_clipped = v_old + torch.clamp(v - v_old, -0.5, 0.5)
        vf = 0.5 * torch.maximum((v - R) ** 2, (v_clipped - R) ** 2)
        value_loss = agg_loss(vf, mask, "seq-mean-token-mean")
        if WITH_METRICS:
            m["value_loss"] = value_loss.detach()
    else:
        raise KeyError(f"no hand-written eager loss for {name!r}")
    if name != "grpo":
        pg_loss = loss.detach()
    m = {"pg_loss": pg_loss, **m} if WITH_METRICS else {}
    return loss, value_loss, m


# ---------------------------------------------------------------------------------------
# Batches and steps


def make_inputs(algo: rldsl.Algorithm, B: int, T: int, G: int, seed: int = 0) -> dict[str, Tensor]:
    """Right-padded responses with lengths in [T/4, T]; logprobs of probabilities in (0.05, 1)."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log(0.05 + 0.95 * torch.rand(B, T, generator=g))
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)).float()
    d = {"logp": logp,
         "old": (logp + 0.2 * torch.randn(B, T, generator=g)).clamp(max=0.0),
         "adv": torch.randn(B, 1, generator=g) * mask,
         "mask": mask}
    if algo.kl_in == "loss":
        d["ref"] = (logp + 0.2 * torch.randn(B, T, generator=g)).clamp(max=0.0)
    if algo.uses_critic:
        d["values"] = torch.randn(B, T, generator=g)
        d["returns"] = d["values"] + 0.5 * torch.randn(B, T, generator=g)
        d["old_values"] = d["values"] + 0.3 * torch.randn(B, T, generator=g)
    return d


def leaves(d: dict[str, Tensor]) -> dict[str, Tensor]:
    """Fresh leaf copies: logprobs (and values) carry gradients."""
    out = {k: v.clone() for k, v in d.items()}
    out["logp"].requires_grad_(True)
    if "values" in out:
        out["values"].requires_grad_(True)
    return out


def rldsl_step(fn: rldsl.CompiledAlgorithm, G: int) -> Callable[[dict[str, Tensor]], tuple[float, dict]]:
    def step(d):
        out = fn.loss(d["logp"], d["old"], d["adv"], d["mask"], ref_logprobs=d.get("ref"),
                      values=d.get("values"), returns=d.get("returns"), old_values=d.get("old_values"),
                      group_size=G, metrics=WITH_METRICS)  # metrics come back as Python floats
        total = out.loss if out.value_loss is None else out.loss + out.value_loss
        total.backward()
        return out.loss.item(), out.metrics
    return step


def eager_step(name: str, G: int) -> Callable[[dict[str, Tensor]], tuple[float, dict]]:
    def step(d):
        loss, value_loss, metrics = eager_loss(name, d, G)
        total = loss if value_loss is None else loss + value_loss
        total.backward()
        names = list(metrics)
        vals = torch.stack([metrics[k].float().reshape(()) for k in names]).tolist() if names else []
        return loss.item(), dict(zip(names, vals))
    return step


def clear_grads(d: dict[str, Tensor]) -> None:
    for v in d.values():
        v.grad = None


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_steps(steps, inputs, warmup: int, repeats: int, clock=time.perf_counter) -> list[float]:
    """Median milliseconds of ``repeats`` runs of each step after ``warmup`` runs. The steps are
    interleaved (a, b, a, b, ...) so that both see the same background load."""
    for _ in range(warmup):
        for step, d in zip(steps, inputs):
            clear_grads(d)
            step(d)
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for i, (step, d) in enumerate(zip(steps, inputs)):
            clear_grads(d)
            t0 = clock()
            step(d)
            times[i].append(clock() - t0)
    return [1e3 * statistics.median(t) for t in times]


def peak_extra_bytes(step, d) -> int:
    """Peak of the profiler's 'Total Allocated' counter over one step (see the module docstring)."""
    clear_grads(d)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(d)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    mem = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not mem:
        return 0
    # The counter is process-wide and may not start at 0 (frees while the profiler is off are not
    # reported): measure from its value just before the first event of this step.
    start = mem[0]["Total Allocated"] - mem[0]["Bytes"]
    return max(0, max(m["Total Allocated"] for m in mem) - start)


def check_same(name: str, fn, d: dict[str, Tensor], G: int) -> None:
    a, b = leaves(d), leaves(d)
    la, ma = rldsl_step(fn, G)(a)
    lb, mb = eager_step(name, G)(b)
    assert abs(la - lb) <= 1e-4 * max(1.0, abs(lb)), (name, la, lb)
    torch.testing.assert_close(a["logp"].grad, b["logp"].grad, rtol=1e-4, atol=1e-9)
    if "values" in a:
        torch.testing.assert_close(a["values"].grad, b["values"].grad, rtol=1e-4, atol=1e-9)
    assert ma.keys() == mb.keys(), (name, sorted(ma), sorted(mb))
    for k in ma:
        assert abs(ma[k] - mb[k]) <= 1e-4 * max(1.0, abs(mb[k])), (name, k, ma[k], mb[k])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algos", default=",".join(sorted(rldsl.library())),
                    help="comma-separated library algorithms (default: all)")
    ap.add_argument("--B", type=int, default=256, help="rows (P prompts x G responses)")
    ap.add_argument("--T", type=int, default=4096, help="response tokens")
    ap.add_argument("--G", type=int, default=16, help="group size (prompt-level aggregation)")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: elapsed time (default); cpu: CPU time of the process, summed over its "
                         "threads -- steadier than wall time on a machine shared with other jobs")
    ap.add_argument("--formula", default="tests/specs/formula/grpo_formulas.rl=grpo",
                    help="SPEC=REGISTRY: time a formula spec against the registry spec it re-expresses "
                         "(both compiled); 'none' skips it")
    ap.add_argument("--metrics", choices=("on", "off"), default="on",
                    help="on: both sides compute the diagnostics (clip fraction, ratio stats, KL); "
                         "off: the loss alone (rldsl: fn.loss(..., metrics=False))")
    args = ap.parse_args(argv)
    global WITH_METRICS
    WITH_METRICS = args.metrics == "on"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.B % args.G:
        ap.error(f"--B {args.B} is not a multiple of --G {args.G}")
    names = [n.strip() for n in args.algos.split(",") if n.strip() and n.strip() != "none"]
    print(f"B={args.B} T={args.T} G={args.G} threads={torch.get_num_threads()} "
          f"repeats={args.repeats} warmup={args.warmup} clock={args.clock} metrics={args.metrics} "
          f"torch={torch.__version__}",
          flush=True)
    header = f"{'algorithm':<10} {'eager ms':>9} {'compiled ms':>12} {'speedup':>8} " \
             f"{'eager mem':>10} {'compiled mem':>13} {'inputs MB':>10} {'compile s':>10}"
    print(header)
    print("-" * len(header), flush=True)
    for name in names:
        algo = rldsl.load(name)
        fn = rldsl.compile(algo)
        d = make_inputs(algo, args.B, args.T, args.G)
        in_bytes = sum(v.numel() * v.element_size() for v in d.values())
        t0 = time.perf_counter()
        check_same(name, fn, d, args.G)  # also the first compiled call: torch.compile happens here
        compile_s = time.perf_counter() - t0
        ce, cc = leaves(d), leaves(d)
        eager_ms, comp_ms = time_steps([eager_step(name, args.G), rldsl_step(fn, args.G)], [ce, cc],
                                       args.warmup, args.repeats, CLOCKS[args.clock])
        eager_mem = peak_extra_bytes(eager_step(name, args.G), ce) / in_bytes
        comp_mem = peak_extra_bytes(rldsl_step(fn, args.G), cc) / in_bytes
        print(f"{name:<10} {eager_ms:>9.1f} {comp_ms:>12.1f} {eager_ms / comp_ms:>7.2f}x "
              f"{eager_mem:>9.2f}x {comp_mem:>12.2f}x {in_bytes / 2**20:>10.1f} {compile_s:>10.1f}", flush=True)
    if args.formula != "none":
        spec, _, registry_name = args.formula.partition("=")
        formula_row(spec, registry_name, args)
    return 0


def formula_row(spec: str, registry_name: str, args: argparse.Namespace) -> None:
    """The formula spec against the registry spec it re-expresses: same results, then times."""
    formula_algo, registry_algo = rldsl.load(spec), rldsl.load(registry_name)
    f_fn, r_fn = rldsl.compile(formula_algo), rldsl.compile(registry_algo)
    d = make_inputs(registry_algo, args.B, args.T, args.G)
    t0 = time.perf_counter()
    a, b = leaves(d), leaves(d)
    la, ma = rldsl_step(f_fn, args.G)(a)  # also the first compiled calls
    lb, mb = rldsl_step(r_fn, args.G)(b)
    compile_s = time.perf_counter() - t0
    assert abs(la - lb) <= 1e-4 * max(1.0, abs(lb)), (la, lb)
    torch.testing.assert_close(a["logp"].grad, b["logp"].grad, rtol=1e-4, atol=1e-9)
    assert ma.keys() == mb.keys() and all(abs(ma[k] - mb[k]) <= 1e-4 * max(1.0, abs(mb[k])) for k in ma)
    reg_ms, f_ms = time_steps([rldsl_step(r_fn, args.G), rldsl_step(f_fn, args.G)], [leaves(d), leaves(d)],
                              args.warmup, args.repeats, CLOCKS[args.clock])
    print(f"\nformula spec vs the registry spec it re-expresses (both compiled, same batch)")
    header = f"{'spec':<28} {'registry':<10} {'registry ms':>12} {'formula ms':>11} {'ratio':>7} {'compile s':>10}"
    print(header)
    print("-" * len(header))
    print(f"{Path(spec).stem:<28} {registry_name:<10} {reg_ms:>12.1f} {f_ms:>11.1f} {f_ms / reg_ms:>6.2f}x {compile_s:>10.1f}",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
