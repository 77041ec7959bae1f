"""``VLLMEngine``: the GPU rollout engine, built on vLLM's offline ``LLM`` class.

Prompts are tokenized here with the model's HF tokenizer, as the transformers engine does,
and handed to vLLM as token ids; results go through convert.py, weights through weights.py
to worker.py. ``sleep()`` / ``wake_up()`` release and restore vLLM's GPU memory for a
colocated trainer. vLLM is imported lazily, so this module loads (and its tests run)
without it. Supported releases, what the logprobs mean and the sources read:
docs/runtime.md, "The vLLM engine".
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable

import torch

from ...batch import RolloutBatch, repeat_each
from ...errors import VLLMUnavailableError, WeightSyncError, WeightSyncTimeout
from ..base import SamplingParams, check_request, generation_config_eos_ids, special_token_ids
from .convert import outputs_to_rollout_batch, to_vllm_sampling_kwargs
from .weights import bucket_by_bytes, call_with_timeout, materialize, pack_bucket, to_vllm_weight_names

#: Qualified name handed to vLLM as ``worker_extension_cls``.
WORKER_EXTENSION = "rldsl.runtime.engines.vllm.worker.RldslWorkerExtension"

#: The vLLM releases this engine was checked against (docs/runtime.md).
SUPPORTED_VLLM = ">=0.11,<0.34"

INSTALL_HINT = (
    "VLLMEngine needs vLLM, which is not installed. Install it with "
    "`pip install 'rldsl[vllm]'` on a machine with an NVIDIA GPU (CUDA): vLLM has no "
    "CPU wheel here. On CPU use the 'hf' rollout engine (rollout.engine = \"hf\")."
)


def import_vllm() -> Any:
    """Import vLLM, or raise ``VLLMUnavailableError`` with install instructions."""
    try:
        import vllm
    except ImportError as e:  # not installed, or a broken / CUDA-less build
        raise VLLMUnavailableError(f"{INSTALL_HINT} (import error: {e})") from e
    return vllm


@dataclass
class EngineOptions:
    """The engine's own settings (the rest are vLLM's)."""

    enable_sleep_mode: bool
    sleep_level: int
    weight_bucket_bytes: int
    weight_sync_timeout: float | None
    strict_weight_sync: bool


class VLLMEngine:
    """A ``RolloutEngine`` on vLLM (GPU), with the layout of engines/base.py (convert.py).

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
            stop_ids=generation_config_eos_ids(model),
            options=EngineOptions(
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
        options: EngineOptions,
    ) -> None:
        """Wire an existing ``vllm.LLM`` (built with our worker extension) to this engine."""
        self.pad_id, self.eos_id = special_token_ids(tokenizer, "VLLMEngine")
        self.llm = llm
        self.tokenizer = tokenizer
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
        check_request(prompts, params)
        kwargs = to_vllm_sampling_kwargs(params)
        G = params.n
        self.wake_up()
        ids = self.tokenizer(list(prompts))["input_ids"]  # HFEngine's tokenization, unpadded
        requests = [{"prompt_token_ids": list(map(int, p))} for p in ids]
        if kwargs["n"] != G:  # greedy: vLLM allows n = 1 only, so send each prompt G times
            requests = repeat_each(requests, G)
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


