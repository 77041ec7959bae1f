"""One weight sync per path and model size, trainer process -> rollout process, on this machine:
bytes, seconds, the peak host memory each side added, and the bandwidth it implies, extrapolated
to 7B and 32B (derived, not measured).

Paths (distributed.weight_sync):
  object_store  the trainer's full state dict put in Ray's object store (what ``full_weights``
                answers), read by the rollout actor and copied into its model in place
  collective    rldsl's bucketed broadcast (runtime/workers/sync/buckets.py: ``sync_plan``,
                ``send_buckets``, ``receive_buckets``) over a gloo group made for the sync, each
                bucket copied into the rollout actor's model as it arrives
  adapter       model.lora.sync = "adapter" over the object store: rank-``--lora-rank`` adapters on
                every linear layer (``models/lora.py`` ``adapter_of``), read by the rollout actor
                and copied into its own LoRA layers (``load_adapter``, what the hf engine does)
  collective_adapter  the same adapters over the bucketed broadcast (``sync_plan(adapters=True)``)

Both sides are Ray actors (1 torch thread each) holding a model of the size's real shapes (a
Qwen2.5 config, float32 as the trainer's master weights and the CPU engine, no init: the bytes
are what is timed); the group is formed before the timing (once per run in rldsl). The best of
``--repeats``. NCCL (GPU) is not measured here.

    .venv/bin/python bench/sync.py                          # tiny, 0.1B, 0.5B (~3 min, ~8 GB free RAM)
    .venv/bin/python bench/sync.py --sizes tiny --repeats 1  # a smoke run
    .venv/bin/python bench/sync.py --sizes 0.5B --paths adapter,collective_adapter --lora-rank 16
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import socket
import sys
import tempfile
import time

import torch

SIZES = {  # Qwen2.5 shapes (hidden, intermediate, layers, heads, kv heads, vocab); tiny: a toy
    "tiny": (64, 128, 2, 4, 2, 1000),
    "0.1B": (512, 2048, 12, 8, 2, 32000),
    "0.5B": (896, 4864, 24, 14, 2, 151936),  # Qwen2.5-0.5B's released config
}
PARAMS = {"7B": 7.6e9, "32B": 32.8e9}  # Qwen2.5-7B / -32B parameter counts (4 bytes each in float32)
#: (layers, hidden, kv width, intermediate) of Qwen2.5-7B / -32B: adapters on every linear layer hold
#: layers * r * (9 h + 2 h_kv + 3 i) parameters (docs/scaling.md, section 6)
SHAPES = {"7B": (28, 3584, 512, 18944), "32B": (64, 5120, 1024, 27648)}


def adapter_bytes(model: str, rank: int) -> int:
    L, h, kv, i = SHAPES[model]
    return 4 * L * rank * (9 * h + 2 * kv + 3 * i)


def build(size: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config
    h, i, n, heads, kv, v = SIZES[size]
    cfg = Qwen2Config(hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=v, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    model = model.to_empty(device="cpu")
    for p in model.parameters():  # deterministic bytes (the receiver checks them)
        p.data.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p) % 7)
    return model


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Side:
    """A trainer side or a rollout side: a model of ``size`` (one torch thread)."""

    def __init__(self, size: str, lora_rank: int = 0):
        torch.set_num_threads(1)
        self.model = build(size)
        self.group = None
        if lora_rank:  # adapters on every linear layer, B nonzero (the bytes are what is timed)
            from rldsl.runtime.models.lora import apply_lora
            self.model, _ = apply_lora(self.model, rank=lora_rank, alpha=2.0 * lora_rank, dropout=0.0,
                                       target_modules=["all-linear"])

    # model.lora.sync = "adapter"
    def adapter(self) -> tuple[None, object]:
        from rldsl.runtime.models.lora import adapter_of
        return None, adapter_of(self.model)

    def load_adapter(self, adapter) -> int:
        from rldsl.runtime.models.lora import load_adapter
        load_adapter(self.model, adapter)
        return adapter.nbytes

    def baseline(self) -> float:
        return rss_mb()

    def peak(self) -> float:
        return peak_mb()

    # object store
    def state(self) -> tuple[None, dict[str, torch.Tensor]]:
        return None, {k: v.detach() for k, v in self.model.state_dict().items()}

    def load(self, state: dict[str, torch.Tensor]) -> int:
        targets = self.model.state_dict()
        for k, v in state.items():
            targets[k].copy_(v)
        return sum(v.numel() * v.element_size() for v in state.values())

    # collective
    def listen(self) -> tuple[str, int]:
        self.listener = socket.create_server(("127.0.0.1", 0))
        return "127.0.0.1", self.listener.getsockname()[1]

    def join(self, host: str, port: int, rank: int, plan: list | None, mb: float, adapters: bool = False) -> list:
        from rldsl.runtime.workers.sync.buckets import SyncGroup, as_plain, from_plain, sync_plan
        if rank == 0:
            self.plan = sync_plan(self.model, int(mb * 2**20), adapters=adapters)
        else:
            self.plan = from_plain(plan)
        fd = self.listener.fileno() if rank == 0 else None
        self.group = SyncGroup(host, port, rank, 2, 600, torch.device("cpu"), 1,
                               "trainer rank 0" if rank == 0 else "rollout worker 0", listen_fd=fd)
        return as_plain(self.plan)

    def plan_of(self, mb: float, adapters: bool = False) -> list:
        from rldsl.runtime.workers.sync.buckets import as_plain, sync_plan
        self.plan = sync_plan(self.model, int(mb * 2**20), adapters=adapters)
        return as_plain(self.plan)

    def send(self) -> int:
        from rldsl.runtime.workers.sync.buckets import send_buckets
        return send_buckets(self.model, self.plan, self.group, torch.device("cpu"))[0]

    def receive_adapter(self, rank: int) -> int:
        from rldsl.runtime.models.lora import load_adapter
        from rldsl.runtime.workers.sync.buckets import as_adapter, receive_buckets
        adapter = as_adapter(receive_buckets(self.group, self.plan), rank, 2.0 * rank)
        load_adapter(self.model, adapter)
        return adapter.nbytes

    def receive(self) -> int:
        from rldsl.runtime.workers.sync.buckets import receive_buckets
        targets = self.model.state_dict()
        n = 0
        for name, t in receive_buckets(self.group, self.plan):
            targets[name].copy_(t)
            n += t.numel() * t.element_size()
        return n


def one(ray, size: str, path: str, mb: float, repeats: int, lora_rank: int = 16) -> dict:
    Actor = ray.remote(num_cpus=1)(Side)
    adapters = path in ("adapter", "collective_adapter")
    a, b = Actor.remote(size, lora_rank if adapters else 0), Actor.remote(size)  # the receiver adds its LoRA layers
    base = ray.get([a.baseline.remote(), b.baseline.remote()])
    if path in ("collective", "collective_adapter"):
        host, port = ray.get(a.listen.remote())
        plan = ray.get(a.plan_of.remote(mb, adapters))
        ray.get([a.join.remote(host, port, 0, None, mb, adapters), b.join.remote(host, port, 1, plan, mb)])
        buckets = len(plan)
    best, nbytes = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        if path == "object_store":
            ref = a.state.options(num_returns=2).remote()[1]
            nbytes = ray.get(b.load.remote(ref))
            del ref
        elif path == "adapter":
            ref = a.adapter.options(num_returns=2).remote()[1]
            nbytes = ray.get(b.load_adapter.remote(ref))
            del ref
        elif path == "collective_adapter":
            nbytes = ray.get([a.send.remote(), b.receive_adapter.remote(lora_rank)])[1]
        else:
            nbytes = ray.get([a.send.remote(), b.receive.remote()])[1]
        best = min(best, time.perf_counter() - t0)
    peaks = ray.get([a.peak.remote(), b.peak.remote()])
    for x in (a, b):
        ray.kill(x)
    out = {"size": size, "path": path, "bytes": nbytes, "seconds": round(best, 4),
           "GB_per_s": round(nbytes / best / 1e9, 3),
           "trainer_added_MB": round(peaks[0] - base[0], 1), "rollout_added_MB": round(peaks[1] - base[1], 1)}
    if path in ("collective", "collective_adapter"):
        out.update(bucket_mb=mb, buckets=buckets)
    if adapters:
        out.update(lora_rank=lora_rank)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="tiny,0.1B,0.5B")
    ap.add_argument("--paths", default="object_store,collective")
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=16, help="the adapter paths' LoRA rank")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    import ray
    tmp = tempfile.mkdtemp(prefix="rldsl-ray-", dir="/tmp")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", _temp_dir=tmp, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
    rows = []
    try:
        for size in args.sizes.split(","):
            for path in args.paths.split(","):
                row = one(ray, size, path, args.bucket_mb, args.repeats, args.lora_rank)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nextrapolated (derived: float32 bytes / the largest size's measured GB/s; not measured):")
    largest = rows[-1]["size"]
    for r in rows:
        if r["size"] == largest:
            if "lora_rank" in r:  # the adapters of that rank on the larger models
                est = ", ".join(f"{k} {adapter_bytes(k, r['lora_rank']) * r['seconds'] / r['bytes']:.2f} s" for k in SHAPES)
            else:
                est = ", ".join(f"{k} {4 * p / (r['GB_per_s'] * 1e9):.0f} s" for k, p in PARAMS.items())
            print(f"  {r['path']}: {est}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
