"""The step's own overhead: rldsl's tiny step phase by phase against each phase's compute floor
measured in the same run, and beside TRL's ``GRPOTrainer`` on the same model and batch.

    .venv/bin/python bench/overhead.py                      # 3 rounds x 12 steps per side, ~2 min
    .venv/bin/python bench/overhead.py --rounds 5 --steps 20
    .venv/bin/python bench/overhead.py --rldsl-only --rounds 1   # the phase table alone
    python bench/overhead.py --device cuda --rldsl-only     # on a GPU: host and CUDA time per phase

The work is bench/vs_trl.py's (the embedded toy Llama, 0.59M parameters, warm-started; 16 prompts
x 8 samples, at most 16 new tokens, temperature 1; bench/dapo_like.rl = TRL ``loss_type="dapo"``,
no KL, clip 0.2 / 0.28, token mean, one update per rollout; AdamW; one torch thread). At this size
the model's arithmetic is a few milliseconds: what is measured is the framework.

How it is measured
    Rounds alternate the sides in ABBA order -- TRL then rldsl in even rounds, rldsl then TRL
    in odd ones, so that a load drifting across a round weighs on both sides alike --, each side
    in a fresh subprocess of ``--steps`` steps, the first ``--warmup`` dropped (rldsl's
    torch.compile of the loss, TRL's lazy init).
    TRL runs bench/vs_trl.py's worker (its step: a callback's on_step_begin to on_step_end).
    rldsl runs its real step in process (``build_run`` then ``run.step.train_step``, as
    bench/step.py does), with timers wrapped around the runtime's own functions:

    rollout       sampling (the engine), ``time/rollout_s``
    rewards       scoring, ``time/reward_s``
    old logprobs  the trainer's no-grad recompute (``Trainer._recompute``; 0 when the update is
                  exactly on-policy and takes its own logprobs, detached)
    estimate      the rest of ``Trainer.estimate``: the spec's shaping and advantages
    update        ``Trainer.update`` and the LR-schedule step, split into
                    layout     micro-batch plans, packed / shared-prompt layout decisions and indices
                    forward    the policy's forward (``_update_forward``) less its layout
                    loss       the compiled loss and its diagnostics (``_loss_backward`` less backward)
                    backward   ``Tensor.backward``
                    optimizer  gradient clip, ``optimizer.step``, ``zero_grad``
                    metrics    ``combine``, ``perf/*`` counts, the rank reduction
                    other      the rest of ``update`` (the zero-advantage check, minibatch rows, ...)
    sync          the new weights into the engine
    record        ``record_step`` (the step's metrics and samples)
    between       the step's wall time less all of the above (the Python between the phases)

    The step time is the wall clock of ``train_step`` (record included). Each timer counts its
    own time, less the timers nested in it.

The compute floor of each phase (same run, same tensors: the batches of the timed steps)
    rollout       a bare sampling loop on the engine's model: one prefill of the B rows, then
                  one cached forward and ``torch.multinomial`` per generated column
    old logprobs  one no-grad forward and the gathered log-softmax (only when rldsl ran one)
    update        a copy of the policy and an optimizer of the same class and settings: the
                  forward and the gathered log-softmax (forward), the token-mean PPO term
                  (loss), backward, clip + step + zero_grad (optimizer)
    sync          ``load_state_dict`` of the policy's tensors into the engine's model
    A forward's floor is the faster of two bare forwards of the rows: padded, and each group's
    prompt once, its responses on the prompt's KV cache (the layout rldsl takes for short answers).
    Rewards, estimate and record have no separate floor (a few list and element-wise ops): their
    ratio column reads "-". The floor is the least this step's phases could take with this model
    in eager PyTorch, not a lower bound for every layout: rldsl's sampler drops finished rows and
    its chunked head skips the full [B, T, V] log-softmax, so a ratio below 1 is possible.

What it prints: per phase, rldsl's median seconds, the floor's and their ratio; the update's
ratio to its floor; per round rldsl's median step over TRL's, their median (the figure) and the
spread of rldsl's own steps inside each run ((p90 - p10) / median, and min-max).

``--device cuda`` (a GPU): the same step on CUDA, each timed step under ``torch.profiler``
(CPU and CUDA activity; its per-op bookkeeping adds some host time). Every phase then prints
its host time (the timers above), its CUDA time (the durations of the GPU kernels launched while
the phase ran -- by whichever thread, so the autograd engine's backward kernels count in
``backward`` --, each kernel counted in the innermost phase whose range holds its launch) and its
host busy time over its CUDA time: host busy = the phase's host time less the time its thread
spent blocked on the GPU (the CUDA runtime's synchronize and memcpy calls in the phase). Event
spans would not do: a host-bound phase keeps the GPU idle between kernels, and a span counts that
idle time. The step is CUDA-bound when its host busy time <= 0.5x its CUDA time. ``--size`` picks the model: ``toy`` (the
embedded one) or ``qwen0.5b`` (a random Qwen2 of Qwen2-0.5B's width and depth, hidden 896,
24 layers, 14 heads, with the toy vocabulary; bf16 autocast on CUDA).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import vs_trl  # noqa: E402  (bench/ on the path: the TRL worker and the shared settings)

PHASES = ("rollout", "rewards", "old logprobs", "estimate", "update", "sync", "record", "between")
UPDATE_PARTS = ("layout", "forward", "loss", "backward", "optimizer", "metrics", "other")


# ----------------------------------------------------------------------------- the clock

class Clock:
    """Named timers that nest: each counts its own time less the timers running inside it
    (``exclusive``), per step. With ``cuda``, each entry is also a ``record_function`` range
    (``PHASE_TAG`` + name) of the profiler's trace, read by :meth:`finish`."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self.stack: list[list] = []  # [name, start, time of children]
        self.host: dict[str, float] = {}

    def reset(self) -> None:
        self.host = {}

    @contextlib.contextmanager
    def __call__(self, name: str, within: str | None = None):
        if any(frame[0] == name for frame in self.stack) or \
                (within is not None and not any(frame[0] == within for frame in self.stack)):
            yield  # re-entered (the outer entry counts it), or outside the phase it is a part of
            return
        span = contextlib.nullcontext()
        if self.cuda:
            import torch
            span = torch.autograd.profiler.record_function(PHASE_TAG + name)
        frame = [name, time.perf_counter(), 0.0]
        self.stack.append(frame)
        try:
            with span:
                yield
        finally:
            self.stack.pop()
            took = time.perf_counter() - frame[1]
            self.host[name] = self.host.get(name, 0.0) + took - frame[2]
            if self.stack:
                self.stack[-1][2] += took

    def wrap(self, owner, attr: str, name: str, within: str | None = None) -> None:
        """Time every call of ``owner.attr`` as ``name`` (an instance's method or a module's
        function); with ``within``, only the calls made inside that phase."""
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*a, **k):
            with self(name, within):
                return fn(*a, **k)
        setattr(owner, attr, timed)

    @staticmethod
    def finish(events) -> tuple[dict[str, float], dict[str, float]]:
        """(CUDA seconds, seconds blocked on the GPU) of each phase of a step, from the
        profiler's events of that step (``prof.events()``)."""
        ops = []
        for e in events:
            if e.name.startswith(PHASE_TAG):
                continue
            kernels = sum(k.duration for k in getattr(e, "kernels", ()))
            wait = e.time_range.elapsed_us() if e.name.startswith(BLOCKING_CALLS) else 0
            if kernels or wait:
                ops.append((e.time_range.start, kernels, wait))
        kernels, waits = attribute(phase_ranges(events), ops)
        return ({k: v / 1e6 for k, v in kernels.items()}, {k: v / 1e6 for k, v in waits.items()})


