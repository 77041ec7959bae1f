"""The run recipe: how the policy, the rollout engine and the reward are built from a resolved
config -- one function each, used by a one-process run (build.py), a trainer rank
(workers/fsdp.py) and a rollout actor (workers/ray.py) alike.

The trainer itself is ``Trainer.from_config`` (train/trainer.py; ``ShardedTrainer`` on a rank).
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .config import RunConfig, env_library
from .rollout.engines.base import RolloutEngine
from .models.lora import adapters_disabled, apply_lora
from .models.loading import enable_gradient_checkpointing, load_policy, load_tokenizer, master_dtype, model_context
from .rewards.functions import RewardFn
from .resolve import reward_spec
from .rollout.agents.environments import agent_runner, verifiers_examples
from .rollout.episodes.rollout import EpisodeRunner
from .rollout.episodes.tools import SHARED_RUNNER


def with_lora(cfg: RunConfig, policy: nn.Module) -> tuple[nn.Module, Any]:
    """(``policy`` with the run's LoRA adapters, the peft wrapper); unchanged (and None) when
    ``model.lora.rank`` is 0. Works on the meta device too (the names of a gathered state)."""
    lo = cfg.model.lora
    if not lo.rank:
        return policy, None
    return apply_lora(policy, rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout,
                      target_modules=lo.target_modules)


def master_policy(cfg: RunConfig, path: Path | str, device: torch.device | str) -> nn.Module:
    """The policy of ``path`` with float32 master weights for a 16-bit ``model.dtype``
    (``master_dtype``), on ``device``: what a trainer trains (and what the HF engine copies)."""
    return load_policy(Path(path), master_dtype(cfg.model.dtype)).to(device)


def trainable(cfg: RunConfig, policy: nn.Module, *,
              checkpointing: bool) -> tuple[nn.Module, Callable[[], Any] | None]:
    """(the policy to train, ``reference_off`` or None): LoRA adapters added when the config asks
    (the base is frozen; the reference is the policy with its adapters off, ``reference_off()``:
    no second copy), and the blocks' activations recomputed in the backward pass when
    ``checkpointing``."""
    policy, wrapped = with_lora(cfg, policy)
    reference_off = partial(adapters_disabled, wrapped) if wrapped is not None else None
    if checkpointing:
        enable_gradient_checkpointing(policy)
    return policy, reference_off


def rollout_engine(cfg: RunConfig, path: Path | str, device: str, *, model: nn.Module | None = None,
                   tokenizer: Any = None, gpus: float = 0.0) -> RolloutEngine:
    """The engine of ``rollout.engine``: ``hf`` samples with ``model`` (a copy of the policy; loaded
    from ``path`` when None) in ``model.dtype`` on ``device``; ``vllm`` loads ``path`` itself on
    ``gpus`` GPUs (tensor parallel)."""
    if cfg.rollout.engine == "vllm":  # its own process(es), loading the folder; synced in place
        from .rollout.engines.vllm import engine_from_config
        return engine_from_config(cfg, path, on_gpu=device == "cuda" or gpus > 0,
                                  tensor_parallel_size=max(1, int(gpus)))
    from .rollout.engines.hf import HFEngine
    if model is None:
        model = load_policy(Path(path), cfg.model.dtype)
    model = model.to(getattr(torch, cfg.model.dtype)).eval()
    return HFEngine(model, tokenizer if tokenizer is not None else load_tokenizer(Path(path)), device=device)


def reward_fn(cfg: RunConfig) -> RewardFn:
    """The run's reward, ``reward.name`` (settled by ``resolve.settle_reward`` when the task's own),
    with ``reward.answer_format`` given to its ``reasoning_gym`` terms."""
    if cfg.reward.name is None:
        raise ValueError("reward.name is unset: settle_reward(cfg) fills in the task's own first")
    return RewardFn(reward_spec(cfg), on_error=cfg.reward.on_error, workers=cfg.reward.workers)


def environment_rows(cfg: RunConfig) -> list[Any] | None:
    """The rows an environment brings with it: a verifiers taskset's tasks (``rollout.env =
    verifiers:...``, ``data.path`` unset), else None (the rows are the data's)."""
    if cfg.data.path is None and env_library(cfg.rollout.env) == "verifiers":
        return verifiers_examples(cfg.rollout.env)
    return None


def episode_runner(cfg: RunConfig, model_path: str | Path) -> Any:
    """The multi-turn episodes of a run: an ``AgentRunner`` with ``rollout.agent``, an
    ``EpisodeRunner`` with ``rollout.tools`` or ``rollout.env``, else None (single-turn
    completions). Both have ``run(engine, prompts, answers, params) -> RolloutBatch``."""
    r = cfg.rollout
    runner = agent_runner(cfg, model_path, model_context(Path(model_path)))  # the endpoint's episodes
    if runner is not None:
        return runner
    if r.tools is None and r.env is None:
        return None
    SHARED_RUNNER.resize(r.tool_workers)  # this process's tool pool
    return EpisodeRunner.from_config(cfg, context=model_context(Path(model_path)))
