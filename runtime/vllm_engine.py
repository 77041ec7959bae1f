"""``VLLMEngine``: the GPU rollout engine, built on vLLM's offline ``LLM`` class.

Shapes: P prompts, G = ``params.n`` samples per prompt, B = P*G rows with each group
contiguous (rows g*G .. g*G+G-1 answer prompt g); Tp = prompt length (left padded),
Tr = response length (right padded). The layout is the one ``HFEngine`` (engine.py)
returns, so the trainer cannot tell the engines apart:

- prompts are tokenized here with the model's HF tokenizer, exactly as ``HFEngine`` does
  (``tokenizer(prompts)``, special tokens added), and handed to vLLM as token ids;
- ``response_mask`` is 1 on generated tokens up to and including the first stop token
  (the EOS, plus any extra EOS ids of the model's ``generation_config.json``, which vLLM
  also stops on) and 0 after it; ``response_ids`` hold the pad id wherever the mask is 0;
- ``finish_reason`` is "stop" when the completion holds a stop token, else vLLM's reason
  ("stop" for a stop string, "length" for ``max_tokens`` / ``max_model_len``); any other
  vLLM reason ("abort", "error", ...) raises. (vLLM 0.11 reports "length" when the EOS is
  the last allowed token; 0.33 reports "stop". Both become "stop" here, as in HFEngine.)
- ``completions`` are decoded from the masked ids with ``skip_special_tokens=True``
  (vLLM's own detokenizer is switched off: ``detokenize=False``).

What ``logprobs`` hold
    The engine is built with ``logprobs_mode="processed_logprobs"`` and samples with
    ``logprobs=0``, so vLLM returns, for each sampled token y_t, the log-probability under
    the distribution it actually sampled from: ``log_softmax(filter(z_t / tau))[y_t]`` with
    z the logits, tau the temperature (vLLM skips the division for greedy, tau = 1) and
    ``filter`` the top-p mask (no top-k, no penalties are set). With ``top_p = 1`` (the
    default) this is exactly HFEngine's quantity ``log_softmax(z_t / tau)[y_t]``; with
    ``top_p < 1`` vLLM's value is renormalized over the nucleus, i.e. larger than HFEngine's
    by ``-log(nucleus mass)``. They measure the train/inference mismatch; they are never
    used as policy logprobs. (vLLM's default, "raw_logprobs", ignores the temperature.)

Weight sync (``update_weights``)
    Names from the trainer (FSDP / torch.compile / DDP wrappers stripped, tied
    ``lm_head`` folded into the embedding: ``to_vllm_weight_names``) are cast to the engine
    dtype, grouped into buckets of at most ``weight_bucket_bytes`` (``bucket_by_bytes``),
    serialized with safetensors and sent with ``LLM.collective_rpc`` to every vLLM worker,
    where ``RldslWorkerExtension`` (mixed into vLLM's worker via ``worker_extension_cls``)
    calls the model's own ``load_weights`` -- the path vLLM uses to read an HF checkpoint,
    which also fuses q/k/v and gate/up and shards for tensor parallelism. Parameters are
    copied in place (same storage), so CUDA graphs stay valid; the prefix cache is reset
    afterwards (its KV blocks were computed with the old weights). Every RPC runs under a
    timeout (``weight_sync_timeout``): a stuck worker raises ``WeightSyncTimeout`` instead of
    hanging the run. After the last bucket the workers report parameters that were not
    written; with ``strict_weight_sync`` that is an error.

    Tensors cross as bytes (GPU -> CPU -> engine process -> GPU): simple and correct, fine
    for the models this path is meant for (<= a few B parameters); docs/scaling.md gives the
    cost and the NCCL / CUDA-IPC alternatives for large models. Only unquantized models on
    CUDA are supported: there ``process_weights_after_loading`` is a no-op for
    ``UnquantizedLinearMethod``, so ``load_weights`` alone is a complete reload.

Colocated mode (``enable_sleep_mode=True``)
    ``sleep()`` releases vLLM's GPU memory for the trainer (level 1: weights to CPU, KV cache
    dropped; level 2: both dropped -- only safe when every weight is pushed again before the
    next generate). ``update_weights`` wakes only the weights; ``generate`` wakes the rest.

vLLM versions
    Written against vLLM 0.33.0 (the newest release on PyPI when this was written) and
    checked against 0.11.0: every vLLM name used here exists with the same meaning in
    both. Releases in between were not read. Supported: ``vllm>=0.11,<0.34``. vLLM is
    imported lazily, so this module imports (and its pure functions run) without it.

Sources read (vLLM 0.33.0 and 0.11.0 wheels; the vLLM and OpenRLHF/verl repositories)
    vllm/entrypoints/llm.py        ``LLM.__init__`` (extra kwargs go to ``EngineArgs``),
                                   ``generate`` (outputs in prompt order),
                                   ``collective_rpc(method, timeout, args, kwargs)``,
                                   ``sleep(level)``, ``wake_up(tags)``, ``reset_prefix_cache()``
    vllm/engine/arg_utils.py       ``EngineArgs.logprobs_mode``, ``enable_sleep_mode``,
                                   ``worker_extension_cls``, ``max_model_len``
    vllm/config/model.py           ``LogprobsMode``; generation_config handling
    vllm/v1/sample/sampler.py, vllm/v1/sample/ops/topk_topp_sampler.py,
    vllm/v1/worker/gpu/sample/sampler.py + states.py (Model Runner V2, 0.33's default)
                                   where raw / processed logprobs are taken (greedy: no
                                   temperature; random: after temperature and top-k/top-p)
    vllm/sampling_params.py        fields; temperature < 1e-5 is greedy and then n must be 1
                                   (``_verify_greedy_sampling``); ``update_from_generation_config``
                                   adds the generation_config EOS ids as stop tokens
    vllm/outputs.py, vllm/logprobs.py
                                   ``RequestOutput.prompt_token_ids / outputs``;
                                   ``CompletionOutput.index / token_ids / logprobs /
                                   finish_reason``; ``Logprob.logprob``; ``FlatLogprobs``
                                   indexes like ``list[dict[int, Logprob]]``
    vllm/v1/core/sched/utils.py::check_stop      the stop token is kept in ``token_ids``
    vllm/v1/engine/parallel_sampling.py          n > 1: child seed = seed + index, outputs
                                                 placed by index
    vllm/v1/worker/worker_base.py (0.33), vllm/worker/worker_base.py (0.11)
                                   ``worker_extension_cls`` is appended to the worker's bases
                                   (names must not clash with the worker's)
    vllm/v1/worker/gpu_worker.py, gpu_model_runner.py::get_model
                                   the model under the CUDA-graph wrapper; sleep / wake_up tags
                                   ("weights", "kv_cache"); level-2 buffers restored on wake
    vllm/v1/executor/abstract.py   ``SLEEP_TAGS``; ``wake_up`` per tag
    vllm/v1/engine/core_client.py, vllm/v1/serial_utils.py
                                   ``collective_rpc`` arguments travel as msgpack to the engine
                                   process: bytes are native, a torch tensor inside an untyped
                                   utility call is not decoded back into a tensor -> we send
                                   safetensors bytes; the client waits without a timeout ->
                                   we guard each call with our own
    vllm/model_executor/models/utils.py::AutoWeightsLoader, models/llama.py, qwen2.py
                                   ``load_weights`` takes HF checkpoint names, skips the tied
                                   alias, drops ``rotary_emb.inv_freq``
    vllm/model_executor/layers/linear.py::UnquantizedLinearMethod.process_weights_after_loading
    examples/offline_inference/rlhf_utils.py (vLLM git), OpenRLHF
    openrlhf/trainer/ray/vllm_worker_wrap.py, verl verl/workers/rollout/vllm_rollout/utils.py
                                   the worker-extension + ``model.load_weights`` pattern
                                   (read, not copied)
"""
from __future__ import annotations

