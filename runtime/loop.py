"""``rldsl run``: one training run on one machine, from spec to checkpoints.

One step, data flowing one way::

    prompts -> engine.generate (G per prompt) -> reward -> [dynamic sampling rounds]
            -> trainer.score (old/ref logprobs, the spec's shaping, filters, advantages)
            -> trainer.update (minibatches, compiled loss) -> weight sync -> metrics, checkpoint

Exact resume: the sampling seed of every step is derived from (seed, step, round), so a
resumed run draws what the uninterrupted run drew; the data position, optimizer,
scheduler, RNG states and the algorithm's own state are restored from the checkpoint.
"""
from __future__ import annotations

import copy
import hashlib
import math
import os
import random
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

import rldsl
from rldsl.errors import SpecError

from . import checkpoint as ckpt
from .config import ConfigError, RunConfig, build_optimizer, build_scheduler, load_run_config, save_config, SPEC_FILE
from .data import Example, PromptSource, load_data
from .engine import HFEngine
from .groups import LocalRolloutGroup, LocalTrainerGroup, WorkerError
from .metrics import MetricsLogger
from .rewards import RewardFn
from .trainer import Trainer, TrainBatch, ValueModel
from .types import RolloutBatch, SamplingParams


class RunError(ConfigError):
    """A problem with the run's inputs, worded for the user (exit code 2, no traceback)."""


@dataclass
class Setup:
    """Everything a run is made of (built by :func:`build`).

    The step talks to ``rollouts`` and ``trainers`` (groups.py): by default they wrap this
    Setup's engine, reward and trainer; the distributed runtime sets Ray groups instead and
    leaves ``policy``, ``engine`` and ``trainer`` None (they live in the actors).
    """

    cfg: RunConfig
    algo: rldsl.Algorithm
    fn: rldsl.CompiledAlgorithm
    run_dir: Path
    policy: torch.nn.Module
    tokenizer: Any
    engine: HFEngine
    trainer: Trainer
    source: PromptSource
    heldout: list[Example]
    reward: RewardFn
    warn: Any = print
    rollouts: Any = None  # groups.LocalRolloutGroup or distributed.RayRolloutGroup
    trainers: Any = None  # groups.LocalTrainerGroup or distributed.RayTrainerGroup

    def __post_init__(self) -> None:
        if self.rollouts is None:
            self.rollouts = LocalRolloutGroup(self)
        if self.trainers is None:
            self.trainers = LocalTrainerGroup(self)

    def close(self) -> None:
        """Stop the actors of a distributed run (nothing to do for a one-process run)."""
        self.rollouts.close()
        self.trainers.close()


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int, round_: int = 0, what: str = "rollout") -> int:
    """A sampling seed fixed by (run seed, step, round): resumed runs draw the same samples."""
    h = hashlib.sha256(f"{seed}:{step}:{round_}:{what}".encode()).digest()
    return int.from_bytes(h[:4], "little")


# ----------------------------------------------------------------------------- building

def _model_path(cfg: RunConfig) -> tuple[Path, str]:
    """The policy's HF folder (the embedded toy model is warm-started, or read from its cache)."""
    if cfg.model.path is None:
        from .toy import warm_start
        return Path(warm_start(verbose=True)), "embedded toy model (warm-started)"
    path = Path(cfg.model.path)
    if not path.exists():
        raise RunError(f"model folder not found: {path}")
    if not (path / "config.json").is_file():
        raise RunError(f"{path} is not a Hugging Face model folder (no config.json)")
    return path, str(path)


