"""Seconds per step of a Tinker recipe's loop on ``rldsl serve-tinker`` against ``rldsl run``'s own
step, side by side in one process, on the same model (the embedded toy, warm start), the same
batch shape (P prompts x G samples, at most T new tokens) and LoRA of the same rank.

    .venv/bin/python bench/tinker_step.py   # the toy: 16 x 8, T 16, then 100 x 4, T 5 (3 blocks x 5 steps),
                                            # each followed by its floor (no model work);
                                            # then both shapes on a ~20M-parameter model (3 blocks x 2 steps)

The service step is what a recipe does per batch through the unchanged ``tinker`` client:
``save_weights_and_get_sampling_client``, P ``sample`` calls of G samples (concurrent: batched by
the server), the reward and group-centred advantages on the client, one ``forward_backward``
(``importance_sampling``) and one ``optim_step``. The ``rldsl run`` step is
``run.step.train_step`` (rollout with the HF engine, reward, old logprobs, the compiled loss, the
update, the weight sync) with a spec of the same loss (written to a temporary folder: -rho A summed).
Blocks alternate (run, service, run, ...) so that machine noise hits both; the table gives the
medians and the ratio service / run, and where each step's time goes: for ``rldsl run`` its
own phase timers (rollout, logprobs + update, sync, the rest: reward and records); for the
service the server's jobs by kind (sampling, ``forward_backward``, ``optim_step``, the sampler
save), the time a sampling batch stays open for requests still arriving (``gather``), the
server's reading of requests (JSON and the ``forward_backward`` protobuf), and the rest: the
client's own Python (its protobuf encoding, futures, the recipe's rewards and advantages) and
the HTTP round trips. It also prints how many sampling loops a step's requests took and when
the last of them reached the server (a sampling loop cannot end before it).

Two batch shapes are measured, one after the other, each printed: the given one (default 16
prompts x 8 samples, <= 16 new tokens, LoRA rank 8) and, unless ``--no-recipe``, the default
of the cookbook's ``math_rl`` recipe (``env=arithmetic``: ``groups_per_batch`` 100 x
``group_size`` 4, ``max_tokens`` 5, ``lora_rank`` 32), on the same toy with "a+b=" prompts
(the recipe's renderer adds a few-shot prefix: its prompts are longer). After each toy
shape, unless ``--no-floor``, its floor: the same loop against serve-tinker with the model work
replaced by instant answers of the right shape (:func:`no_compute`), and the CPU a step of the
client's threads and of the server's: what no service can take off a step of this client's loop.
Then, unless ``--no-larger``, both shapes on a larger model built here from a Qwen2 config with
random weights (:func:`larger_model`, ~20M parameters, nothing from a hub), where the model's
compute is not negligible beside the service's fixed costs. ``forward_backward``'s job is split into its
parts: the policy's forward (every target's logprob, the prompt positions' from the same
forward), the loss over the datums, the backward, and the output protobuf.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = """algorithm tinker_is
  "Tinker's importance_sampling: -sum rho A, group-centred rewards."
  baseline group_mean
  normalizer none
  ratio token(clamp=80.0)
  objective ppo
  trust_region none
  kl none
  aggregation token_sum
