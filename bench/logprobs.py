"""Per-token logprobs (+ entropy) of sampled tokens, forward + backward: ours vs the naive way.

    .venv/bin/python bench/logprobs.py                       # B x T x V = 16 x 1024 x 32000, H 256
    .venv/bin/python bench/logprobs.py --T 256 --repeats 2   # smaller / quicker

Both variants start from the same hidden states [B, T, H] (a parameter: the "backbone"
output) and the same random LM head [V, H], and compute, for the B*T sampled tokens,
logprob_t = log_softmax(z_t)[y_t] and the entropy H_t (no gradient through the entropy,
as in the runtime's default), then backpropagate sum_t w_t * logprob_t to the hidden
states and the head:

    naive   z = lm_head(h)  [B, T, V];  logp_all = torch.log_softmax(z.float(), -1)
            logp = logp_all.gather(-1, y);  entropy = -(logp_all.exp() * logp_all).sum(-1)
    ours    rldsl.runtime.train.logprobs.token_logprobs(model, ...): the LM head C = 1024 tokens
            at a time, never holding [B, T, V] (runtime/train/logprobs.py)

``model`` is a minimal module exposing the interface ``token_logprobs`` expects from a
transformers ``*ForCausalLM`` (``base_model_prefix``, a backbone returning
``last_hidden_state``, ``get_output_embeddings()``, ``config``), so that only the head is
measured.

Memory, measured the same way for both: each variant runs in its own subprocess; the
figure is the process's peak RSS (``ru_maxrss``) minus its RSS right before the first
forward (inputs, hidden states and head already allocated): the extra memory the
computation needed at its peak. A second, allocator-independent figure counts bytes of
live tensor storage created by torch ops (a ``TorchDispatchMode`` that adds each new
storage's size and subtracts it when the storage is freed) in a separate, untimed pass.
Time: median of ``--repeats`` forward+backward passes after one warm-up pass, in the
same subprocess, ``--threads`` torch threads (default 1).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _live_bytes_tracker():
    """A TorchDispatchMode counting live bytes of storages created inside it (and the peak)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = 0
            self.peak = 0
            self.seen: set[int] = set()

        def _free(self, key: int, n: int) -> None:
            self.seen.discard(key)
            self.live -= n

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    key = st.data_ptr()
                    if key in self.seen or st.nbytes() == 0:
                        continue  # a view, or an in-place result
                    self.seen.add(key)
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._free, key, st.nbytes())
            return out

    return LiveBytes()


def worker(variant: str, B: int, T: int, V: int, H: int, repeats: int, threads: int, chunk: int) -> dict:
    import torch
    from torch import nn
    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT))
    from rldsl.runtime.train.logprobs import Forward, LogprobOptions, token_logprobs

    class Backbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.Parameter(torch.randn(B, T + 1, H, generator=torch.Generator().manual_seed(0)))

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **_):
            return SimpleNamespace(last_hidden_state=self.h[:, : input_ids.shape[1]])

    class Model(nn.Module):
        base_model_prefix = "model"

        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace()
            self.model = Backbone()
            self.lm_head = nn.Linear(H, V, bias=False)
            with torch.no_grad():
                self.lm_head.weight.normal_(0, H ** -0.5, generator=torch.Generator().manual_seed(1))

        def get_output_embeddings(self):
            return self.lm_head

    model = Model()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (B, T + 1), generator=g)  # [B, T+1]: the last T are the "response"
    mask = torch.ones_like(ids)
    w = torch.randn(B, T, generator=g)

    def naive():
        h = model.model(ids).last_hidden_state[:, :T]  # [B, T, H] states predicting tokens 1..T
        z = model.lm_head(h)  # [B, T, V]
        logp_all = torch.log_softmax(z.float(), dim=-1)  # [B, T, V]
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T]
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)  # [B, T]
        (logp * w).sum().backward()
        return logp.detach(), entropy

    def ours():
        out = token_logprobs(model, Forward(ids, mask, T), LogprobOptions(entropy=True, chunk_size=chunk))
        logp, entropy = out.logprobs, out.entropy
        (logp * w).sum().backward()
        return logp.detach(), entropy

    fn = naive if variant == "naive" else ours
    model.zero_grad(set_to_none=True)
    rss0 = _rss_now()
    times = []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logp, ent = fn()
        dt = time.perf_counter() - t0
        if i:
            times.append(dt)
    peak_rss_extra = _peak_rss() - rss0
    model.zero_grad(set_to_none=True)
    tracker = _live_bytes_tracker()
    with tracker:
        logp, ent = fn()
    checksum = [float(logp.double().sum()), float(ent.double().sum()),
                float(model.lm_head.weight.grad.double().abs().sum()), float(model.model.h.grad.double().abs().sum())]
    return {"variant": variant, "median_s": statistics.median(times), "times": times,
            "peak_rss_extra": peak_rss_extra, "peak_tensor_bytes": tracker.peak, "checksum": checksum}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--H", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=1024, help="token_logprobs chunk_size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", choices=["naive", "ours"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.B, a.T, a.V, a.H, a.repeats, a.threads, a.chunk)))
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    res = {}
    for variant in ("ours", "naive"):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant]
        for k in ("B", "T", "V", "H", "chunk", "repeats", "threads"):
            cmd += [f"--{k}", str(getattr(a, k))]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(ROOT))
        if out.returncode:
            raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
        res[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    o, n = res["ours"], res["naive"]
    same = all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for x, y in zip(o["checksum"], n["checksum"]))
    gib = 2 ** 30
    print(f"B x T x V = {a.B} x {a.T} x {a.V}, H = {a.H}, fp32, forward + backward, {a.threads} thread(s), "
          f"median of {a.repeats} (after 1 warm-up)")
    print("| | seconds | peak extra RSS | peak live tensor bytes |")
    print("|---|---|---|---|")
    for name, r in (("naive log_softmax + gather", n), (f"ours (token_logprobs, chunk {a.chunk})", o)):
        print(f"| {name} | {r['median_s']:.2f} | {r['peak_rss_extra'] / gib:.2f} GiB | "
              f"{r['peak_tensor_bytes'] / gib:.2f} GiB |")
    print(f"| ours / naive | {o['median_s'] / n['median_s']:.2f}x | "
          f"{o['peak_rss_extra'] / n['peak_rss_extra']:.3f}x | {o['peak_tensor_bytes'] / n['peak_tensor_bytes']:.3f}x |")
    print(f"same logprobs, entropies and gradients (sums to 1e-4 relative): {same}")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: v for k, v in vars(a).items() if k != "json"}, "results": res}, indent=1))


if __name__ == "__main__":
    main()
