"""``rldsl eval``: a run's checkpoint or a model folder evaluated on data sets without training,
by the run's evaluator (run/evaluation.py); its options are in runtime/cli.py. The target is
opened by run/eval_target.py, the sets read by run/eval_sets.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import typer

from ..batch import RolloutBatch
from ..config import load_config
from ..rewards.functions import RewardFn
from ..rollout.engines.base import SamplingParams
from ..rollout.engines.hf import HFEngine
from .eval_sets import command_sets, default_reward, evaluate_sets
from .eval_target import open_target


def evaluate_target(target: Path, data: Sequence[Path], reward: Optional[str] = None, n: int = 8,
                    temperature: Optional[float] = None, top_p: Optional[float] = None,
                    max_new_tokens: Optional[int] = None, step: Optional[int] = None, seed: int = 0,
                    out: Optional[Path] = None, tools: Optional[str] = None,
                    env: Optional[str] = None) -> None:
    """``rldsl eval`` (its options: rldsl/runtime/cli.py): evaluate a run's checkpoint or a model
    folder on the sets in ``data`` and print (and with ``out`` write) the metrics. A run with tools or
    an environment is evaluated as it trained, in multi-turn episodes (its rollout.* settings;
    ``tools`` / ``env`` replace the run's own)."""
    t = open_target(target, tools=tools, env=env)
    cfg = t.cfg
    reward_fn = RewardFn(reward or (cfg.reward.name if t.is_run and cfg.reward.name else default_reward(data)),
                         on_error="skip")  # a reward that does not import fails before the model loads
    r = cfg.rollout  # the run's sampling (a model folder: the defaults), as the flags change it
    cfg = load_config(base=cfg, flags={
        "rollout.temperature": temperature, "rollout.top_p": top_p,
        "rollout.max_new_tokens": max_new_tokens or (r.max_new_tokens if t.is_run and r.max_new_tokens else 256)})
    t.load(step)
    sets = command_sets(data, cfg, reward_fn, t.tokenizer, note=typer.echo)
    engine = HFEngine(t.model, t.tokenizer)
    episodes = t.episodes

    def generate(prompts: list, answers: list[str], params: SamplingParams) -> RolloutBatch:
        if episodes is None:
            return engine.generate(prompts, params)
        return episodes.run(engine, prompts, answers, params)

    metrics = evaluate_sets(generate, sets, cfg, episodes=episodes is not None, n=n, seed=seed)
    for s in sets:
        typer.echo(f"{s.name} ({len(s.examples)} prompts)")
        for key, value in metrics.items():
            if key.startswith(f"eval/{s.name}/"):
                typer.echo(f"  {key[len(f'eval/{s.name}/'):]:<12} {value:.4g}")
    if out is not None:
        out.write_text(json.dumps(metrics, indent=2) + "\n")
