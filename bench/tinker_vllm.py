"""``rldsl serve-tinker --engine vllm`` against ``--engine hf``, side by side in one process, through
the unchanged ``tinker`` client: what a sampler switch costs on vLLM (the whole merged state
synced in place), the seconds of one recipe-shaped sampling batch on each engine, and the largest
|sampler logprob - trainer logprob| on each.

    .venv-vllm/bin/python bench/tinker_vllm.py            # the embedded toy's vLLM variant, P x G = 100 x 4, T 5

Per block (blocks alternate: hf, vllm, hf, ...): a training model (LoRA rank 8) saves a sampler,
takes one step, saves a second; the block then sends P concurrent requests of G samples to the
first sampler, then to the second, then to the first again (on vLLM each a switch: one
``update_weights`` of the whole merged state, timed inside the server), then once more to the
first (no switch). Medians over blocks.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=3)
    args = ap.parse_args()

    import tinker
    from rldsl.runtime.models.loading import load_tokenizer
    from rldsl.runtime.rewards.server import BackgroundServer
    from rldsl.runtime.tinker.server import make_app
    from rldsl.runtime.tinker.service import Service
    from rldsl.runtime.toy.warmup import embedded_model

    types = tinker.types
    path = embedded_model(vllm=True)[0]
    tok = load_tokenizer(path)
    vocab = tok.get_vocab()
    rng = np.random.default_rng(0)
    prompts = [[tok.bos_token_id] + [vocab[c] for c in f"{a}+{b}="] for a, b in rng.integers(0, 100, (args.prompts, 2))]
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])
    root = Path(tempfile.mkdtemp(prefix="bench-tinker-vllm-"))
    services = {e: Service({"toy": path}, root / e, engine=e) for e in ("hf", "vllm")}
    syncs: list[float] = []
    engine = services["vllm"].vllm.engines["toy"]
    real_update = engine.update_weights

    def timed_update(named):
        start = time.perf_counter()
        real_update(named)
        syncs.append(time.perf_counter() - start)
    engine.update_weights = timed_update
    state_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    results: dict[str, dict[str, list[float]]] = {e: {"switch": [], "same": [], "error": []} for e in services}
    try:
        servers = {e: BackgroundServer(make_app(s)) for e, s in services.items()}
        urls = {e: s.__enter__() for e, s in servers.items()}
        for block in range(args.blocks):
            for name in ("hf", "vllm"):
                client = tinker.ServiceClient(base_url=urls[name], api_key="tml-bench")
                tc = client.create_lora_training_client(base_model="toy", rank=8, seed=block).result()
                first = tc.save_weights_and_get_sampling_client().result()
                seq = first.sample(types.ModelInput.from_ints(prompts[0]), num_samples=1,
                                   sampling_params=params).result().sequences[0]
                tc.forward_backward([ce_datum(types, prompts[0] + seq.tokens)], "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                second = tc.save_weights_and_get_sampling_client().result()

                def batch(sampler):
                    start = time.perf_counter()
                    futures = [sampler.sample(types.ModelInput.from_ints(p), num_samples=args.samples,
                                              sampling_params=params) for p in prompts]
                    out = [f.result() for f in futures]
                    return time.perf_counter() - start, out
                batch(first)
                for sampler in (second, first):
                    seconds, out = batch(sampler)
                    results[name]["switch"].append(seconds)
                seconds, out = batch(first)
                results[name]["same"].append(seconds)
                for p, o in list(zip(prompts, out))[:8]:  # logprobs against the trainer's, on the first sampler
                    for s in o.sequences:
                        # the first sampler's weights are the adapters before the step: score with a fresh
                        # model of the same seed (LoRA B = 0 at creation: the base)
                        ref = fresh_logprobs(client, block, ce_datum(types, p + s.tokens))[len(p) - 1:]
                        results[name]["error"].append(float(np.abs(ref - np.array(s.logprobs)).max()))
    finally:
        for s in servers.values():
            s.__exit__(None, None, None)
        for s in services.values():
            s.close()
    print(f"P x G = {args.prompts} x {args.samples}, T {args.max_tokens}; {args.blocks} blocks; "
          f"merged state {state_bytes / 2**20:.2f} MiB")
    for name, r in results.items():
        print(f"{name:5s} batch after a switch {statistics.median(r['switch']):.3f} s, same sampler "
              f"{statistics.median(r['same']):.3f} s; max |sampler - trainer| logprob {max(r['error']):.1e}")
    print(f"vllm / hf, same sampler: {statistics.median(results['vllm']['same']) / statistics.median(results['hf']['same']):.2f}x; "
          f"vLLM update_weights (a switch): median {statistics.median(syncs) * 1e3:.1f} ms over {len(syncs)}")


def ce_datum(types, full: list[int]):
    """A ``cross_entropy`` datum of ``full``: every next token a target of weight 1."""
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(full[1:]),
                                       "weights": np.ones(len(full) - 1, dtype=np.float32)})


_FRESH: dict = {}


def fresh_logprobs(client, seed: int, datum) -> np.ndarray:
    """The trainer's logprobs of ``datum`` at a new model's weights (LoRA B = 0: the base)."""
    key = (id(client), seed)
    if key not in _FRESH:
        _FRESH[key] = client.create_lora_training_client(base_model="toy", rank=8, seed=seed).result()
    out = _FRESH[key].forward([datum], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


if __name__ == "__main__":
    main()