def _load_model(cfg: RunConfig) -> tuple[torch.nn.Module, Any, str]:
    """The policy and tokenizer: a local HF folder, or the embedded warm-started toy model."""
    from transformers import AutoModelForCausalLM
    path, label = _model_path(cfg)
    dtype = getattr(torch, cfg.model.dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError) as e:
        raise RunError(f"could not load the model from {path}: {e}") from None
    tok = _load_tokenizer(path)
    model.config.use_cache = True
    return model, tok, label


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise RunError(f"could not load the model from {path}: {e}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _load_data(cfg: RunConfig) -> tuple[PromptSource, list[Example]]:
    if cfg.data.path is None:
        from .toy import AdditionTask
        task = AdditionTask()
        held = task.heldout_examples()[: cfg.data.eval_size] if cfg.data.eval_size else []
        return task.prompt_source(cfg.seed), held
    data = load_data(cfg.data.path, prompt_field=cfg.data.prompt_key, answer_field=cfg.data.answer_key,
                     heldout_path=cfg.data.eval_path,
                     heldout=0 if cfg.data.eval_path else cfg.data.eval_size, seed=cfg.seed)
    return PromptSource(data.train, seed=cfg.seed, name=Path(cfg.data.path).name), data.heldout


def build_trainer(cfg: RunConfig, algo: rldsl.Algorithm, fn: rldsl.CompiledAlgorithm,
                  policy: torch.nn.Module, *, prepare: Any = None, trainer_cls: type = Trainer,
                  **trainer_kwargs: Any) -> Trainer:
    """The trainer of ``policy``: reference and critic copies, optimizers, LR schedule.

    ``prepare(policy, reference, critic)``, if given, runs after the copies are made and
    before the optimizers are built (the distributed runtime shards the modules there).
    """
    reference = None
    if algo.uses_reference:
        reference = copy.deepcopy(policy).eval()
        for p in reference.parameters():
            p.requires_grad_(False)
    critic = critic_opt = None
    if algo.uses_critic:
        critic = ValueModel(policy).to(cfg.device)
    if prepare is not None:
        prepare(policy, reference, critic)
    if critic is not None:
        critic_opt = build_optimizer(critic.parameters(), cfg.train, lr=cfg.train.critic_lr or cfg.train.lr)
    optimizer = build_optimizer(policy.parameters(), cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train)
    return trainer_cls(fn, policy, optimizer=optimizer, scheduler=scheduler, reference=reference,
                       critic=critic, critic_optimizer=critic_opt, ppo_epochs=cfg.train.ppo_epochs,
                       minibatches=cfg.train.minibatches, grad_clip=cfg.train.grad_clip,
                       skip_zero_advantage=cfg.train.skip_zero_advantage, **trainer_kwargs)


def build(spec: str, cfg: RunConfig, run_dir: Path, spec_text: str | None = None) -> Setup:
    """Load the spec, the model(s), data, reward, engine and trainer for a run.

    With ``distributed.trainers > 1``, rollout actors or a Ray address, the engine(s) and
    trainer ranks are Ray actors instead (:func:`rldsl.runtime.distributed.build_distributed`).
    """
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # they would break the run's own progress display
    try:
        algo = rldsl.loads(spec_text, spec) if spec_text is not None else rldsl.load(spec)
    except SpecError:
        raise
    torch.set_num_threads(cfg.threads)
    _seed_all(cfg.seed)
    fn = rldsl.compile(algo)
    if cfg.distributed.uses_ray:
        from .distributed import build_distributed
        return build_distributed(algo, fn, cfg, run_dir)
    policy, tok, _ = _load_model(cfg)
    policy.to(cfg.device)
    if cfg.rollout.engine != "hf":
        raise RunError(f"rollout.engine={cfg.rollout.engine!r} needs the distributed runtime "
                       "(Ray actors on GPUs): add --rollout-workers 1 (or more); on one "
                       "machine without Ray use rollout.engine=hf")
    trainer = build_trainer(cfg, algo, fn, policy)
    engine_model = copy.deepcopy(policy).eval()
    engine = HFEngine(engine_model, tok, device=cfg.device)
    source, held = _load_data(cfg)
    reward = RewardFn(_reward_name(cfg), on_error=cfg.reward.on_error)
    return Setup(cfg, algo, fn, run_dir, policy, tok, engine, trainer, source, held, reward)


def _reward_name(cfg: RunConfig) -> str:
    return cfg.reward.name or ("addition" if cfg.data.path is None else "exact")


# ----------------------------------------------------------------------------- one step

def _concat(batches: list[RolloutBatch], pad: int) -> RolloutBatch:
    """Stack rollouts of the same G (pads prompts on the left and responses on the right)."""
    if len(batches) == 1:
        return batches[0]
    Tp = max(b.prompt_ids.shape[1] for b in batches)
    Tr = max(b.response_ids.shape[1] for b in batches)

    def left(t: torch.Tensor, n: int, v: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (n - t.shape[1], 0), value=v)

    def right(t: torch.Tensor, n: int, v: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, n - t.shape[1]), value=v)

    return RolloutBatch(
        prompt_ids=torch.cat([left(b.prompt_ids, Tp, pad) for b in batches]),
        prompt_mask=torch.cat([left(b.prompt_mask, Tp, 0) for b in batches]),
        response_ids=torch.cat([right(b.response_ids, Tr, pad) for b in batches]),
        response_mask=torch.cat([right(b.response_mask, Tr, 0) for b in batches]),
        logprobs=torch.cat([right(b.logprobs, Tr, 0.0) for b in batches]),
        finish_reason=sum((b.finish_reason for b in batches), []),
        prompts=sum((b.prompts for b in batches), []),
        completions=sum((b.completions for b in batches), []),
        group_size=batches[0].group_size,
        answers=sum((b.answers for b in batches), []),
    )