#: The prefix of the profiler ranges the clock opens (one per phase entry) with ``--device cuda``.
PHASE_TAG = "rldsl-phase:"
#: CUDA runtime calls in which the host waits for the GPU (names as the profiler lists them).
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def phase_ranges(events) -> list[tuple[str, float, float]]:
    """(phase, start, end) of each range the clock opened, from the profiler's events."""
    return [(e.name[len(PHASE_TAG):], e.time_range.start, e.time_range.end) for e in events
            if e.name.startswith(PHASE_TAG)]


def attribute(ranges: list[tuple[str, float, float]], ops: list[tuple[float, float, float]]
              ) -> tuple[dict[str, float], dict[str, float]]:
    """Each op's kernel time and blocked time to the innermost phase range that holds its start.

    ``ranges``: (phase, start, end) of the clock's ranges (they nest); ``ops``: (start, kernel
    time, blocked time) of every profiled CPU event that launched kernels or waited. An op in
    no range counts as ``between``. Returns ({phase: kernel time}, {phase: blocked time})."""
    kernels: dict[str, float] = {}
    waits: dict[str, float] = {}
    for start, k, w in ops:
        holding = [r for r in ranges if r[1] <= start <= r[2]]
        phase = max(holding, key=lambda r: r[1])[0] if holding else "between"
        kernels[phase] = kernels.get(phase, 0.0) + k
        waits[phase] = waits.get(phase, 0.0) + w
    return kernels, waits


