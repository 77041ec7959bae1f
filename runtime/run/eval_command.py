"""``rldsl eval``: a run's checkpoint or a model folder evaluated on data sets without training,
by the run's evaluator (run/evaluation.py); its options are in runtime/cli.py."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import typer

from ...errors import UsageError
from ..batch import RolloutBatch
from ..config import RunConfig
from ..models.loading import load_policy, load_tokenizer
from ..recipe import episode_runner
from ..records.export import export_run
from ..records.run_dir import CONFIG_FILE, load_run_config
from ..resolve import check_episode_template, check_tools
from ..data import reasoning_gym as rg
from ..rewards.functions import RewardFn
from ..rollout.engines.base import SamplingParams
from ..rollout.engines.hf import HFEngine
from .evaluation import EvalSet, evaluate_sets, load_eval_set, load_generated_sets


def evaluate_target(target: Path, data: Sequence[Path], reward: Optional[str] = None, n: int = 8,
                    temperature: Optional[float] = None, top_p: Optional[float] = None,
                    max_new_tokens: Optional[int] = None, step: Optional[int] = None, seed: int = 0,
                    out: Optional[Path] = None, tools: Optional[str] = None,
                    env: Optional[str] = None) -> None:
    """``rldsl eval`` (its options: rldsl/runtime/cli.py): evaluate a run's checkpoint or a model
    folder on the sets in ``data`` and print (and with ``out`` write) the metrics. A run with tools or
    an environment is evaluated as it trained, in multi-turn episodes (its rollout.* settings;
    ``tools`` / ``env`` replace the run's own)."""
    if not target.exists():
        raise UsageError(f"{target} does not exist (give a run folder or a Hugging Face model folder)")
    is_run = (target / "checkpoints").is_dir() and (target / CONFIG_FILE).is_file()
    cfg = load_run_config(target) if is_run else RunConfig()
    if tools is not None or env is not None:  # the flags replace the run's own
        cfg.rollout.tools, cfg.rollout.env = tools, env
    check_tools(cfg)  # a tool that does not import fails before the model loads
    default = "reasoning_gym" if all(rg.is_reasoning_gym(str(p)) for p in data) else "exact"
    reward_fn = RewardFn(reward or (cfg.reward.name if is_run and cfg.reward.name else default),
                         on_error="skip")
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_run(target, Path(tmp) / "model", step) if is_run else target
        if not (folder / "config.json").is_file():
            raise UsageError(f"{folder} is not a Hugging Face model folder (no config.json) nor a run "
                             "folder with checkpoints")
        tokenizer = load_tokenizer(folder)
        check_episode_template(cfg, tokenizer)
        model = load_policy(folder, "float32")
        episodes = episode_runner(cfg, folder)  # None: single-turn completions
    d = cfg.data
    sets: list[EvalSet] = []
    for path in data:
        if rg.is_reasoning_gym(str(path)):  # generated; the run's options when it is the run's data
            own = str(path) == d.path  # then none of the run's training questions either
            sets += load_generated_sets(str(path), reward_fn, tokenizer, options=dict(d.options) if own else {},
                                        seed=cfg.seed, count=200 if d.eval_size is None else d.eval_size,
                                        exclude=[e["question"] for e in rg.training_entries(
                                            d.path, d.options, run_seed=cfg.seed)] if own else (),
                                        chat_template=d.chat_template,
                                        chat_template_kwargs=d.chat_template_kwargs,
                                        system_prompt=d.system_prompt, taken=[s.name for s in sets],
                                        note=typer.echo)
            continue
        sets.append(load_eval_set(path, reward_fn, tokenizer, prompt_key=d.prompt_key,
                                  answer_key=d.answer_key, chat_template=d.chat_template,
                                  chat_template_kwargs=d.chat_template_kwargs,
                                  system_prompt=d.system_prompt, taken=[s.name for s in sets]))
    engine = HFEngine(model, tokenizer)
    r = cfg.rollout

    def generate(prompts: list, answers: list[str], params: SamplingParams) -> RolloutBatch:
        if episodes is None:
            return engine.generate(prompts, params)
        return episodes.run(engine, prompts, answers, params)

    metrics = evaluate_sets(
        generate, sets, episodes=episodes is not None, n=n,
        temperature=temperature if temperature is not None else r.temperature,
        top_p=top_p if top_p is not None else r.top_p,
        max_new_tokens=max_new_tokens or (r.max_new_tokens if is_run and r.max_new_tokens else 256),
        seed=seed)
    for s in sets:
        typer.echo(f"{s.name} ({len(s.examples)} prompts)")
        for key, value in metrics.items():
            if key.startswith(f"eval/{s.name}/"):
                typer.echo(f"  {key[len(f'eval/{s.name}/'):]:<12} {value:.4g}")
    if out is not None:
        out.write_text(json.dumps(metrics, indent=2) + "\n")
