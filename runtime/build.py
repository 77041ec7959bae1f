"""Building a run: the spec, the model folder, prompts, reward, and the two sides a step
talks to -- in this process, or on Ray actors when the config asks for them."""
from __future__ import annotations

import copy
import warnings
from functools import partial
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import rldsl

from .config import ConfigError, RunConfig
from .data import Example, PromptSource, load_examples, render_prompt, split_heldout
from .engines.hf import HFEngine
from .errors import RunError
from .lora import adapters_disabled, apply_lora
from .models import (disable_transformers_progress, enable_gradient_checkpointing, load_policy,
                     load_tokenizer, master_dtype)
from .rewards import RewardFn
from .rng import seed_all
from .train.trainer import Trainer
from .workers.base import Rollouts, Trainers
from .workers.local import LocalRollouts, LocalTrainers


@dataclass
class Run:
    """Everything one training run is made of; built by :func:`build_run`.

    The step talks to ``rollouts`` and ``trainers`` only (workers/base.py): in process
    (``LocalRollouts`` / ``LocalTrainers``) or on Ray actors (``RayRollouts`` / ``RayTrainers``).
    ``tokenizer`` (the driver's copy) is saved with every checkpoint.
    """

    cfg: RunConfig
    algo: rldsl.Algorithm
    fn: rldsl.CompiledAlgorithm
    run_dir: Path
    tokenizer: Any
    source: PromptSource
    heldout: list[Example]
    rollouts: Rollouts
    trainers: Trainers
    warn: Callable[[str], None] = print

    def close(self) -> None:
        """Stop the actors of a distributed run (nothing to do for a one-process run)."""
        self.rollouts.close()
        self.trainers.close()


def model_folder(cfg: RunConfig) -> tuple[Path, str]:
    """(the policy's HF folder, a label for messages); the embedded toy model is warm-started
    on first use and read from its cache afterwards."""
    if cfg.model.path is None:
        from .toy import vllm_variant_config, warm_start
        if cfg.rollout.engine == "vllm":  # vLLM's CPU attention refuses the toy's head dim 24
            return (Path(warm_start(model_config=vllm_variant_config(), verbose=True)),
                    "embedded toy model, head-dim-32 variant for vLLM (warm-started)")
        return Path(warm_start(verbose=True)), "embedded toy model (warm-started)"
    path = Path(cfg.model.path)
    if not path.exists():
        raise RunError(f"model folder not found: {path}")
    if not (path / "config.json").is_file():
        raise RunError(f"{path} is not a Hugging Face model folder (no config.json)")
    return path, str(path)


def heldout_size(cfg: RunConfig, rows: int) -> tuple[int, str | None]:
    """(held-out rows to split off a data file of ``rows`` rows, a line for the log or None).

    ``data.eval_size`` when set (an error if it leaves nothing to train on), else one tenth
    of the rows, at most 200, none below 10 rows: a small dataset starts without flags.
    """
    if cfg.data.eval_size is not None:
        if cfg.data.eval_size >= rows:
            raise RunError(f"data.eval_size={cfg.data.eval_size} holds out every one of the {rows} "
                           "rows: lower it (or set data.eval_path, or 0 for no evaluation)")
        return cfg.data.eval_size, None
    k = min(200, rows // 10)
    if k == 0:
        return 0, f"{rows} rows: no held-out split (set data.eval_path or data.eval_size to evaluate)"
    return k, f"held out {k} of {rows} rows for evaluation (data.eval_size to change)"


def prompts_of(cfg: RunConfig, tokenizer: Any = None,
               warn: Callable[[str], None] | None = None) -> tuple[PromptSource, list[Example]]:
    """(training prompts, held-out prompts): the data file, or the built-in addition task.

    Data-file prompts are rendered for the model (``data.render_prompt``: chat template,
    system prompt) when a tokenizer is given.
    """
    if cfg.data.path is None:
        from .toy import AdditionTask
        task = AdditionTask()
        size = 200 if cfg.data.eval_size is None else cfg.data.eval_size
        held = task.heldout_examples()[:size] if size else []
        return task.prompt_source(cfg.seed), held
    examples = load_examples(cfg.data.path, prompt_field=cfg.data.prompt_key,
                             answer_field=cfg.data.answer_key)
    if cfg.data.eval_path:
        train, held = examples, load_examples(cfg.data.eval_path, prompt_field=cfg.data.prompt_key,
                                              answer_field=cfg.data.answer_key)
    else:
        k, note = heldout_size(cfg, len(examples))
        if note and warn is not None:
            warn(note)
        train, held = split_heldout(examples, k, seed=cfg.seed)
    if tokenizer is not None:
        d = cfg.data
        render = partial(render_prompt, tokenizer=tokenizer, mode=d.chat_template,
                         kwargs=d.chat_template_kwargs, system_prompt=d.system_prompt)
        train, held = [render(e) for e in train], [render(e) for e in held]
    return PromptSource(train, seed=cfg.seed, name=Path(cfg.data.path).name), held


def model_context(path: Path) -> int | None:
    """The number of positions the model at ``path`` can attend over (``max_position_embeddings``,
    GPT-2's ``n_positions``), or None when its config names none."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def fit_context(cfg: RunConfig, path: Path, tokenizer: Any, prompts: list[str]) -> None:
    """Clip ``rollout.max_new_tokens`` so that the longest prompt plus the completion fits the
    model's context (one warning), or refuse a prompt that does not fit at all, before the
    first step: past the last position a model's forward fails mid-step (an ``IndexError``
    in its position embedding) or silently extrapolates."""
    context = model_context(path)
    if context is None or not prompts:
        return
    longest = max(len(ids) for ids in tokenizer(prompts)["input_ids"])
    if longest >= context:
        raise ConfigError(f"the longest prompt has {longest} tokens but the model ({path}) has a "
                          f"context of {context} positions (max_position_embeddings): no room for "
                          f"even one new token (max_new_tokens). Shorten or drop the long prompts.")
    room = context - longest
    if cfg.max_new_tokens > room:
        warnings.warn(f"max_new_tokens {cfg.max_new_tokens} + the longest prompt ({longest} tokens) "
                      f"exceeds the model's context of {context} positions: generating at most "
                      f"{room} new tokens (set rollout.max_new_tokens to silence this)", stacklevel=2)
        cfg.rollout.max_new_tokens = room


def reward_name(cfg: RunConfig) -> str:
    """``reward.name``, else the task's own: ``addition`` for the built-in task, ``exact`` for data."""
    return cfg.reward.name or ("addition" if cfg.data.path is None else "exact")


