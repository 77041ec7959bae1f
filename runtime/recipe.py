"""The run recipe: how the policy and the rollout side (engine, reward, episodes) are built from
a resolved config (the reward: ``resolve.reward_fn``; the episodes beside the engine:
``rollout/multi_turn.episode_runner``) -- one function each, used by a one-process run
(run/build.py, workers/start.py), a trainer rank (workers/fsdp_rank.py), a rollout actor
(workers/rollout_actor.py) and ``rldsl eval`` (run/eval_command.py) alike.

The trainer itself is ``Trainer.from_config`` (train/trainer.py; ``ShardedTrainer`` on a rank).
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .config import RunConfig
from .resolve import reward_fn
from .rewards.functions import RewardFn
from .rollout.engines.base import RolloutEngine
from .rollout.multi_turn import episode_runner
from .models.lora import adapters_disabled, apply_lora
from .models.loading import (enable_gradient_checkpointing, freeze_vision, load_policy, load_tokenizer, master_dtype,
                             model_context)


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
    ``checkpointing``; a vision-language policy's vision tower frozen (``model.freeze_vision``)."""
    if cfg.model.freeze_vision:  # a vision-language policy's vision tower (nothing for a text model)
        freeze_vision(policy)
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
                                  tensor_parallel_size=max(1, int(gpus)),
                                  tokenizer=load_tokenizer(Path(path)))  # a pad-less family's reserved pad
    return hf_engine(cfg, path, device, model=model, tokenizer=tokenizer)


def hf_engine(cfg: RunConfig, path: Path | str, device: str, *, model: nn.Module | None = None,
              tokenizer: Any = None) -> RolloutEngine:
    """The HF engine of ``rollout.engine = "hf"``, and of a reference model whatever the policy's
    engine (it is never synced, so it needs no vLLM): ``model`` (loaded from ``path`` when None)
    in ``model.dtype`` on ``device``."""
    from .rollout.engines.hf import HFEngine
    if model is None:
        model = load_policy(Path(path), cfg.model.dtype)
    model = model.to(getattr(torch, cfg.model.dtype)).eval()
    return HFEngine(model, tokenizer if tokenizer is not None else load_tokenizer(Path(path)), device=device,
                    compile=cfg.model.compile)


def rollout_side(cfg: RunConfig, path: Path | str, device: str, *, reward: RewardFn | None = None,
                 model: nn.Module | None = None, tokenizer: Any = None,
                 gpus: float = 0.0) -> tuple[RolloutEngine, RewardFn, Any]:
    """(engine, reward, episode runner) of the rollout side: :func:`rollout_engine`, ``reward``
    (else ``resolve.reward_fn``: the config's), and ``rollout/multi_turn.episode_runner`` (None:
    single-turn completions). ``workers/local.LocalRollouts.from_config`` holds them."""
    engine = rollout_engine(cfg, path, device, model=model, tokenizer=tokenizer, gpus=gpus)
    return (engine, reward if reward is not None else reward_fn(cfg),
            episode_runner(cfg, path, model_context(Path(path))))
