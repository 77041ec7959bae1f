"""Starting the two sides a step talks to, in this process or on Ray actors: one factory for
``rldsl run`` (run/build.py), so building a run names no worker kind.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import rldsl
from rldsl.inputs import INPUTS

from ..config import POLICY_BASE, RunConfig
from ..recipe import hf_engine, master_policy
from ..rewards.functions import RewardFn
from ..rollout.episodes.tools import SHARED_TOOL_POOL
from .base import Rollouts, Trainers
from .local import LocalRollouts
from .local_trainers import LocalTrainers


def start_workers(cfg: RunConfig, algo: rldsl.Algorithm, fn: rldsl.CompiledAlgorithm, model_path: Path,
                  tokenizer: Any, reward: RewardFn, run_dir: Path) -> tuple[Rollouts, Trainers]:
    """(rollouts, trainers) of a resolved config, every model loaded; the tools of this process's
    episodes never see the run folder ``run_dir``.

    With ``distributed.trainers > 1``, rollout actors or a Ray address, the engines and the
    trainer ranks are Ray actors (workers/ray.py; each rollout actor builds its own reward
    from the config); otherwise everything lives in this process and Ray is never imported.
    """
    if cfg.rollout.tools is not None or cfg.rollout.env is not None:
        SHARED_TOOL_POOL.hide(run_dir)
    if cfg.distributed.uses_ray:
        from .ray import start_ray_workers  # Ray is imported only by the runs that use it
        return start_ray_workers(cfg, algo, fn, model_path, tokenizer.pad_token_id)
    policy = master_policy(cfg, model_path, cfg.device)
    engine_model = copy.deepcopy(policy)  # before LoRA: the engine samples from plain weights
    trainers = LocalTrainers.from_config(cfg, fn, policy, tokenizer=tokenizer)
    rollouts = LocalRollouts.from_config(cfg, model_path, cfg.device, reward=reward, model=engine_model,
                                         tokenizer=tokenizer)
    return rollouts, trainers


def reference_rollouts(cfg: RunConfig, algo: rldsl.Algorithm, model_path: Path, reward: RewardFn) -> Rollouts | None:
    """The reference model's rollouts of a spec that reads its reward (``ref_reward``): an HF engine
    of ``reward.reference`` -- ``policy_base``: the folder the policy starts from (its weights as
    loaded: with LoRA, the base the adapters are added to), else that model folder -- and the run's
    reward, in this process (resolve.check_reference refused the rest); None for any other spec.
    The HF engine whatever ``rollout.engine``: the reference is never synced, and a second vLLM
    engine costs its build and a KV cache of its own for a batch of P x reference_samples
    (docs/formulas.md, "The reference model's reward": bench/reference_engine.py)."""
    if cfg.reward.reference is None or not any(INPUTS[x].source == "reference_rollout"
                                               for x in algo.needs()):
        return None
    path = model_path if cfg.reward.reference == POLICY_BASE else Path(cfg.reward.reference)
    return LocalRollouts(hf_engine(cfg, path, cfg.device), reward)