def _select_groups(batch: RolloutBatch, rewards: torch.Tensor, ids: list[int],
                   groups: list[int]) -> tuple[RolloutBatch, torch.Tensor, list[int]]:
    G = batch.group_size
    rows = torch.tensor([g * G + j for g in groups for j in range(G)], dtype=torch.long)
    from .trainer import _sub_rollout
    return _sub_rollout(batch, rows), rewards[rows], [ids[g] for g in groups]


def rollout_step(s: Setup, step: int) -> tuple[RolloutBatch, torch.Tensor, list[int], dict[str, float]]:
    """Generate and score P groups; with ``sampling dynamic`` resample until P are informative."""
    cfg = s.cfg
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.n
    rounds = s.fn.data.dynamic_rounds
    kept: list[tuple[RolloutBatch, torch.Tensor, list[int]]] = []
    spare: list[tuple[RolloutBatch, torch.Tensor, list[int]]] = []
    n_kept = 0
    t_gen = t_rew = 0.0
    reward_errors = 0
    used = 0
    for r in range(rounds):
        used = r + 1
        examples = s.source.next_batch(P)
        gen = s.rollouts.generate([e.prompt for e in examples], [e.answer for e in examples],
                                  SamplingParams(n=G, temperature=cfg.rollout.temperature,
                                                 top_p=cfg.rollout.top_p,
                                                 max_new_tokens=cfg.max_new_tokens,
                                                 seed=step_seed(cfg.seed, step, r)))
        batch, scored = gen.batch, gen.scored
        rewards = scored.rewards
        if scored.num_errors:
            reward_errors += scored.num_errors
            s.warn(f"step {step}: {scored.num_errors} sample(s) skipped (reward failed); first:\n"
                   f"{scored.first_error}")
        t_gen += gen.generate_s
        t_rew += gen.reward_s
        ids = [e.id for e in examples]
        if rounds == 1:
            kept.append((batch, rewards, ids))
            n_kept = P
            break
        grouped = rewards.view(-1, G)
        informative = s.fn.data.informative(torch.nan_to_num(grouped, nan=0.0)).tolist()
        good = [g for g, ok in enumerate(informative) if ok]
        bad = [g for g, ok in enumerate(informative) if not ok]
        take = good[: P - n_kept]
        if take:
            kept.append(_select_groups(batch, rewards, ids, take))
            n_kept += len(take)
        if bad:
            spare.append(_select_groups(batch, rewards, ids, bad))
        if n_kept >= P:
            break
    informative_groups = n_kept if rounds > 1 else None
    # not enough informative groups after max_rounds: fill up with the others (A = 0 there)
    for b, rw, ids in spare:
        if n_kept >= P:
            break
        take = list(range(min(P - n_kept, len(ids))))
        kept.append(_select_groups(b, rw, ids, take))
        n_kept += len(take)
    batch = _concat([k[0] for k in kept], s.tokenizer.pad_token_id)
    rewards = torch.cat([k[1] for k in kept])
    ids = sum((k[2] for k in kept), [])
    m = {"time/rollout_s": t_gen, "time/reward_s": t_rew, "sampling_rounds": float(used),
         "reward_errors": float(reward_errors)}
    if informative_groups is not None:
        m["informative_groups"] = float(informative_groups)
    return batch, rewards, ids, m


