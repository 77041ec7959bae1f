#!/usr/bin/env bash
# GPU smoke test of the vLLM rollout engine (rldsl.runtime.rollout.engines.vllm.VLLMEngine).
#
# Run on a Linux machine with an NVIDIA GPU, from anywhere:
#     bash bench/gpu_smoke.sh
#
# What it does (each step prints what it observed; nothing is assumed):
#   1. creates a virtualenv (default .venv-gpu-smoke in the repo; SMOKE_VENV=path to
#      change it, SMOKE_SKIP_INSTALL=1 to use the current python as is) and installs
#      rldsl[vllm] into it;
#   2. builds the embedded toy model (rldsl.runtime.toy.warm_start: a few minutes on CPU
#      the first time, cached afterwards);
#   3. generates with VLLMEngine and checks the RolloutBatch layout;
#   4. recomputes the logprobs of the sampled tokens with the transformers model on CPU
#      (float32) and reports the train/inference mismatch at two temperatures;
#   5. perturbs the weights, pushes them with update_weights (after sleep(), as a colocated
#      trainer would), and checks that vLLM now matches the perturbed model, not the old one;
#   6. trains 3 grpo steps on a random-init ~0.5B Qwen2 with the transformers engine on
#      the GPU: bf16 (autocast, fp32 master weights), token-budget micro-batches, packed
#      (padding-free) forwards, LoRA, gradient checkpointing, a ChatML template; prints the
#      run's perf/padding_ratio and perf/mfu (against the GPU's bf16 peak); exports it and
#      reloads the export;
#   7. times packed against padded training forwards on the GPU (bench/packing.py --device
#      cuda): float32 at mid (their logprobs must agree to 1e-4), bfloat16 autocast at mid,
#      large and xl (Qwen2-0.5B's width and depth, answers up to 1024 tokens);
#      then the step's own overhead (bench/overhead.py --device cuda --rldsl-only) at the
#      toy size and Qwen2-0.5B's shape: host, host busy and kernel time per phase;
#   8. prints a PASS/FAIL line per check and exits non-zero if any check failed or any step
#      crashed. "SMOKE TEST PASSED" is printed only when every check passed.
#
# Knobs (environment): SMOKE_DTYPE=float32|bfloat16 (default float32: the tightest
# comparison), SMOKE_GPU_MEM=0.3 (vLLM gpu_memory_utilization), SMOKE_TP=1,
# SMOKE_SKIP_VLLM=1 (a machine without vLLM: steps 2-5 are not run, and the last line says so
# instead of "SMOKE TEST PASSED"), SMOKE_SKIP_BENCH=1 (step 7 not run).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SMOKE_VENV:-$REPO/.venv-gpu-smoke}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_smoke: no NVIDIA GPU visible (nvidia-smi failed): the smoke test was NOT run." >&2
    exit 2
fi
echo "== GPU"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader

if [[ "${SMOKE_SKIP_INSTALL:-0}" == "1" ]]; then
    PY="${PYTHON:-python3}"
    echo "== install skipped (SMOKE_SKIP_INSTALL=1); using $("$PY" -c 'import sys; print(sys.executable)')"
else
    echo "== install rldsl[vllm] into $VENV"
    if [[ ! -x "$VENV/bin/python" ]]; then
        python3 -m venv "$VENV"
    fi
    PY="$VENV/bin/python"
    "$PY" -m pip install --upgrade pip >/dev/null
    "$PY" -m pip install -e "$REPO[vllm]"
fi

"$PY" - <<'PYEOF'
import importlib.metadata as md
for name in ("vllm", "torch", "transformers", "rldsl"):
    try:
        print(f"   {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"   {name} NOT INSTALLED")
PYEOF

set +e
if [[ "${SMOKE_SKIP_VLLM:-0}" == "1" ]]; then
    echo "== vLLM engine checks NOT run (SMOKE_SKIP_VLLM=1)"
    status=0
else
echo "== smoke test"
"$PY" - <<'PYEOF'
import copy
import os
import sys
import time

import torch

from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.rollout.engines.vllm import SUPPORTED_VLLM, VLLMEngine
from rldsl.runtime.toy import load_warm_start, warm_start

DTYPE = os.environ.get("SMOKE_DTYPE", "float32")
# Bounds on |logprob_vllm - logprob_hf| over generated tokens. float32 on both sides should
# agree to ~1e-4; a wrong temperature or stale weights gives errors of order 0.1-1.
MAX_ABS = {"float32": 1e-2, "bfloat16": 0.5}[DTYPE]
MEAN_ABS = {"float32": 1e-3, "bfloat16": 0.05}[DTYPE]
results = []


def check(name, ok, detail):
    results.append((name, bool(ok)))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)