"""


def run_setup(args, tmp: Path):
    from rldsl.runtime.config import load_config
    from rldsl.runtime.run.build import build_run
    spec = tmp / "tinker_is.rl"
    spec.write_text(SPEC)
    cfg = load_config(None, [
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.samples}", f"threads={args.threads}", f"seed={args.seed}", "data.eval_size=0",
        "train.skip_zero_advantage=false", f"model.lora.rank={args.rank}", "model.lora.alpha=32",
        f"train.lr={args.lr}"] + ([f"model.path={args.model}"] if args.model else []))
    (tmp / "run").mkdir()
    return build_run(str(spec), cfg, tmp / "run")


class ServiceLoop:
    """The recipe's loop through the tinker client on a server in this process."""

    def __init__(self, args, tmp: Path) -> None:
        import tinker
        from rldsl.runtime.rewards.server import BackgroundServer
        from rldsl.runtime.tinker.server import KEEP_ALIVE_S, make_app
        from rldsl.runtime.tinker.service import Service
        from rldsl.runtime.toy import warm_start
        self.args, self.types = args, tinker.types
        folder = Path(args.model) if args.model else Path(warm_start())
        # the client resolves the model name to a folder of that relative path (docs/tinker.md)
        (tmp / "rldsl").mkdir()
        (tmp / "rldsl" / "toy").symlink_to(folder)
        os.chdir(tmp)
        os.environ["HF_HUB_OFFLINE"] = "1"
        self.service = Service({"rldsl/toy": folder}, tmp / "states", args.threads)
        self.server = BackgroundServer(make_app(self.service), timeout_keep_alive=KEEP_ALIVE_S)  # as serve-tinker
        url = self.server.__enter__()
        self.client = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        self.tc = self.client.create_lora_training_client(base_model="rldsl/toy", rank=args.rank,
                                                          seed=args.seed).result()
        self.tok = self.tc.get_tokenizer()
        self.rng = random.Random(args.seed)
        self.phases: dict[str, float] = {}
        self.batches = 0
        self.arrivals: list[float] = []
        self._wrap_server()

    def _add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def _timed(self, fn, phase):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._add(phase(fn, a) if callable(phase) else phase, time.perf_counter() - t)
        return timed

    def _wrap_server(self) -> None:
        """Time the server's own work: its jobs on the worker thread by kind (the service's method
        that queued each), the gather window, and the reading of requests (JSON, protobuf)."""
        from rldsl.runtime.tinker import server, wire
        svc = self.service
        svc._sample_batch = self._timed(svc._sample_batch, "sampling")
        sample_batch = svc._sample_batch

        def counted(batch):  # the sampling batches a step's requests were sampled in
            self.batches += 1
            return sample_batch(batch)
        svc._sample_batch = counted
        svc._gather = self._timed(svc._gather, "gather")
        asample = svc.asample

        def arrived(*a, **k):  # when each sample request reached the server (the span a step's took)
            self.arrivals.append(time.perf_counter())
            return asample(*a, **k)
        svc.asample = arrived
        kinds = {"forward_backward": "forward_backward", "optim_step": "optim_step"}
        submit = svc.submit

        def tagged(model_id, run, *a, **k):
            name = getattr(run, "__qualname__", "").split(".")
            kind = kinds.get(name[1], "other jobs") if len(name) > 1 else "other jobs"
            return submit(model_id, self._timed(run, kind) if k.get("job") is None and len(a) < 2 else run, *a, **k)
        svc.submit = tagged
        server.wire.read_forward_backward = self._timed(wire.read_forward_backward, "reading requests")
        # forward_backward's parts (inside its job): the policy's forward (logprobs of every
        # target), the loss over the datums, the backward, the output protobuf
        from rldsl.runtime.tinker import losses, trainer
        trainer.TrainedModel.logprobs = self._timed(trainer.TrainedModel.logprobs, "fb: forward")
        trainer.TrainedModel.backward = self._timed(trainer.TrainedModel.backward, "fb: backward")
        losses.compute = self._timed(losses.compute, "fb: loss")
        wire.forward_backward_output = self._timed(wire.forward_backward_output, "fb: output protobuf")
        for name in ("json",):  # the JSON bodies the handlers read
            from starlette.requests import Request
            real = getattr(Request, name)

            async def read(request, _real=real):
                t = time.perf_counter()
                try:
                    return await _real(request)
                finally:
                    self._add("reading requests", time.perf_counter() - t)
            setattr(Request, name, read)

    def step(self) -> tuple[float, dict[str, float]]:
        T = self.types
        t0, before = time.perf_counter(), {**self.phases, "sampling batches": float(self.batches)}
        self.arrivals.clear()
        sampler = self.tc.save_weights_and_get_sampling_client()
        pairs = [(self.rng.randint(0, 99), self.rng.randint(0, 99)) for _ in range(self.args.prompts)]
        prompts = [[self.tok.bos_token_id] + self.tok.encode(f"{a}+{b}=", add_special_tokens=False)
                   for a, b in pairs]
        params = T.SamplingParams(max_tokens=self.args.max_new_tokens, temperature=1.0)
        futures = [sampler.sample(T.ModelInput.from_ints(p), num_samples=self.args.samples, sampling_params=params)
                   for p in prompts]
        data = []
        span = 0.0
        for (a, b), p, fut in zip(pairs, prompts, futures):
            seqs = fut.result().sequences
            span = max(self.arrivals) - t0 if len(self.arrivals) == len(prompts) and not span else span
            rewards = [float(self.tok.decode(s.tokens, skip_special_tokens=True).strip() == str(a + b)) for s in seqs]
            mean = sum(rewards) / len(rewards)
            for s, r in zip(seqs, rewards):
                full = p + s.tokens
                n = len(full) - 1
                lp = [0.0] * (len(p) - 1) + list(s.logprobs)
                adv = [0.0] * (len(p) - 1) + [r - mean] * len(s.tokens)
                data.append(T.Datum(model_input=T.ModelInput.from_ints(full[:-1]),
                                    loss_fn_inputs={"target_tokens": full[1:], "logprobs": lp[:n], "advantages": adv[:n]}))
        self.tc.forward_backward(data, "importance_sampling").result()
        self.tc.optim_step(T.AdamParams(learning_rate=self.args.lr, beta1=0.9, beta2=0.99, eps=1e-8)).result()
        now = {**self.phases, "sampling batches": float(self.batches)}
        return time.perf_counter() - t0, {**{k: v - before.get(k, 0.0) for k, v in now.items()}, "arrivals": span}

    def close(self) -> None:
        # the session ends before its server: a client left open heartbeats into a closed port
        self.client.close("success").result(timeout=30)
        self.server.__exit__(None, None, None)
        self.service.close()