def evaluate(s: Setup, step: int) -> dict[str, float]:
    """Held-out accuracy: greedy, and sampled at the rollout temperature."""
    if not s.heldout:
        return {}
    cfg = s.cfg
    prompts = [e.prompt for e in s.heldout]
    out: dict[str, float] = {}
    modes = [("greedy", SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens))]
    if cfg.eval.samples:
        modes.append(("sampled", SamplingParams(
            n=cfg.eval.samples, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            max_new_tokens=cfg.max_new_tokens, seed=step_seed(cfg.seed, step, 0, "eval"))))
    for name, params in modes:
        r = s.rollouts.generate(prompts, [e.answer for e in s.heldout], params).scored.rewards
        finite = torch.isfinite(r)
        r = torch.where(finite, r, torch.zeros_like(r))
        out[f"eval/{name}_acc"] = float((r > 0.5).float().mean())
        out[f"eval/{name}_reward"] = float(r.mean())
    return out


def _sync_weights(s: Setup) -> float:
    """Push the trainers' weights to the rollout engine(s); returns the seconds it took."""
    t0 = time.perf_counter()
    s.rollouts.load_weights(s.trainers.weights())
    return time.perf_counter() - t0


def train_step(s: Setup, step: int) -> dict[str, float]:
    """One full step; returns its metrics."""
    cfg = s.cfg
    t_start = time.perf_counter()
    batch, rewards, ids, m = rollout_step(s, step)
    t0 = time.perf_counter()
    tb = s.trainers.score(batch, rewards)
    m["time/logprobs_s"] = time.perf_counter() - t0
    # pass-rate cap: retire prompts that are (nearly) solved
    cap = s.fn.data.pass_rate_cap
    if cap is not None:
        rates = torch.nan_to_num(rewards, nan=0.0).view(-1, batch.group_size).mean(-1)
        retire = [pid for pid, p in zip(ids, rates.tolist()) if p > cap]
        if retire and len(s.source) - len(set(retire) - s.source.excluded) > 0:
            s.source.exclude(retire)
        m["retired_prompts"] = float(len(s.source.excluded))
    t0 = time.perf_counter()
    um = s.trainers.update(tb, step_seed(cfg.seed, step, 0, "minibatch"))  # + the LR schedule step
    m["time/update_s"] = time.perf_counter() - t0
    m["time/sync_s"] = _sync_weights(s)
    finite = torch.isfinite(rewards)
    resp_len = batch.response_mask.sum(-1).float()
    step_s = time.perf_counter() - t_start
    tokens = float(batch.response_mask.sum() + batch.prompt_mask.sum())
    m.update({
        "reward_mean": float(rewards[finite].mean()) if finite.any() else float("nan"),
        "accuracy": float((rewards[finite] > 0.5).float().mean()) if finite.any() else float("nan"),
        "response_length": float(resp_len.mean()),
        "truncated_fraction": float(batch.truncated.float().mean()),
        "lr": s.trainers.lr,
        "step_s": step_s,
        "tokens_per_s": tokens / max(step_s, 1e-9),
    })
    m.update({k: v for k, v in tb.metrics.items() if k not in ("reward_mean",)})
    m.update(um)
    return m


# ----------------------------------------------------------------------------- checkpoints

def _extra_state(s: Setup, step: int, algorithm: dict[str, Any]) -> dict[str, Any]:
    return {"step": step, "data": s.source.state_dict(), "algorithm": algorithm}


def save(s: Setup, step: int) -> Path:
    t = s.trainers.checkpoint_state()  # distributed: full state dicts gathered from the ranks
    return ckpt.save_checkpoint(s.run_dir, step, policy=t.policy, tokenizer=s.tokenizer,
                                optimizer=t.optimizer, scheduler=t.scheduler,
                                critic=t.critic, critic_optimizer=t.critic_optimizer,
                                extra_state=_extra_state(s, step, t.algorithm),
                                keep_last=s.cfg.checkpoint.keep_last or None)