# ----------------------------------------------------------------------------- rldsl worker

def run_config(device: str, size: str, model: Path | None) -> list[str]:
    """The ``--set`` overrides of bench/vs_trl.py's rldsl command (same work), for the device."""
    cmd = vs_trl.rldsl_command(1, Path("/unused"), 0, 1)
    sets = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"]
    sets.append(f"device={device}")
    if model is not None:
        sets.append(f"model.path={model}")
    if device == "cuda" and size != "toy":
        sets.append("model.dtype=bfloat16")
    return sets


def qwen_half_b(folder: Path) -> Path:
    """A random Qwen2 with Qwen2-0.5B's width and depth and the toy tokenizer, saved to ``folder``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from rldsl.runtime import toy
    tok = toy.build_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def instrument(s, clock: Clock) -> dict:
    """Wrap the run's phases and the update's parts in ``clock``; returns where the timed steps'
    batches are kept (for the floors)."""
    import torch
    from rldsl.runtime.run import step as run_step
    from rldsl.runtime.train import logprobs as lp_mod, trainer as trainer_mod

    tr = s.trainers.trainer
    kept: dict = {"batches": []}
    clock.wrap(run_step, "rollout_step", "rollout")  # rewards split off by time/reward_s
    clock.wrap(tr, "_recompute", "old logprobs")
    clock.wrap(s.trainers, "estimate", "estimate")
    update = s.trainers.update

    def keep_update(tb, seed):
        kept["batches"].append(tb)
        with clock("update"):
            return update(tb, seed)
    s.trainers.update = keep_update
    for owner, attr in ((lp_mod, "_packed_layout"), (lp_mod, "_shared_prompt_applies"), (tr, "_microbatches"),
                        (tr, "_local_rows")):
        clock.wrap(owner, attr, "layout", within="update")
    clock.wrap(tr, "_update_forward", "forward", within="update")
    clock.wrap(tr, "_loss_backward", "loss", within="update")
    backward = torch.Tensor.backward

    def timed_backward(self, *a, **k):
        with clock("backward", within="update"):
            return backward(self, *a, **k)
    torch.Tensor.backward = timed_backward
    for owner, attr in ((trainer_mod, "_clip"), (tr.optimizer, "step"), (tr.optimizer, "zero_grad"),
                        (tr, "step_schedule")):
        clock.wrap(owner, attr, "optimizer", within="update")
    for owner, attr in ((trainer_mod, "combine"), (tr, "_perf_metrics"), (tr, "_reduce_metrics")):
        clock.wrap(owner, attr, "metrics", within="update")
    clock.wrap(s.rollouts, "load_weights", "sync")
    clock.wrap(run_step, "record_step", "record")
    return kept


@contextlib.contextmanager
def profiled(on: bool):
    """``torch.profiler`` with CPU and CUDA activity around one step (``--device cuda``), else None."""
    if not on:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield prof


def fold_update(times: dict[str, float]) -> dict[str, float]:
    """The clock's phases -> the table's (a copy): the update's own (exclusive) time is its part
    ``other``, and the update the sum of its parts."""
    d = dict(times)
    d["other"] = d.pop("update", 0.0)
    d["update"] = sum(d.get(p, 0.0) for p in UPDATE_PARTS)
    return d


def step_cuda(kernels: dict[str, float], waits: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """The profiler's split of a step (``Clock.finish``) folded as the host times are."""
    return fold_update(kernels), fold_update(waits)


