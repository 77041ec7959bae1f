"""Seconds per step of a Tinker recipe's loop on ``rldsl serve-tinker`` against ``rldsl run``'s own
step, side by side in one process, on the same model (the embedded toy, warm start), the same
batch shape (P prompts x G samples, at most T new tokens) and LoRA of the same rank.

    .venv/bin/python bench/tinker_step.py                       # 16 x 8, T 16, 3 blocks x 5 steps

The service step is what a recipe does per batch through the unchanged ``tinker`` client:
``save_weights_and_get_sampling_client``, P ``sample`` calls of G samples (concurrent: batched by
the server), the reward and group-centred advantages on the client, one ``forward_backward``
(``importance_sampling``) and one ``optim_step``. The ``rldsl run`` step is
``run.step.train_step`` (rollout with the HF engine, reward, old logprobs, the compiled loss, the
update, the weight sync) with a spec of the same loss (written to a temporary folder: -rho A summed).
Blocks alternate (run, service, run, ...) so that machine noise hits both; the table gives the
medians and the ratio service / run, and where the service's extra time goes (the client's
wall time minus the server's own compute of its jobs: protobuf, futures, HTTP).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
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
        f"train.lr={args.lr}"])
    (tmp / "run").mkdir()
    return build_run(str(spec), cfg, tmp / "run")


class ServiceLoop:
    """The recipe's loop through the tinker client on a server in this process."""

    def __init__(self, args, tmp: Path) -> None:
        import tinker
        from rldsl.runtime.rewards.server import BackgroundServer
        from rldsl.runtime.tinker.server import make_app
        from rldsl.runtime.tinker.service import Service
        from rldsl.runtime.toy import warm_start
        self.args, self.types = args, tinker.types
        folder = Path(warm_start())
        # the client resolves the model name to a folder of that relative path (docs/tinker.md)
        (tmp / "rldsl").mkdir()
        (tmp / "rldsl" / "toy").symlink_to(folder)
        os.chdir(tmp)
        os.environ["HF_HUB_OFFLINE"] = "1"
        self.service = Service({"rldsl/toy": folder}, tmp / "states", args.threads)
        self.server = BackgroundServer(make_app(self.service))
        url = self.server.__enter__()
        self.tc = tinker.ServiceClient(base_url=url, api_key="tml-bench").create_lora_training_client(
            base_model="rldsl/toy", rank=args.rank, seed=args.seed).result()
        self.tok = self.tc.get_tokenizer()
        self.rng = random.Random(args.seed)
        self.server_s = 0.0
        self._wrap_worker()

    def _wrap_worker(self) -> None:
        """Time the server's own work (its jobs on the worker thread)."""
        for name in ("_finish", "_sample_batch"):
            fn = getattr(self.service, name)

            def timed(*a, _fn=fn):
                t = time.perf_counter()
                try:
                    return _fn(*a)
                finally:
                    self.server_s += time.perf_counter() - t
            setattr(self.service, name, timed)

    def step(self) -> tuple[float, float]:
        T = self.types
        t0, s0 = time.perf_counter(), self.server_s
        sampler = self.tc.save_weights_and_get_sampling_client()
        pairs = [(self.rng.randint(0, 99), self.rng.randint(0, 99)) for _ in range(self.args.prompts)]
        prompts = [[self.tok.bos_token_id] + self.tok.encode(f"{a}+{b}=", add_special_tokens=False)
                   for a, b in pairs]
        params = T.SamplingParams(max_tokens=self.args.max_new_tokens, temperature=1.0)
        futures = [sampler.sample(T.ModelInput.from_ints(p), num_samples=self.args.samples, sampling_params=params)
                   for p in prompts]
        data = []
        for (a, b), p, fut in zip(pairs, prompts, futures):
            seqs = fut.result().sequences
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
        return time.perf_counter() - t0, self.server_s - s0

    def close(self) -> None:
        self.server.__exit__(None, None, None)
        self.service.close()


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
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
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
    run_s, service_s, server_s = [], [], []
    for _ in range(args.blocks):
        for _ in range(args.steps):
            run_s.append(run_step.train_step(s, i)["step_s"])
            i += 1
        for _ in range(args.steps):
            wall, own = loop.step()
            service_s.append(wall)
            server_s.append(own)
    loop.close()
    r, v, o = statistics.median(run_s), statistics.median(service_s), statistics.median(server_s)
    print(f"\n{args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} new tokens, LoRA rank "
          f"{args.rank}, {args.threads} thread(s); median of {args.blocks} x {args.steps} steps, blocks alternating")
    print("| step | s/step | of which the server's own jobs | the rest (client, protobuf, futures, HTTP) |")
    print("|---|---|---|---|")
    print(f"| rldsl run (train_step) | {r:.4f} | | |")
    print(f"| serve-tinker (recipe loop) | {v:.4f} | {o:.4f} | {v - o:.4f} |")
    print(f"ratio service / run: {v / r:.2f}x")


if __name__ == "__main__":
    main()