import gc
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Iterator, Sequence, TypeVar

import torch

from .types import RolloutBatch, SamplingParams

#: Qualified name handed to vLLM as ``worker_extension_cls``.
WORKER_EXTENSION = "rldsl.runtime.vllm_engine.RldslWorkerExtension"

#: The vLLM releases this module was checked against (see the module docstring).
SUPPORTED_VLLM = ">=0.11,<0.34"

INSTALL_HINT = (
    "VLLMEngine needs vLLM, which is not installed. Install it with "
    "`pip install 'rldsl[vllm]'` on a machine with an NVIDIA GPU (CUDA): vLLM has no "
    "CPU wheel here. On CPU use the 'hf' rollout engine (rollout.engine = \"hf\")."
)

_T = TypeVar("_T")


class VLLMUnavailableError(ImportError):
    """vLLM cannot be imported (not installed, or no usable build on this machine)."""


class WeightSyncError(RuntimeError):
    """Pushing weights into the vLLM engine failed."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A vLLM worker did not answer in time; the engine is unusable afterwards."""


def import_vllm() -> Any:
    """Import vLLM, or raise ``VLLMUnavailableError`` with install instructions."""
    try:
        import vllm
    except ImportError as e:  # not installed, or a broken / CUDA-less build
        raise VLLMUnavailableError(f"{INSTALL_HINT} (import error: {e})") from e
    return vllm