def build_run(spec: str, cfg: RunConfig, run_dir: Path, spec_text: str | None = None) -> Run:
    """Load the spec, model(s), prompts, reward, engine(s) and trainer(s) of a run.

    With ``distributed.trainers > 1``, rollout actors or a Ray address, the engines and the
    trainer ranks are Ray actors (workers/ray.py); otherwise everything lives in this process
    and Ray is never imported.
    """
    disable_transformers_progress()  # the bars would break the run's own progress display
    algo = rldsl.loads(spec_text, spec) if spec_text is not None else rldsl.load(spec)
    torch.set_num_threads(cfg.threads)
    seed_all(cfg.seed)
    fn = rldsl.compile(algo)
    if cfg.distributed.uses_ray:
        path, _ = model_folder(cfg)  # the toy model is warm-started here, once
        tok = load_tokenizer(path)
        source, held = prompts_of(cfg, tok, print)
        fit_context(cfg, path, tok, [e.prompt for e in source.examples + held])
        reward = reward_name(cfg)
        RewardFn(reward, on_error=cfg.reward.on_error)  # a bad name fails here, not in an actor
        from .workers.ray import start_ray_workers
        rollouts, trainers = start_ray_workers(cfg, algo, fn, path, reward, tok.pad_token_id)
        return Run(cfg, algo, fn, run_dir, tok, source, held, rollouts, trainers)
    path, _ = model_folder(cfg)
    policy = load_policy(path, master_dtype(cfg.model.dtype))
    tok = load_tokenizer(path)
    source, held = prompts_of(cfg, tok, print)
    fit_context(cfg, path, tok, [e.prompt for e in source.examples + held])
    policy.to(cfg.device)
    if cfg.rollout.engine == "vllm":  # its own process(es), loading the folder; synced in place
        from .engines.vllm import engine_from_config
        engine: Any = engine_from_config(cfg, path, on_gpu=cfg.device == "cuda")
    else:
        engine = HFEngine(copy.deepcopy(policy).to(getattr(torch, cfg.model.dtype)).eval(), tok,
                          device=cfg.device)
    reference_off = None
    if cfg.model.lora.rank:
        lo = cfg.model.lora
        policy, wrapped = apply_lora(policy, rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout,
                                     target_modules=lo.target_modules)
        reference_off = partial(adapters_disabled, wrapped)  # no second copy for the KL
    if cfg.train.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    trainer = Trainer.from_config(cfg, fn, policy, reference_off=reference_off)
    rollouts = LocalRollouts(engine, RewardFn(reward_name(cfg), on_error=cfg.reward.on_error))
    return Run(cfg, algo, fn, run_dir, tok, source, held, rollouts, LocalTrainers(trainer))