def rldsl_worker(steps: int, out: Path, seed: int, device: str, size: str) -> None:
    import torch
    torch.set_num_threads(1)
    from rldsl.runtime.config import load_config
    from rldsl.runtime.run import step as run_step
    from rldsl.runtime.run.build import build_run
    from rldsl.runtime.toy import warm_start

    warm_start()
    model = qwen_half_b(out / "model") if size == "qwen0.5b" else None
    cfg = load_config(None, run_config(device, size, model) + [f"seed={seed}"])
    (out / "run").mkdir()
    s = build_run(str(vs_trl.SPEC), cfg, out / "run")
    clock = Clock(cuda=device == "cuda")
    kept = instrument(s, clock)
    floors = Floors(s, device)
    rows = []
    for i in range(steps):
        clock.reset()
        with profiled(device == "cuda") as prof:
            t0 = time.perf_counter()
            m = run_step.train_step(s, i)
            if device == "cuda":
                torch.cuda.synchronize()  # the step's last kernels end inside its profile
            wall = time.perf_counter() - t0
        host = fold_update(clock.host)  # the update's own code between its parts is "other"
        host["rewards"] = m.get("time/reward_s", 0.0)
        host["rollout"] = host.get("rollout", 0.0) - host["rewards"]
        host["between"] = wall - sum(host.get(p, 0.0) for p in PHASES[:-1])
        cuda, blocked = ({}, {}) if prof is None else step_cuda(*Clock.finish(prof.events()))
        rows.append({"step_s": wall, "host": host, "cuda": cuda, "blocked": blocked,
                     "floors": floors.measure(kept["batches"].pop()),
                     "response_length": m.get("response_length", float("nan"))})
    (out / "result.json").write_text(json.dumps({"steps": rows}))


# ----------------------------------------------------------------------------- the floors

class Floors:
    """Each phase's floor (module docstring) on one step's batch, measured right after that step
    (so that the step and its floor meet the same load): one pass of each, timed in sequence."""

    def __init__(self, s, device: str):
        import torch
        tr = s.trainers.trainer
        self.s, self.tr, self.device = s, tr, device
        self.policy = copy.deepcopy(tr.policy).train()
        takes = inspect.signature(type(tr.optimizer)).parameters
        self.opt = type(tr.optimizer)(self.policy.parameters(),
                                      **{k: v for k, v in tr.optimizer.defaults.items() if k in takes})
        self.engine = s.rollouts.engine.model
        dtype = tr.autocast_dtype
        self.auto = (lambda: torch.autocast(device_type=device, dtype=dtype)) if dtype is not None \
            else contextlib.nullcontext

    def _now(self) -> float:
        if self.device == "cuda":
            import torch
            torch.cuda.synchronize()
        return time.perf_counter()

    def _logprobs(self, model, ids, attn, pos, T: int, Tr: int, G: int):
        """The gathered log-softmax [B, Tr] of the cheaper of two bare forwards: the padded rows,
        or each group's prompt once then its responses on the prompt's KV cache (the layout rldsl
        takes for these rows); both run, the faster kept, so the floor is the least of the two."""
        import torch
        from rldsl.runtime.models.loading import backbone
        from rldsl.runtime.train.logprobs import _shared_prompt_hidden
        head = model.get_output_embeddings()
        best, out = float("inf"), None
        for shared in (False, True):
            t0 = self._now()
            with self.auto():
                h = _shared_prompt_hidden(model, ids, attn, Tr, G) if shared else None
                if h is None:
                    h = backbone(model)(input_ids=ids[:, :-1], attention_mask=attn[:, :-1], position_ids=pos[:, :-1],
                                        use_cache=False).last_hidden_state[:, T - Tr - 1:]
                z = head(h).float()
            lp = torch.log_softmax(z, -1).gather(-1, ids[:, T - Tr:, None]).squeeze(-1)
            took = self._now() - t0
            if took < best:
                best, out = took, lp
        return out, best

    def measure(self, tb) -> dict[str, float]:
        import torch
        from rldsl.runtime.batch import model_inputs, position_ids_from_mask
        r = tb.rollout
        ids, attn, _ = model_inputs(r)
        pos = position_ids_from_mask(attn)
        B, T = ids.shape
        Tr, G = r.response_ids.shape[1], r.group_size
        mask, adv = tb.mask, tb.advantages
        f: dict[str, float] = {}
        lp, f["forward"] = self._logprobs(self.policy, ids, attn, pos, T, Tr, G)
        t0 = self._now()
        ratio = torch.exp(lp - lp.detach())
        loss = -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv) * mask).sum() / mask.sum()
        t1 = self._now()
        loss.backward()
        t2 = self._now()
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = self._now()
        f.update(loss=t1 - t0, backward=t2 - t1, optimizer=t3 - t2)
        f["update"] = f["forward"] + f["loss"] + f["backward"] + f["optimizer"]
        if tb.old_logprobs is not None:
            with torch.no_grad():
                f["old logprobs"] = self._logprobs(self.tr.policy, ids, attn, pos, T, Tr, G)[1]
        t0 = self._now()
        bare_sampling(self.engine, r, self.auto)
        f["rollout"] = self._now() - t0
        state = {k: v.detach() for k, v in self.tr.policy.state_dict().items()}
        t0 = self._now()
        self.engine.load_state_dict(state, strict=False)
        f["sync"] = self._now() - t0
        return f


