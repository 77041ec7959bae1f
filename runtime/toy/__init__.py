"""The embedded default of ``rldsl run``: a character tokenizer, a 0.59M-parameter Llama
(model.py), 2-digit addition (task.py) and a cached warm start (warmup.py); docs/toy.md."""
from .model import CHARACTERS, SPECIAL_TOKENS, VLLM_VARIANT, build_tokenizer, tiny_config, vllm_variant_config
from .task import AdditionTask, carry_free_sum, teacher_answer
from ...cache import cache_dir
from .warmup import (WARM_START_VERSION, WarmStartConfig, evaluate_greedy, greedy_answers,
                     load_warm_start, warm_start, warm_start_key)

__all__ = ["AdditionTask", "CHARACTERS", "SPECIAL_TOKENS", "WARM_START_VERSION", "WarmStartConfig",
           "build_tokenizer", "cache_dir", "carry_free_sum", "evaluate_greedy", "greedy_answers",
           "load_warm_start", "teacher_answer", "tiny_config", "VLLM_VARIANT", "vllm_variant_config", "warm_start",
           "warm_start_key"]
