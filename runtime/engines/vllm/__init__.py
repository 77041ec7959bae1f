"""The vLLM rollout engine: engine.py (``VLLMEngine``), convert.py (sampling parameters and
results), weights.py and worker.py (the two sides of weight sync)."""
from .convert import outputs_to_rollout_batch, to_vllm_sampling_kwargs
from .engine import INSTALL_HINT, SUPPORTED_VLLM, WORKER_EXTENSION, EngineOptions, VLLMEngine, import_vllm
from .weights import (NOT_LOADED_SUFFIXES, WRAPPER_COMPONENTS, bucket_by_bytes, call_with_timeout,
                      hf_weight_name, materialize, pack_bucket, tensor_bytes, to_vllm_weight_names,
                      unpack_bucket)
from .worker import RldslWorkerExtension

__all__ = ["EngineOptions", "INSTALL_HINT", "NOT_LOADED_SUFFIXES", "RldslWorkerExtension",
           "SUPPORTED_VLLM", "VLLMEngine", "WORKER_EXTENSION", "WRAPPER_COMPONENTS", "bucket_by_bytes",
           "call_with_timeout", "hf_weight_name", "import_vllm", "materialize", "outputs_to_rollout_batch",
           "pack_bucket", "tensor_bytes", "to_vllm_sampling_kwargs", "to_vllm_weight_names",
           "unpack_bucket"]