# ------------------------------------------------------------------ sampling parameters
def to_vllm_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` that sample like ``params``.

    - temperature 0 is greedy in vLLM too, but vLLM then refuses n > 1, so greedy asks for
      ``n=1`` (``VLLMEngine.generate`` sends each prompt G times instead) and top_p=1;
    - ``logprobs=0``: only the sampled token's logprob (see the module docstring for what
      it means under ``logprobs_mode="processed_logprobs"``);
    - ``detokenize=False``: completions are decoded here, as in HFEngine;
    - no top-k, penalties or stop strings: vLLM's defaults leave them off.
    """
    if params.n < 1 or params.max_new_tokens < 1:
        raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got {params}")
    if params.temperature < 0 or not 0 < params.top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {params}")
    greedy = params.temperature == 0
    return {
        "n": 1 if greedy else params.n,
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": 1.0 if greedy else float(params.top_p),
        "max_tokens": int(params.max_new_tokens),
        "logprobs": 0,
        "seed": params.seed,
        "detokenize": False,
    }


# ------------------------------------------------------------------- result conversion
def outputs_to_rollout_batch(
    request_outputs: Sequence[Any],
    tokenizer: Any,
    prompts: Sequence[str],
    group_size: int,
    pad_id: int,
    eos_id: int,
    stop_ids: Collection[int] = (),
) -> RolloutBatch:
    """Turn vLLM ``RequestOutput``s into a ``RolloutBatch`` (HFEngine's layout).

    Works on any objects with vLLM's attribute names: ``ro.prompt_token_ids``,
    ``ro.outputs[i].index / token_ids / logprobs / finish_reason``, with ``logprobs[t]`` a
    mapping ``token_id -> obj with .logprob`` (a list of dicts or vLLM's ``FlatLogprobs``).

    ``request_outputs`` are in prompt order and hold, together, P*G completions: either one
    output per prompt with G completions each (sampling), or G outputs per prompt with one
    completion each (greedy, where vLLM refuses n > 1). ``stop_ids`` are extra ids that end a
    completion like ``eos_id`` (vLLM adds the generation_config EOS ids).
    """
    P, G = len(prompts), group_size
    if G < 1:
        raise ValueError(f"group_size must be >= 1, got {G}")
    rows: list[tuple[list[int], Any]] = []  # (prompt ids, completion) per row b
    for ro in request_outputs:
        prompt_ids = list(ro.prompt_token_ids)
        for completion in sorted(ro.outputs, key=lambda c: c.index):
            rows.append((prompt_ids, completion))
    B = P * G
    if len(rows) != B:
        raise ValueError(
            f"expected {P} prompts x {G} samples = {B} completions, vLLM returned "
            f"{len(rows)} in {len(request_outputs)} request outputs"
        )
    for b in range(B):  # every row of a group must answer the same prompt
        if rows[b][0] != rows[(b // G) * G][0]:
            raise ValueError(f"row {b}: prompt ids differ within group {b // G}")

    terminators = {int(eos_id), *(int(s) for s in stop_ids)}
    lengths: list[int] = []  # L_b: valid response tokens (up to and including the stop)
    reasons: list[str] = []
    for b, (_, c) in enumerate(rows):
        ids = list(c.token_ids)
        stop_at = next((t for t, tok in enumerate(ids) if tok in terminators), None)
        lengths.append(len(ids) if stop_at is None else stop_at + 1)
        reasons.append(_finish_reason(c.finish_reason, stopped=stop_at is not None, row=b))

    Tp = max(len(p) for p, _ in rows)
    Tr = max(1, max(len(c.token_ids) for _, c in rows))  # HFEngine always has >= 1 column
    prompt_ids = torch.full((B, Tp), pad_id, dtype=torch.long)  # [B, Tp]
    prompt_mask = torch.zeros((B, Tp), dtype=torch.long)  # [B, Tp]
    response_ids = torch.full((B, Tr), pad_id, dtype=torch.long)  # [B, Tr]
    response_mask = torch.zeros((B, Tr), dtype=torch.long)  # [B, Tr]
    logprobs = torch.zeros((B, Tr), dtype=torch.float32)  # [B, Tr]
    valid_ids: list[list[int]] = []
    for b, ((p_ids, c), L) in enumerate(zip(rows, lengths)):
        if p_ids:
            prompt_ids[b, Tp - len(p_ids):] = torch.tensor(p_ids, dtype=torch.long)
            prompt_mask[b, Tp - len(p_ids):] = 1
        ids = [int(t) for t in list(c.token_ids)[:L]]
        valid_ids.append(ids)
        if L:
            response_ids[b, :L] = torch.tensor(ids, dtype=torch.long)
            response_mask[b, :L] = 1
            logprobs[b, :L] = torch.tensor(_sampled_logprobs(c.logprobs, ids, row=b))

    completions = tokenizer.batch_decode(valid_ids, skip_special_tokens=True)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        logprobs=logprobs,
        finish_reason=reasons,
        prompts=[p for p in prompts for _ in range(G)],
        completions=list(completions),
        group_size=G,
    )


def _finish_reason(vllm_reason: Any, *, stopped: bool, row: int) -> str:
    reason = None if vllm_reason is None else str(vllm_reason)
    if reason not in ("stop", "length"):
        raise RuntimeError(
            f"vLLM finished row {row} with finish_reason={reason!r} (expected 'stop' or "
            "'length'): the request was aborted or failed inside vLLM"
        )
    return "stop" if stopped else reason


def _sampled_logprobs(position_logprobs: Any, ids: list[int], *, row: int) -> list[float]:
    """Logprob of each sampled token: ``position_logprobs[t][ids[t]].logprob``."""
    if position_logprobs is None:
        raise ValueError(
            f"row {row}: vLLM returned no logprobs; sample with logprobs=0 "
            "(to_vllm_sampling_kwargs does)"
        )
    if len(position_logprobs) < len(ids):
        raise ValueError(
            f"row {row}: {len(position_logprobs)} logprob entries for {len(ids)} tokens"
        )
    out = []
    for t, tok in enumerate(ids):
        entry = position_logprobs[t]
        if tok not in entry:
            raise ValueError(f"row {row}, position {t}: no logprob for sampled token {tok}")
        out.append(float(entry[tok].logprob))
    return out


# ------------------------------------------------------------------------ weight names
#: Module names that wrappers insert into parameter paths: FSDP1, activation
#: checkpointing (``checkpoint_wrapper``), ``torch.compile`` (OptimizedModule).
WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
#: Buffers that HF checkpoints may carry and vLLM computes itself (it drops them too).
NOT_LOADED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def hf_weight_name(name: str) -> str:
    """The HF checkpoint name of a trainer parameter name.

    Drops the path components wrappers insert (``_fsdp_wrapped_module``,
    ``_checkpoint_wrapped_module``, ``_orig_mod``) wherever they are, and leading ``module``
    components (DDP / DeepSpeed). Only whole components are removed:
    ``model.layers.0.mlp.up_proj.weight`` is left alone. FSDP1 flat parameters have no HF
    name: they raise (gather a full state dict first).
    """
    parts = name.split(".")
    if any(p in ("_flat_param", "flat_param") for p in parts):
        raise ValueError(
            f"{name!r} is an FSDP1 flat parameter: gather a full state dict "
            "(StateDictType.FULL_STATE_DICT, or FSDP2's DTensor.full_tensor()) first"
        )
    parts = [p for p in parts if p not in WRAPPER_COMPONENTS]
    while parts and parts[0] == "module":
        parts = parts[1:]
    if not parts:
        raise ValueError(f"{name!r} has no parameter name left after removing wrappers")
    return ".".join(parts)


def to_vllm_weight_names(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    tie_word_embeddings: bool,
    embed_name: str = "model.embed_tokens.weight",
    lm_head_name: str = "lm_head.weight",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Map trainer (name, tensor) pairs to the names vLLM's ``load_weights`` expects.

    vLLM reads HF checkpoint names, so this is ``hf_weight_name`` plus:

    - rotary caches (``NOT_LOADED_SUFFIXES``) are dropped;
    - with tied embeddings vLLM's ``lm_head`` *is* the embedding: ``lm_head.weight`` is
      dropped when ``embed_name`` is also given, else sent under ``embed_name`` (a state
      dict may keep only one of the two aliases);
    - a name that occurs twice after mapping raises (two tensors for one parameter).

    The input is consumed lazily (a held-back tied ``lm_head`` is the only tensor kept).
    """
    seen: set[str] = set()
    held_lm_head: torch.Tensor | None = None
    for raw_name, tensor in named_tensors:
        name = hf_weight_name(raw_name)
        if name.endswith(NOT_LOADED_SUFFIXES):
            continue
        if name in seen or (name == lm_head_name and held_lm_head is not None):
            raise ValueError(f"two tensors map to the weight name {name!r} (from {raw_name!r})")
        if tie_word_embeddings and name == lm_head_name:
            held_lm_head = tensor
            continue
        seen.add(name)
        yield name, tensor
    if held_lm_head is not None and embed_name not in seen:
        yield embed_name, held_lm_head


def materialize(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A plain, contiguous CPU tensor: DTensors gathered (``full_tensor()``, a collective
    every rank must join), floating tensors cast to ``dtype`` when given."""
    if hasattr(tensor, "full_tensor"):  # torch.distributed.tensor.DTensor (FSDP2)
        tensor = tensor.full_tensor()
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.to("cpu").contiguous()


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_by_bytes(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs, in order, into lists of at most ``max_bytes`` bytes.

    A tensor larger than ``max_bytes`` travels alone. Empty buckets are never yielded.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def pack_bucket(bucket: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """Serialize (name, CPU tensor) pairs to safetensors bytes (any dtype, bf16 included)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in bucket:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in storages and tensor.numel():  # safetensors refuses shared storage
            tensor = tensor.clone()
        storages.add(ptr)
        tensors[name] = tensor.contiguous()
    return save(tensors)


def unpack_bucket(payload: bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``pack_bucket``."""
    from safetensors.torch import load

    return list(load(bytes(payload)).items())


def call_with_timeout(fn: Callable[[], _T], timeout: float | None, what: str) -> _T:
    """Run ``fn()`` and return its result, or raise ``WeightSyncTimeout`` after ``timeout`` s.

    The call runs on a daemon thread: on a timeout it is abandoned (it cannot be
    cancelled), so the caller must treat the engine as broken. ``None`` waits forever.
    """
    if timeout is None:
        return fn()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name=f"rldsl-vllm-{what}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise WeightSyncTimeout(
            f"vLLM did not finish {what} within {timeout:.0f} s. A worker may have died or "
            "be stuck in a collective; the engine is now unusable: restart it (and check "
            "the vLLM worker logs). Raise VLLMEngine(weight_sync_timeout=...) if the "
            "transfer is just slow."
        )
    if "error" in box:
        raise box["error"]
    return box["result"]


# ---------------------------------------------------------------- worker-side extension
class RldslWorkerExtension:
    """Methods vLLM mixes into each of its GPU workers (``worker_extension_cls``).

    Called through ``LLM.collective_rpc("rldsl_...")``. Inside a worker ``self`` is vLLM's
    worker: ``self.model_runner`` holds the model. Every name starts with ``rldsl_`` so it
    cannot clash with the worker's own attributes (vLLM asserts that).
    """

    def rldsl_begin_weight_update(self) -> int:
        """Start counting which parameters the coming buckets write."""
        self.rldsl_loaded_names = set()
        return 0

    def rldsl_load_weights(self, payload: bytes) -> int:
        """Load one packed bucket of HF-named tensors in place; returns how many."""
        weights = unpack_bucket(payload)
        model = _worker_model(self)
        with torch.no_grad():
            loaded = model.load_weights(weights)
        if getattr(self, "rldsl_loaded_names", None) is None:
            self.rldsl_loaded_names = set()
        if loaded is None:  # some models do not report: no completeness check then
            self.rldsl_loaded_names = None
        elif self.rldsl_loaded_names is not None:
            self.rldsl_loaded_names.update(loaded)
        device = getattr(self, "device", None)
        if device is not None and getattr(device, "type", None) == "cuda":
            torch.cuda.synchronize(device)
        return len(weights)

    def rldsl_finish_weight_update(self) -> list[str] | None:
        """Names of model parameters no bucket wrote since the last begin (None = unknown)."""
        loaded = getattr(self, "rldsl_loaded_names", None)
        self.rldsl_loaded_names = None
        if loaded is None:
            return None
        names = [n for n, _ in _worker_model(self).named_parameters()]
        return sorted(n for n in names if n not in loaded)

    def rldsl_param_checksums(self, names: list[str] | None = None) -> dict[str, float]:
        """{vLLM parameter name: float64 sum of its values} (for smoke tests)."""
        params = dict(_worker_model(self).named_parameters())
        wanted = params if names is None else {n: params[n] for n in names if n in params}
        return {n: float(p.detach().double().sum().item()) for n, p in wanted.items()}


def _worker_model(worker: Any) -> torch.nn.Module:
    runner = worker.model_runner
    get_model = getattr(runner, "get_model", None)  # unwraps CUDA-graph wrappers
    return get_model() if callable(get_model) else runner.model


# ----------------------------------------------------------------------------- engine
@dataclass
class _Options:
    enable_sleep_mode: bool
    sleep_level: int
    weight_bucket_bytes: int
    weight_sync_timeout: float | None
    strict_weight_sync: bool


class VLLMEngine:
    """A ``RolloutEngine`` on vLLM (GPU). See the module docstring for the guarantees.

    Args:
        model: folder (or hub name) of an HF causal LM: config, weights, tokenizer.
        tokenizer: tokenizer folder if it is not ``model``.
        tensor_parallel_size: GPUs per engine (vLLM ``tensor_parallel_size``).
        gpu_memory_utilization: fraction of each GPU vLLM may take (weights + KV cache).
            Colocated with a trainer, leave the trainer its share.
        dtype: "auto" (the config's; vLLM turns float32 into a 16-bit type), "bfloat16",
            "float16" or "float32".
        enable_sleep_mode: colocated mode: ``sleep()`` / ``wake_up()`` free and restore the
            GPU memory (vLLM ``enable_sleep_mode``; CUDA only).
        sleep_level: level used by ``sleep()``: 1 keeps a CPU copy of the weights, 2 drops
            them (then every weight must be pushed before the next ``generate``).
        seed: vLLM's global seed (per-call seeds come from ``SamplingParams.seed``).
        max_model_len: longest prompt + completion; None = the model config's.
        enforce_eager: disable CUDA graphs (slower, less memory, quicker start).
        weight_bucket_bytes: most bytes per weight-sync message.
        weight_sync_timeout: seconds each weight-sync RPC may take (None = wait forever).
        strict_weight_sync: raise if an update leaves some parameter unwritten.
        engine_kwargs: more ``vllm.LLM`` / ``EngineArgs`` keyword arguments.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        tokenizer: str | os.PathLike | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        dtype: str = "auto",
        enable_sleep_mode: bool = False,
        sleep_level: int = 1,
        seed: int = 0,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        weight_bucket_bytes: int = 256 * 2**20,
        weight_sync_timeout: float | None = 600.0,
        strict_weight_sync: bool = True,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        vllm = import_vllm()  # first: a clear error before anything else is touched
        from transformers import AutoConfig, AutoTokenizer

        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        model, tok_path = str(model), str(tokenizer if tokenizer is not None else model)
        hf_tokenizer = AutoTokenizer.from_pretrained(tok_path)
        hf_config = AutoConfig.from_pretrained(model)
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        kwargs: dict[str, Any] = dict(
            model=model,
            tokenizer=tok_path,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs.update(engine_kwargs or {})
        llm = vllm.LLM(**kwargs)
        self._attach(
            llm,
            hf_tokenizer,
            sampling_params_cls=vllm.SamplingParams,
            tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
            stop_ids=_generation_config_eos_ids(model),
            options=_Options(
                enable_sleep_mode=enable_sleep_mode,
                sleep_level=sleep_level,
                weight_bucket_bytes=weight_bucket_bytes,
                weight_sync_timeout=weight_sync_timeout,
                strict_weight_sync=strict_weight_sync,
            ),
        )

    def _attach(
        self,
        llm: Any,
        tokenizer: Any,
        *,
        sampling_params_cls: Callable[..., Any],
        tie_word_embeddings: bool,
        stop_ids: Collection[int],
        options: _Options,
    ) -> None:
        """Wire an existing ``vllm.LLM`` (built with our worker extension) to this engine."""
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("VLLMEngine needs a tokenizer with both a pad and an EOS token")
        if tokenizer.pad_token_id == tokenizer.eos_token_id:
            raise ValueError(
                "VLLMEngine needs pad != EOS (as HFEngine does): with pad == EOS a padded "
                "row cannot be told apart from a finished answer"
            )
        self.llm = llm
        self.tokenizer = tokenizer
        self.pad_id: int = tokenizer.pad_token_id
        self.eos_id: int = tokenizer.eos_token_id
        self.stop_ids = frozenset(int(s) for s in stop_ids) - {self.eos_id}
        self.tie_word_embeddings = tie_word_embeddings
        self.options = options
        self._sampling_params_cls = sampling_params_cls
        self._asleep: set[str] = set()  # vLLM memory tags currently released
        self._broken: str | None = None  # set when a weight sync timed out
        self.model_dtype = _engine_dtype(llm)

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: list[str], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` completions per prompt (groups contiguous)."""
        self._check_usable()
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        kwargs = to_vllm_sampling_kwargs(params)
        G = params.n
        self.wake_up()
        ids = self.tokenizer(list(prompts))["input_ids"]  # HFEngine's tokenization, unpadded
        requests = [{"prompt_token_ids": list(map(int, p))} for p in ids]
        if kwargs["n"] != G:  # greedy: vLLM allows n = 1 only, so send each prompt G times
            requests = [r for r in requests for _ in range(G)]
        outputs = self.llm.generate(
            requests, self._sampling_params_cls(**kwargs), use_tqdm=False
        )
        return outputs_to_rollout_batch(
            outputs, self.tokenizer, prompts, G, self.pad_id, self.eos_id, self.stop_ids
        )

    # -------------------------------------------------------------- weight sync
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors into the running vLLM model, in place.

        Floating tensors are cast to the engine's dtype; DTensors are gathered. Raises
        ``WeightSyncTimeout`` if a worker does not answer within ``weight_sync_timeout``
        seconds, ``WeightSyncError`` if (with ``strict_weight_sync``) some parameter was not
        written, and vLLM's own error for an unknown name or a shape mismatch. After an error
        the engine may hold a mix of old and new weights: push the full set again.
        """
        self._check_usable()
        if "weights" in self._asleep:
            self._wake(["weights"])
        timeout = self.options.weight_sync_timeout
        self._rpc("rldsl_begin_weight_update", timeout, "starting a weight update")
        mapped = to_vllm_weight_names(named_tensors, tie_word_embeddings=self.tie_word_embeddings)
        cast = ((n, materialize(t, self.model_dtype)) for n, t in mapped)
        sent = 0
        for i, bucket in enumerate(bucket_by_bytes(cast, self.options.weight_bucket_bytes)):
            payload = pack_bucket(bucket)
            self._rpc(
                "rldsl_load_weights", timeout,
                f"loading weight bucket {i} ({len(bucket)} tensors, {len(payload) / 2**20:.1f} MiB, "
                f"first {bucket[0][0]!r})",
                payload,
            )
            sent += len(bucket)
        if sent == 0:
            raise WeightSyncError("update_weights got no tensors to load")
        missing = self._rpc("rldsl_finish_weight_update", timeout, "finishing a weight update")
        unwritten = sorted({n for per_worker in missing if per_worker for n in per_worker})
        if unwritten and self.options.strict_weight_sync:
            raise WeightSyncError(
                f"update_weights left {len(unwritten)} vLLM parameters unwritten, e.g. "
                f"{unwritten[:5]}: the trainer's state dict is missing them (or names do not "
                "map); pass strict_weight_sync=False to allow partial updates"
            )
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def param_checksums(self, names: list[str] | None = None) -> dict[str, float]:
        """{vLLM parameter name: sum of values} on the first worker (its tensor-parallel
        shard); a probe for smoke tests. Names are vLLM's (e.g. fused ``qkv_proj``)."""
        self._check_usable()
        if "weights" in self._asleep:
            self._wake(["weights"])
        return self._rpc("rldsl_param_checksums", self.options.weight_sync_timeout,
                         "reading parameter checksums", names)[0]

    # ----------------------------------------------------------- colocated mode
    def sleep(self, level: int | None = None) -> None:
        """Release vLLM's GPU memory (weights and KV cache) for the trainer."""
        self._check_usable()
        if not self.options.enable_sleep_mode:
            raise RuntimeError("sleep() needs VLLMEngine(enable_sleep_mode=True)")
        if self._asleep:
            return
        self.llm.sleep(level=self.options.sleep_level if level is None else level)
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Restore whatever ``sleep()`` released (a no-op when awake)."""
        if self._asleep:
            self._check_usable()
            self._wake(sorted(self._asleep))

    @property
    def is_sleeping(self) -> bool:
        """True while some of vLLM's GPU memory (weights or KV cache) is released."""
        return bool(self._asleep)

    def close(self) -> None:
        """Drop the vLLM engine (its GPU memory is freed once it is collected)."""
        self.llm = None
        gc.collect()

    # ------------------------------------------------------------------ helpers
    def _wake(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)
        self._asleep -= set(tags)

    def _rpc(self, method: str, timeout: float | None, what: str, *args: Any) -> list[Any]:
        try:
            return call_with_timeout(
                lambda: self.llm.collective_rpc(method, timeout=timeout, args=args), timeout, what
            )
        except WeightSyncTimeout as e:
            self._broken = str(e)
            raise
        except TimeoutError as e:  # vLLM's executor gave up waiting for its workers
            self._broken = f"vLLM timed out {what}: {e}"
            raise WeightSyncTimeout(self._broken) from e

    def _check_usable(self) -> None:
        if self.llm is None:
            raise RuntimeError("this VLLMEngine was closed")
        if self._broken is not None:
            raise WeightSyncError(f"this VLLMEngine is unusable after an earlier error: {self._broken}")


def _engine_dtype(llm: Any) -> torch.dtype | None:
    """The dtype vLLM runs the model in (``llm.llm_engine.model_config.dtype``), if known."""
    dtype = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _generation_config_eos_ids(model: str) -> set[int]:
    """EOS ids of ``generation_config.json`` (vLLM stops on them as well), if any."""
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except Exception:  # no generation_config.json: vLLM adds nothing either
        return set()
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
