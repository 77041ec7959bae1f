"""``rldsl eval``: a run's checkpoint or a model folder evaluated on data sets without training,
by the run's evaluator (run/evaluation.py); its options are in runtime/cli.py. The target is
opened by run/eval_target.py, the sets read by run/eval_sets.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import typer

from ..batch import RolloutBatch
from ..config import RunConfig, load_config
from ..recipe import rollout_engine
from ..resolve import reward_fn
from ..rollout.engines.base import RolloutEngine, SamplingParams
from .eval_sets import EvalSet, command_reward, command_sets, evaluate_sets, render_set
from .eval_target import EvalTarget, open_target


def evaluate_target(target: Path, data: Sequence[Path], reward: Optional[str] = None, n: int = 8,
                    temperature: Optional[float] = None, top_p: Optional[float] = None,
                    max_new_tokens: Optional[int] = None, step: Optional[int] = None, seed: int = 0,
                    out: Optional[Path] = None, tools: Optional[str] = None,
                    env: Optional[str] = None) -> None:
    """``rldsl eval`` (its options: rldsl/runtime/cli.py): evaluate a run's checkpoint or a model
    folder on the sets in ``data`` and print (and with ``out`` write) the metrics. A run with tools or
    an environment is evaluated as it trained, in multi-turn episodes (its rollout.* settings;
    ``tools`` / ``env`` replace the run's own). The reward and the engine are built by the run's
    recipe (recipe.py: ``reward.answer_format``, ``rollout.engine``, ``model.dtype``,
    ``model.compile`` apply as in training)."""
    t = open_target(target, tools=tools, env=env)
    cfg = t.cfg
    r = cfg.rollout  # the run's sampling (a model folder: the defaults), as the flags change it
    cfg = load_config(base=cfg, flags={
        "reward.name": command_reward(cfg, data, reward, t.is_run),
        "reward.on_error": "skip",
        "rollout.temperature": temperature, "rollout.top_p": top_p,
        "rollout.max_new_tokens": max_new_tokens or (r.max_new_tokens if t.is_run and r.max_new_tokens else 256)})
    scorer = reward_fn(cfg)  # a reward that does not import, or cannot be called, fails before the model loads
    scorer.check_signatures()
    read = command_sets(data, cfg, scorer, note=typer.echo)  # a missing file or column: before the model loads
    try:
        t.load(step)
        sets = [render_set(s, cfg, t.tokenizer) for s in read]
        engine = rollout_engine(cfg, t.folder, cfg.device, model=t.model, tokenizer=t.tokenizer)
        _report(t, cfg, sets, engine, n, seed, out)
    finally:
        t.close()


def _report(t: EvalTarget, cfg: RunConfig, sets: list[EvalSet], engine: RolloutEngine, n: int, seed: int,
            out: Optional[Path]) -> None:
    """Evaluate ``sets`` with ``engine`` (and the target's episodes) and print / write the metrics."""
    runner = t.runner

    def generate(prompts: list, answers: list[str], params: SamplingParams) -> RolloutBatch:
        if runner is None:
            return engine.generate(prompts, params)
        return runner.run(engine, prompts, answers, params)

    metrics = evaluate_sets(generate, sets, cfg, multi_turn=runner is not None, n=n, seed=seed)
    for s in sets:
        typer.echo(f"{s.name} ({len(s.examples)} prompts)")
        for key, value in metrics.items():
            if key.startswith(f"eval/{s.name}/"):
                typer.echo(f"  {key[len(f'eval/{s.name}/'):]:<12} {value:.4g}")
    if out is not None:
        out.write_text(json.dumps(metrics, indent=2) + "\n")