def restore(s: Setup) -> int:
    """Load the newest complete checkpoint of the run folder; returns its step."""
    path = ckpt.latest_checkpoint(s.run_dir)
    if path is None:
        raise RunError(f"{s.run_dir} has no complete checkpoint to resume from")
    c = ckpt.load_checkpoint(path)
    s.trainers.load_checkpoint(c)  # weights, critic, algorithm state, optimizers, scheduler
    s.source.load_state_dict(c.extra["data"])
    _sync_weights(s)
    ckpt.restore_rng(c.rng)  # last: no draw between the restore and the next step
    return c.step


@contextmanager
def _interrupt_guard() -> Iterator[dict[str, bool]]:
    """Turn SIGTERM into KeyboardInterrupt so a killed run still writes its checkpoint."""
    flag = {"hit": False}

    def handler(signum: int, frame: Any) -> None:
        flag["hit"] = True
        raise KeyboardInterrupt

    old = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        old = None
    try:
        yield flag
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


# ----------------------------------------------------------------------------- the run

def train(spec: str, cfg: RunConfig | None = None, resume: str | Path | None = None,
          stop_after: int | None = None) -> Path:
    """Run (or resume) training; returns the run folder.

    ``stop_after``: stop (with a checkpoint) once this many steps are done in total — used by
    tests to interrupt a run at a known point.
    """
    if resume is not None:
        run_dir = Path(resume)
        if not run_dir.is_dir():
            raise RunError(f"no run folder {run_dir} to resume")
        saved = load_run_config(run_dir)
        if cfg is None:
            cfg = saved
        elif cfg != saved:
            save_config(cfg, run_dir)  # config.json shows what actually runs
        spec_file = run_dir / SPEC_FILE
        spec_text = spec_file.read_text(encoding="utf-8")
        s = build(str(spec_file), cfg, run_dir, spec_text)
        start = None
    else:
        cfg = cfg or RunConfig()
        algo = rldsl.load(spec)
        run_dir = cfg.run_dir(algo.name)
        if (run_dir / "metrics.jsonl").exists() or ckpt.latest_checkpoint(run_dir) is not None:
            raise RunError(f"{run_dir} already holds a run: resume it with `rldsl run --resume {run_dir}` "
                           f"or choose another --out")
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir, algo.source)
        for name, text in algo.parent_sources.items():  # `extends` resolves next to spec.rl first
            (run_dir / f"{name}.rl").write_text(text, encoding="utf-8")
        s = build(str(spec), cfg, run_dir, algo.source)
        start = 0
    try:
        if start is None:
            start = restore(s)
            ckpt.remove_checkpoints_after(run_dir, start)
        total = cfg.train.steps
        logger = MetricsLogger(run_dir, tensorboard=cfg.log.tensorboard, total_steps=total,
                               progress=cfg.log.progress, print_every=cfg.log.print_every,
                               resume_step=start if resume is not None else None)
        step = start
        last_saved = start if resume is not None else -1
        s.warn = lambda msg: logger.print(msg, markup=False)
        with logger, _interrupt_guard():
            try:
                if start == 0:
                    logger.log(0, evaluate(s, 0))
                while step < total:
                    if stop_after is not None and step >= stop_after:
                        break
                    m = train_step(s, step)
                    step += 1
                    if cfg.eval.every and step % cfg.eval.every == 0 or step == total:
                        m.update(evaluate(s, step))
                    logger.log(step, m)
                    if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                        save(s, step)
                        last_saved = step
                if last_saved != step and (cfg.checkpoint.save_final or step < total):
                    save(s, step)
            except KeyboardInterrupt:
                if last_saved != step:
                    save(s, step)
                logger.print(f"interrupted at step {step}; checkpoint saved. Resume with: "
                             f"rldsl run --resume {run_dir}")
                raise
            logger.print_summary()
    except WorkerError as exc:  # an actor died or timed out: the checkpoints on disk are complete
        last = ckpt.latest_checkpoint(run_dir)
        hint = (f"the run folder holds complete checkpoint {last.name}: continue with "
                f"`rldsl run --resume {run_dir}` (--trainers may differ)" if last is not None
                else "no checkpoint was written yet")
        raise WorkerError(f"{exc}\n{hint}") from None
    finally:
        s.close()
    return run_dir