RUN_PHASES = [("rollout", ("time/rollout_s",)), ("logprobs + update", ("time/logprobs_s", "time/update_s")),
              ("sync", ("time/sync_s",))]
SERVICE_PHASES = ["sampling", "forward_backward", "optim_step", "other jobs", "gather", "reading requests"]
#: the parts of the service's forward_backward job (within its column)
FB_PARTS = ["fb: forward", "fb: loss", "fb: backward", "fb: output protobuf"]


def larger_model(folder: Path, seed: int = 0) -> Path:
    """A Qwen2-shaped model of ~20M parameters (hidden 512, 6 layers, 8 query / 2 key-value heads,
    MLP 1792) with random weights, built from its config into ``folder`` with the toy's tokenizer
    (one token per character): nothing from a hub. Its layers' compute is ~35x the toy's a token,
    so the service's fixed costs (client, HTTP, protobuf, per-datum Python) weigh less."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from rldsl.runtime.toy import warm_start
    tok = AutoTokenizer.from_pretrained(warm_start())
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=512, intermediate_size=1792, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    print(f"larger model: Qwen2-shaped, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"random weights, in {folder}")
    return folder


def measure(args) -> float:
    """Both loops on one batch shape, blocks alternating; prints the table."""
    import torch
    from rldsl.runtime.run import step as run_step
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="rldsl-bench-tinker-"))
    s = run_setup(args, tmp)
    loop = ServiceLoop(args, tmp)
    i = 0
    for _ in range(args.warmup):
        run_step.train_step(s, i)
        loop.step()
        i += 1
    runs: list[dict[str, float]] = []
    service: list[tuple[float, dict[str, float]]] = []
    for _ in range(args.blocks):
        for _ in range(args.steps):
            runs.append(run_step.train_step(s, i))
            i += 1
        for _ in range(args.steps):
            service.append(loop.step())
    loop.close()
    med = statistics.median
    r = med(m["step_s"] for m in runs)
    v = med(w for w, _ in service)
    run_parts = {name: med(sum(m.get(k, 0.0) for k in keys) for m in runs) for name, keys in RUN_PHASES}
    svc_parts = {name: med(p.get(name, 0.0) for _, p in service) for name in SERVICE_PHASES}
    print(f"\n{'the larger model' if args.model else 'the toy'}: {args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} new tokens, LoRA rank "
          f"{args.rank}, {args.threads} thread(s); median of {args.blocks} x {args.steps} steps, blocks alternating")
    print("| step | s/step | " + " | ".join(n for n, _ in RUN_PHASES) + " | the rest |")
    print("|---|---|" + "---|" * (len(RUN_PHASES) + 1))
    print(f"| rldsl run (train_step) | {r:.4f} | " + " | ".join(f"{t:.4f}" for t in run_parts.values())
          + f" | {r - sum(run_parts.values()):.4f} |")
    print("| step | s/step | " + " | ".join(SERVICE_PHASES) + " | the rest (client, protobuf, futures, HTTP) |")
    print("|---|---|" + "---|" * (len(SERVICE_PHASES) + 1))
    print(f"| serve-tinker (recipe loop) | {v:.4f} | " + " | ".join(f"{t:.4f}" for t in svc_parts.values())
          + f" | {v - sum(svc_parts.values()):.4f} |")
    fb = {name: med(p.get(name, 0.0) for _, p in service) for name in FB_PARTS}
    print("forward_backward's job: " + ", ".join(f"{k[4:]} {t:.4f}" for k, t in fb.items())
          + f", the rest {svc_parts['forward_backward'] - sum(fb.values()):.4f} (reading the datums, checks)")
    print(f"ratio service / run: {v / r:.2f}x; the service's {args.prompts} sample requests a step were sampled in "
          f"{med(p.get('sampling batches', 0.0) for _, p in service):.0f} batch(es) (median); the last of them "
          f"reached the server {med(p.get('arrivals', 0.0) for _, p in service):.4f} s into the step (median)")
    return r


def thread_cpu(server_threads: set[int]) -> tuple[float, float]:
    """CPU seconds so far of this process's threads, split into (the server's: its HTTP thread
    and its worker; the client's: every other thread, the recipe's own and the tinker client's),
    from /proc (a thread's utime + stime). Threads that ended are not counted: read it around
    steps, whose threads live on."""
    tick = os.sysconf("SC_CLK_TCK")
    server = client = 0.0
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / tick
        if int(tid) in server_threads:
            server += cpu
        else:
            client += cpu
    return server, client


@contextlib.contextmanager
def no_compute():
    """serve-tinker with its model work replaced by instant answers of the right shape: each
    sample request gets max_tokens copies of one token, ``forward_backward`` zeros for every
    target (the loss is still computed on them, the output protobuf still built), no backward,
    no optimizer update, no snapshot. What is left of a step is what the client, HTTP, the
    futures and the server's own Python cost: the least a step of this loop takes on any model."""
    import torch
    from rldsl.runtime.tinker import service, trainer
    from rldsl.runtime.tinker.wire import Sequence
    saved = (service.sample, trainer.TrainedModel.logprobs, trainer.TrainedModel.backward,
             trainer.TrainedModel.optim_step, trainer.TrainedModel.snapshot)

    def sample(model, tokenizer, jobs, join, done):
        while jobs:
            for job in jobs:
                job.result = [Sequence([5] * job.max_tokens, [-1.0] * job.max_tokens, False)
                              for _ in range(job.num_samples)]
                done(job)
            jobs = join(jobs[0].group())

    service.sample = sample
    trainer.TrainedModel.logprobs = lambda self, rows, grad: [torch.zeros(len(t), requires_grad=grad) for _, t in rows]
    trainer.TrainedModel.backward = lambda self, loss: None
    trainer.TrainedModel.optim_step = lambda self, adam: {}
    trainer.TrainedModel.snapshot = lambda self, version: None
    try:
        yield
    finally:
        (service.sample, trainer.TrainedModel.logprobs, trainer.TrainedModel.backward,
         trainer.TrainedModel.optim_step, trainer.TrainedModel.snapshot) = saved


def measure_floor(args, run_step_s: float) -> None:
    """The recipe's loop through the client against serve-tinker without model work (no_compute):
    s/step and the CPU seconds a step of the client's threads and of the server's; the service's
    ratio can be no less than (run + floor) / run on a model whose compute is the run's."""
    import torch
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="rldsl-bench-floor-"))
    with no_compute():
        loop = ServiceLoop(args, tmp)
        loop.server.thread.name = "tinker-http"
        server = {t.native_id for t in threading.enumerate() if t.name in ("tinker-http", "tinker-worker")}
        for _ in range(args.warmup):
            loop.step()
        walls, cpus = [], []
        for _ in range(args.blocks * args.steps):
            before = thread_cpu(server)
            walls.append(loop.step()[0])
            after = thread_cpu(server)
            cpus.append((after[0] - before[0], after[1] - before[1]))
        loop.close()
    med = statistics.median
    f = med(walls)
    server_cpu = sum(c[0] for c in cpus) / len(cpus)
    client_cpu = sum(c[1] for c in cpus) / len(cpus)
    print(f"the floor ({args.prompts} x {args.samples}, <= {args.max_new_tokens} tokens): the same loop, no model work: "
          f"{f:.4f} s/step (median of {len(walls)}); CPU a step (mean): the client's threads {client_cpu:.4f} s, "
          f"the server's {server_cpu:.4f} s; with rldsl run's step of {run_step_s:.4f} s the service's ratio "
          f"can be no less than {(run_step_s + f) / run_step_s:.2f}x (the client's CPU alone: "
          f"{(run_step_s + client_cpu) / run_step_s:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="steps per block")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-recipe", action="store_true",
                    help="skip the second shape, math_rl's default (100 groups x 4, max_tokens 5, LoRA rank 32)")
    ap.add_argument("--no-toy", action="store_true", help="skip the toy's two shapes")
    ap.add_argument("--no-larger", action="store_true",
                    help="skip the third: the given shape on a ~20M-parameter Qwen2-shaped model (larger_model)")
    ap.add_argument("--larger-steps", type=int, default=2, help="steps per block on the larger model")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip the floor after each toy shape: the same loop with no model work (no_compute)")
    args = ap.parse_args()
    args.model = None
    sys.path.insert(0, str(ROOT))
    if not args.no_toy:
        shapes = [args] + ([] if args.no_recipe else [argparse.Namespace(
            **{**vars(args), "prompts": 100, "samples": 4, "max_new_tokens": 5, "rank": 32})])
        for shape in shapes:
            run_s = measure(shape)
            if not args.no_floor:
                measure_floor(shape, run_s)
    if not args.no_larger:
        folder = larger_model(Path(tempfile.mkdtemp(prefix="rldsl-bench-qwen2-")) / "model", args.seed)
        for shape in [args] + ([] if args.no_recipe else [argparse.Namespace(
                **{**vars(args), "prompts": 100, "samples": 4, "max_new_tokens": 5, "rank": 32})]):
            measure(argparse.Namespace(**{**vars(shape), "model": str(folder), "steps": args.larger_steps,
                                          "warmup": 1}))


if __name__ == "__main__":
    main()
