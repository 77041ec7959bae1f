"""The engine/trainer logprob mismatch per ``model.dtype`` and engine, on the same seed.

One step of ``grpo_tis`` (it reads the engine's logprobs: the trainer recomputes the old
logprobs and its truncated importance correction reports on them) per (model, engine, dtype),
each in a fresh process; printed per run: ``rollout_logprob_diff`` (mean |engine - trainer| over
the sampled tokens), the correction's ``correction/is_mean``, ``is_min``, ``is_max``,
``mismatch_kl`` and ``ess``, and the wall time of the run. The same seed, prompts (the built-in
task: P=4 prompts x n=4, 16 new tokens, temperature 1) and weights for every dtype.

Models (random init, built locally; no pretrained weights can be downloaded here):
  tiny  Llama, hidden 128, 2 layers, 2 heads of 64 (vLLM's CPU attention needs head dim 64),
        the toy tokenizer, init std 0.1 (peaked distributions)
  0.1B  Qwen2.5 shapes (hidden 512, intermediate 2048, 12 layers, 8 heads, 2 KV heads), the
        qwen2.5 real-shaped tokenizer of tests/fixtures/real_model.py, init std 0.05

    .venv-vllm/bin/python bench/precision.py                         # both models, hf and vllm
    .venv/bin/python bench/precision.py --engines hf --models tiny   # without vLLM
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("rollout_logprob_diff", "correction/is_mean", "correction/is_min", "correction/is_max",
        "correction/mismatch_kl", "correction/ess")


def build(name: str, folder: Path) -> Path:
    from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    if name == "tiny":
        from rldsl.runtime.toy import build_tokenizer, tiny_config
        tok = build_tokenizer()
        cfg = tiny_config(tok, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)
        cfg.initializer_range = 0.1
        model = LlamaForCausalLM(cfg)
    else:
        sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
        from real_model import build_tokenizer
        tok = build_tokenizer("qwen2.5")
        cfg = Qwen2Config(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=len(tok), tie_word_embeddings=True,
                          initializer_range=0.05, max_position_embeddings=512,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def one(model: Path, engine: str, dtype: str, out: Path) -> dict:
    from rldsl.runtime.config import load_config
    from rldsl.runtime.records.metrics import read_metrics
    from rldsl.runtime.run import loop
    sets = [f"model.path={model}", f"out={out}", f"rollout.engine={engine}", f"model.dtype={dtype}",
            "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=16", "train.steps=1",
            "train.skip_zero_advantage=false", "eval.every=0", "data.eval_size=0", "checkpoint.every=0",
            "log.progress=false", "seed=0", "data.task=addition"]
    if engine == "vllm":
        context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
        sets += ["rollout.vllm.gpu_memory_utilization=0.1", f"rollout.vllm.max_model_len={min(128, context)}"]
    start = time.perf_counter()
    run = loop.train("grpo_tis", load_config(None, sets))
    wall = time.perf_counter() - start
    rec = [r for r in read_metrics(run / "metrics.jsonl") if "rollout_logprob_diff" in r][-1]
    return {"wall_s": round(wall, 1), **{k: rec.get(k) for k in KEYS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,0.1B")
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--one", nargs=4, metavar=("MODEL_DIR", "ENGINE", "DTYPE", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(Path(a.one[0]), a.one[1], a.one[2], Path(a.one[3]))), flush=True)
        return
    tmp = Path(tempfile.mkdtemp(prefix="rldsl-precision-"))
    for name in a.models.split(","):
        folder = build(name, tmp / name)
        for engine in a.engines.split(","):
            for dtype in a.dtypes.split(","):
                out = tmp / f"{name}-{engine}-{dtype}"
                p = subprocess.run([sys.executable, __file__, "--one", str(folder), engine, dtype, str(out)],
                                   capture_output=True, text=True)
                lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if lines:
                    row = json.loads(lines[-1][7:])
                else:
                    err = [x for x in p.stderr.strip().splitlines() if x.strip()]
                    row = {"error": err[-1][:300] if err else f"exit {p.returncode}"}
                print(json.dumps({"model": name, "engine": engine, "dtype": dtype, **row}), flush=True)


if __name__ == "__main__":
    main()