@torch.no_grad()
def hf_logprobs(model, batch, tau):
    """log_softmax(z / tau)[y] of each response token, from the transformers model (CPU)."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)  # [B, Tp+Tr]
    attn = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)  # [B, Tp+Tr]
    pos = (attn.cumsum(dim=1) - 1).clamp(min=0)  # left padding: positions start at 0
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    Tp = batch.prompt_ids.shape[1]
    logits = logits[:, Tp - 1:-1]  # [B, Tr, V] predicts each response token
    lp = torch.log_softmax(logits / tau, dim=-1)
    lp = lp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)  # [B, Tr]
    return lp * batch.response_mask


def mismatch(batch, ref):
    m = batch.response_mask.bool()
    d = (batch.logprobs - ref)[m].abs()
    return d.max().item(), d.mean().item(), int(m.sum())


t0 = time.time()
path = str(warm_start(verbose=True))
print(f"toy model: {path} ({time.time() - t0:.0f} s)")
model, tok = load_warm_start(path)  # float32, CPU: the reference
model.eval()

t0 = time.time()
engine = VLLMEngine(path, dtype=DTYPE, enable_sleep_mode=True, seed=0,
                    gpu_memory_utilization=float(os.environ.get("SMOKE_GPU_MEM", "0.3")),
                    tensor_parallel_size=int(os.environ.get("SMOKE_TP", "1")))
print(f"VLLMEngine up in {time.time() - t0:.0f} s (dtype={DTYPE}, engine dtype "
      f"{engine.model_dtype}, vllm supported range {SUPPORTED_VLLM})")

prompts = ["12+35=", "47+38=", "5+60=", "99+1=", "8+8=", "63+29="]
G = 8

# ---- 1. generate: layout
t0 = time.time()
batch = engine.generate(prompts, SamplingParams(n=G, temperature=1.0, max_new_tokens=8, seed=0))
dt = time.time() - t0
n_tok = int(batch.response_mask.sum())
print(f"generate: {len(batch)} samples, {n_tok} tokens in {dt:.2f} s; "
      f"finish {dict((r, batch.finish_reason.count(r)) for r in set(batch.finish_reason))}")
for b in range(0, len(batch), G):
    print(f"   {batch.prompts[b]!r} -> {batch.completions[b:b + 4]}")
B = len(prompts) * G
pad = tok.pad_token_id
layout_ok = (
    len(batch) == B and batch.prompts == [p for p in prompts for _ in range(G)]
    and torch.equal(batch.response_ids[batch.response_mask == 0],
                    torch.full_like(batch.response_ids[batch.response_mask == 0], pad))
    and bool((batch.logprobs[batch.response_mask == 0] == 0).all())
    and bool((batch.logprobs[batch.response_mask == 1] <= 0).all())
    and bool((batch.response_mask.sum(1) > 0).all())
)
check("generate layout", layout_ok, f"B={len(batch)} (expected {B}), prompt {tuple(batch.prompt_ids.shape)}, "
      f"response {tuple(batch.response_ids.shape)}")

# ---- 2. logprob mismatch against the transformers model, two temperatures
for tau in (1.0, 0.7):
    bt = batch if tau == 1.0 else engine.generate(
        prompts, SamplingParams(n=G, temperature=tau, max_new_tokens=8, seed=1))
    mx, mean, n = mismatch(bt, hf_logprobs(model, bt, tau))
    check(f"logprob mismatch tau={tau}", mx < MAX_ABS and mean < MEAN_ABS,
          f"max |d| {mx:.2e} (< {MAX_ABS:g}), mean |d| {mean:.2e} (< {MEAN_ABS:g}) over {n} tokens")

# ---- 3. weight update (after sleep, as in colocated training)
new = copy.deepcopy(model)
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for p in new.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.2 * (p.abs().mean() + 1e-3))
probe = "model.norm.weight"
before = engine.param_checksums([probe])[probe]
engine.sleep()
t0 = time.time()
engine.update_weights(new.state_dict().items())
dt = time.time() - t0
after = engine.param_checksums([probe])[probe]
want_old = float(model.state_dict()[probe].double().sum())
want_new = float(new.state_dict()[probe].double().sum())
# rounding bound of the engine dtype on a sum of n values: eps * sum |w|
eps = 1e-6 if DTYPE == "float32" else 2.0 ** -8
tol = eps * float(new.state_dict()[probe].abs().double().sum()) + 1e-6
check("update_weights writes in place",
      abs(before - want_old) < tol and abs(after - want_new) < tol
      and abs(want_new - want_old) > 3 * tol,
      f"sum({probe}) vLLM {before:.5f} -> {after:.5f}; HF old {want_old:.5f}, new {want_new:.5f}, "
      f"tolerance {tol:.1e} (update took {dt:.2f} s)")

bt = engine.generate(prompts, SamplingParams(n=G, temperature=1.0, max_new_tokens=8, seed=2))
mx_new, mean_new, n = mismatch(bt, hf_logprobs(new, bt, 1.0))
mx_old, mean_old, _ = mismatch(bt, hf_logprobs(model, bt, 1.0))
check("vLLM follows the new weights", mx_new < MAX_ABS and mean_new < MEAN_ABS,
      f"vs new model: max {mx_new:.2e}, mean {mean_new:.2e} over {n} tokens")
check("vLLM left the old weights", mean_old > 10 * mean_new and mean_old > MEAN_ABS,
      f"vs old model: mean {mean_old:.2e} (must exceed 10x {mean_new:.2e})")

greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
v = engine.generate(prompts, greedy)
h = HFEngine(new, tok).generate(prompts, greedy)
same = sum(a == b for a, b in zip(v.completions, h.completions))
print(f"info: greedy completions identical to transformers on {same}/{len(v)} rows "
      "(near-ties may differ; not a check)")

failed = [n for n, ok in results if not ok]
print(f"\n{len(results) - len(failed)}/{len(results)} checks passed" +
      (f"; FAILED: {', '.join(failed)}" if failed else ""))
sys.exit(1 if failed else 0)
PYEOF
status=$?
fi

echo "== real-model path: random-init Qwen2 ~0.5B, bf16, token-budget micro-batches, LoRA, export"
"$PY" - <<'PYEOF'
# Trains 3 steps of grpo with the transformers engine on the GPU and exports the result.
# Checks: the run finishes its 3 steps with finite losses; the export loads with
# from_pretrained and has no LoRA tensor. Prints peak CUDA memory and s/step (measured).
import json, os, sys, tempfile, time
from pathlib import Path
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from safetensors.torch import load_file

results = []
def check(name, ok, detail):
    results.append((name, bool(ok)))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)

work = Path(tempfile.mkdtemp(prefix="rldsl-realmodel-"))
specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!:+-*=#\n")
vocab = {t: i for i, t in enumerate(specials + chars)}
core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
core.pre_tokenizer = pre_tokenizers.Split(Regex("<\\|im_(start|end)\\|>|<\\|endoftext\\|>|."), behavior="isolated")
core.decoder = decoders.Fuse()
core.add_special_tokens(specials)
tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                              unk_token="<unk>", padding_side="left")
tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
cfg = Qwen2Config(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True,
                  bos_token_id=None, eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"])
torch.manual_seed(0)
model = Qwen2ForCausalLM(cfg)
n = sum(p.numel() for p in model.parameters())
model.save_pretrained(work / "model"); tok.save_pretrained(work / "model")
print(f"   model: {n / 1e6:.0f}M parameters at {work / 'model'}")
rows = [{"prompt": [{"role": "user", "content": f"what is {a}+{b}?"}], "answer": str(a + b)}
        for a in range(10) for b in range(10)]
(work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

from rldsl.runtime.run import loop
from rldsl.runtime.config import load_config
from rldsl.runtime.records.export import export_run
sets = [f"model.path={work / 'model'}", f"data.path={work / 'data.jsonl'}", "reward.name=math",
        f"out={work / 'run'}", "device=cuda", "model.dtype=bfloat16", "model.lora.rank=16",
        "train.max_tokens_per_microbatch=4096", "train.gradient_checkpointing=true", "train.packing=true",
        "rollout.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=256", "train.steps=3",
        "train.lr=1e-5", "eval.every=0", "data.eval_size=0", "log.progress=false", "checkpoint.every=0"]
try:
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    run = loop.train("grpo", load_config(None, sets))
    wall = time.perf_counter() - t0
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward_mean" in r]
    ok = len(steps) == 3 and all(r.get("loss") is None or abs(r["loss"]) < 1e9 for r in steps)
    check("bf16 + micro-batches + packing + LoRA + grad ckpt run", ok,
          f"{len(steps)} steps, s/step {[round(r['step_s'], 2) for r in steps]}, "
          f"peak CUDA memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, wall {wall:.0f} s, "
          f"response_length {[round(r['response_length'], 1) for r in steps]}, "
          f"padding_ratio {[round(r.get('perf/padding_ratio', float('nan')), 3) for r in steps]}, "
          f"mfu {[round(r.get('perf/mfu', float('nan')), 4) for r in steps]}")
    out = export_run(run, work / "export")
    keys = load_file(str(out / "model.safetensors")) if (out / "model.safetensors").exists() else {}
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))
    check("export", not any("lora" in k for k in keys) and reloaded is not None,
          f"{out}: {len(keys)} tensors, none with 'lora'")
except Exception as e:  # report, do not hide
    import traceback; traceback.print_exc()
    check("real-model path", False, f"{type(e).__name__}: {e}")
failed = [n for n, ok in results if not ok]
print(f"\n{len(results) - len(failed)}/{len(results)} real-model checks passed")
sys.exit(1 if failed else 0)
PYEOF
status2=$?
if [[ $status -eq 0 && $status2 -ne 0 ]]; then status=$status2; fi

if [[ "${SMOKE_SKIP_BENCH:-0}" != "1" ]]; then
    echo "== packed vs padded training forwards on the GPU (bench/packing.py)"
    # float32: the packed logprobs must equal the padded ones (last column) to 1e-4
    "$PY" "$REPO/bench/packing.py" --device cuda --dtype float32 --sizes mid --repeats 3 2>&1 \
        | grep -E '^(device|\|)' | tee /tmp/rldsl-smoke-fp32.txt
    status3=${PIPESTATUS[0]}
    worst=$(awk -F'|' '/^\| mid/ {print $11}' /tmp/rldsl-smoke-fp32.txt | sort -g | tail -1)
    if [[ $status3 -eq 0 ]] && awk -v d="${worst:-nan}" 'BEGIN {exit !(d + 0 == d && d < 1e-4)}'; then
        echo "[PASS] packed logprobs equal padded on CUDA (float32): max |d| $worst (< 1e-4)"
    else
        echo "[FAIL] packed logprobs on CUDA (float32): exit $status3, max |d| ${worst:-none}"
        [[ $status -eq 0 ]] && status=1
    fi
    "$PY" "$REPO/bench/packing.py" --device cuda --dtype bfloat16 --sizes mid,large,xl --repeats 5 2>&1 \
        | grep -E '^(device|\||Traceback|[A-Za-z]*Error)'
    status4=${PIPESTATUS[0]}
    if [[ $status4 -ne 0 ]]; then
        echo "[FAIL] bench/packing.py bfloat16 exited $status4"
        [[ $status -eq 0 ]] && status=1
    fi
    echo "== the step's own overhead on the GPU (bench/overhead.py --device cuda): host, host busy and kernel time per phase"
    for size in toy qwen0.5b; do
        "$PY" "$REPO/bench/overhead.py" --device cuda --rldsl-only --size "$size" --rounds 1 --steps 8 2>&1 \
            | grep -E '^(\||step:|run |host busy|Traceback|[A-Za-z]*Error)'
        status5=${PIPESTATUS[0]}
        if [[ $status5 -ne 0 ]]; then
            echo "[FAIL] bench/overhead.py --device cuda --size $size exited $status5"
            [[ $status -eq 0 ]] && status=1
        fi
    done
fi
set -e
if [[ $status -eq 0 && "${SMOKE_SKIP_VLLM:-0}" == "1" ]]; then
    echo "SMOKE TEST PASSED WITHOUT ITS vLLM CHECKS (SMOKE_SKIP_VLLM=1): the vLLM engine was not tried"
elif [[ $status -eq 0 ]]; then
    echo "SMOKE TEST PASSED"
else
    echo "SMOKE TEST FAILED (exit status $status): see the lines above" >&2
fi
exit $status