def bare_sampling(model, r, auto) -> None:
    """Prefill the B prompt rows once, then one cached forward and a multinomial draw per
    generated column: the sampler's work with nothing around it."""
    import torch
    from rldsl.runtime.batch import position_ids_from_mask
    dev = next(model.parameters()).device  # the engine hands back CPU tensors
    ids, attn = r.prompt_ids.to(dev), r.prompt_mask.to(dev)
    pos = position_ids_from_mask(attn)
    with torch.no_grad(), auto():
        o = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        cache, nxt = o.past_key_values, pos[:, -1:] + 1
        for _ in range(r.response_ids.shape[1]):
            tok = torch.multinomial(torch.softmax(o.logits[:, -1].float(), -1), 1)
            attn = torch.cat([attn, torch.ones_like(tok)], 1)
            o = model(input_ids=tok, attention_mask=attn, position_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = nxt + 1


# ----------------------------------------------------------------------------- controller

def med(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> float:
    """(p90 - p10) / median of a run's step times."""
    xs = sorted(xs)
    return (xs[(9 * len(xs)) // 10 if len(xs) > 9 else -1] - xs[len(xs) // 10]) / statistics.median(xs)


def floor_sum(st: dict) -> float:
    """The compute floor of one step: its phases' floors (rewards, estimate and record have none)."""
    return sum(v for k, v in st["floors"].items() if k in PHASES and v == v)


MODEL_PHASES = ("rollout", "forward", "backward")


def slow_steps(steps: list[dict], above: float = 1.15) -> dict | None:
    """Where a run's slow steps (> ``above`` x its median step) lose their time: the mean excess
    over the run's median of the model's arithmetic (rollout, forward, backward) and of every
    other phase, and how their floors (measured right after each, the same work bare) compare
    with the run's median floors -- a host slowing everything shows in both; the framework's own
    swings only in the second. None when no step is that slow."""
    m = med([st["step_s"] for st in steps])
    slow = [st for st in steps if st["step_s"] > above * m]
    if not slow:
        return None
    rest = [p for p in (*PHASES, *UPDATE_PARTS) if p not in MODEL_PHASES and p != "update"]
    phase_med = {p: med([st["host"].get(p, 0.0) for st in steps]) for p in (*MODEL_PHASES, *rest)}

    def excess(names):
        return statistics.mean(sum(st["host"].get(p, 0.0) - phase_med[p] for p in names) for st in slow)
    floor_med = med([floor_sum(st) for st in steps])
    return {"n": len(slow), "model": excess(MODEL_PHASES), "framework": excess(rest),
            "floor_ratio": statistics.mean(floor_sum(st) for st in slow) / floor_med}


def host_over_cuda(st: dict) -> float:
    """A step's host busy time (its phases' host time less the time blocked on the GPU) over its
    CUDA time (every kernel of the step, between the phases too)."""
    busy = sum(st["host"].get(p, 0.0) - st["blocked"].get(p, 0.0) for p in PHASES)
    return busy / max(sum(st["cuda"].get(p, 0.0) for p in PHASES), 1e-9)


def report(rounds: list[dict], warmup: int, device: str) -> dict:
    """Print the tables; returns the summary."""
    runs = [r["rldsl"] for r in rounds]
    steps = [st for run in runs for st in run["steps"][warmup:]]
    floors = {k: med([st["floors"].get(k, float("nan")) for st in steps]) for k in steps[0]["floors"]}
    host = {p: med([st["host"].get(p, 0.0) for st in steps]) for p in (*PHASES, *UPDATE_PARTS)}
    step_med = med([st["step_s"] for st in steps])
    cuda = device == "cuda"
    lines = ["| phase | rldsl s (host) | share of step | floor s | rldsl / floor |"
             + (" CUDA s | host busy s | host busy / CUDA |" if cuda else ""),
             "|---|---|---|---|---|" + ("---|---|---|" if cuda else "")]

    def row(name, label):
        f = floors.get(name)
        f = f if f == f else None
        cells = [label, f"{host[name]:.4f}", f"{host[name] / step_med:.0%}",
                 f"{f:.4f}" if f else "-", f"{host[name] / f:.2f}x" if f else "-"]
        if cuda:
            c = med([st["cuda"].get(name, 0.0) for st in steps])
            busy = med([st["host"].get(name, 0.0) - st["blocked"].get(name, 0.0) for st in steps])
            cells += [f"{c:.4f}", f"{busy:.4f}", f"{busy / c:.2f}x" if c > 0 else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    for p in PHASES:
        row(p, p)
        if p == "update":
            for q in UPDATE_PARTS:
                row(q, f"  update: {q}")
    print("\nrldsl's step, phase by phase (median over "
          f"{len(steps)} steps of {len(runs)} run(s); the update's parts below it)")
    print("\n".join(lines))
    print(f"step: median {step_med:.4f} s; the update is {host['update'] / floors['update']:.2f}x its compute "
          f"floor ({floors['update']:.4f} s: forward {floors['forward']:.4f}, loss {floors['loss']:.4f}, "
          f"backward {floors['backward']:.4f}, optimizer {floors['optimizer']:.4f})")
    spreads = [spread([st["step_s"] for st in run["steps"][warmup:]]) for run in runs]
    # the work itself varies from step to step (sampled lengths): the step over its own floor
    # (the sum of its phases' floors, measured on that step's batch) is the framework's share alone
    own = [spread([st["step_s"] / floor_sum(st) for st in run["steps"][warmup:]]) for run in runs]
    for k, run in enumerate(runs):
        xs = [st["step_s"] for st in run["steps"][warmup:]]
        print(f"run {k}: rldsl's steps {min(xs):.4f}-{max(xs):.4f} s, median {med(xs):.4f}, "
              f"spread (p90 - p10) / median {spreads[k]:.0%}; of step / its floor {own[k]:.0%}")
        slow = slow_steps(run["steps"][warmup:])
        if slow:
            print(f"  its {slow['n']} step(s) above 1.15x the median: +{slow['model']:.4f} s in the model's "
                  f"arithmetic (rollout, forward, backward), +{slow['framework']:.4f} s in the rest; their "
                  f"floors (taken right after) {slow['floor_ratio']:.2f}x the run's median floors")
    summary = {"rldsl_step_s": step_med, "phases": host, "floors": floors,
               "update_over_floor": host["update"] / floors["update"], "spreads": spreads,
               "spreads_over_floor": own}
    if "trl" in rounds[0]:
        ratios = []
        for k, rd in enumerate(rounds):
            a = med([st["step_s"] for st in rd["rldsl"]["steps"][warmup:]])
            b = med(rd["trl"]["step_s"][warmup:])
            ratios.append(a / b)
            print(f"round {k}: rldsl {a:.4f} s/step, TRL {b:.4f} s/step, rldsl / TRL {a / b:.3f}; "
                  f"spread of TRL's steps {spread(rd['trl']['step_s'][warmup:]):.0%} (the machine's and the "
                  "work's share of rldsl's)")
        print(f"\nrldsl / TRL, median of {len(ratios)} rounds: {med(ratios):.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})")
        summary.update(ratio_rounds=ratios, ratio=med(ratios))
    if cuda:
        hc = [host_over_cuda(st) for st in steps]
        print(f"host busy / CUDA time of the step: {med(hc):.2f}x (CUDA-bound when <= 0.5)")
        summary["host_over_cuda"] = med(hc)
    return summary


def round_sides(k: int, rldsl_only: bool = False) -> tuple[str, ...]:
    """The order of the sides in round ``k``: ABBA (TRL first in even rounds, rldsl in odd ones)."""
    if rldsl_only:
        return ("rldsl",)
    return ("trl", "rldsl") if k % 2 == 0 else ("rldsl", "trl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both sides (ABBA order), each a fresh process per side")
    ap.add_argument("--steps", type=int, default=12, help="steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="steps dropped at the start of every run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--size", choices=["toy", "qwen0.5b"], default="toy",
                    help="the model (qwen0.5b: Qwen2-0.5B's shape, random, for --device cuda)")
    ap.add_argument("--rldsl-only", action="store_true", help="no TRL runs (the phase table alone)")
    ap.add_argument("--json", type=Path, help="also write the raw figures here")
    ap.add_argument("--worker", choices=["rldsl", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "rldsl":
        rldsl_worker(a.steps, a.out, a.seed, a.device, a.size)
        return
    if a.worker == "trl":
        vs_trl.trl_worker(a.steps, a.out, a.seed, 1)
        return
    if a.steps <= a.warmup:
        print("bench/overhead.py: --steps must exceed --warmup", file=sys.stderr)
        raise SystemExit(2)
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("bench/overhead.py: --device cuda needs a GPU (torch.cuda.is_available() is False)",
                  file=sys.stderr)
            raise SystemExit(2)
        if not a.rldsl_only:
            print("bench/overhead.py: --device cuda compares no TRL run (its worker is CPU-only): add "
                  "--rldsl-only", file=sys.stderr)
            raise SystemExit(2)
    if not a.rldsl_only:
        try:
            import trl  # noqa: F401
        except ImportError:
            print('bench/overhead.py: TRL is not installed: .venv/bin/pip install -c constraints/cpu.txt '
                  '-e ".[bench]" (or --rldsl-only)', file=sys.stderr)
            raise SystemExit(2)
    from rldsl.runtime.toy import warm_start
    warm_start(verbose=True)  # the cache, once, outside the timed runs
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    me = [sys.executable, str(Path(__file__).resolve())]
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rldsl-overhead-") as tmp:
        for k in range(a.rounds):
            rd: dict = {}
            for side in round_sides(k, a.rldsl_only):
                out = Path(tmp) / f"{side}-{k}"
                out.mkdir()
                cmd = me + ["--worker", side, "--steps", str(a.steps), "--out", str(out), "--seed", str(a.seed),
                            "--device", a.device, "--size", a.size]
                vs_trl.run_child(cmd, env)
                rd[side] = json.loads((out / "result.json").read_text())
                xs = rd[side]["step_s"] if side == "trl" else [st["step_s"] for st in rd[side]["steps"]]
                print(f"round {k} {side:5s}: median {med(xs[a.warmup:]):.4f} s/step over "
                      f"{len(xs) - a.warmup} steps", flush=True)
            rounds.append(rd)
    summary = report(rounds, a.warmup, a.device)
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "summary": summary,
                                      "rounds": rounds}, indent=1, default=str))


if __name__ == "__main__":
    main()
