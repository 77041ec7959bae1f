"""Building a run in two steps: :func:`~rldsl.runtime.run.plan.plan_run` settles everything that
needs no weights (the spec, parsed once; the checks; the data; the tokenizer; the resolved,
frozen config that config.json records), then :func:`build` loads the model(s) and starts the
two sides a step talks to -- in this process, or on Ray actors when the config asks for them
(workers/start.py). The models, the engine and the reward come from one recipe (recipe.py)
shared with the Ray workers.
"""
from __future__ import annotations

from pathlib import Path

import torch

import rldsl

from ..config import RunConfig
from ..models.loading import disable_transformers_progress
from ..records.rng import seed_all
from ..workers.start import reference_rollouts, start_workers
from .carried import carried_state
from .plan import load_spec, plan_run
from .state import Plan, Run


def build(plan: Plan, run_dir: Path) -> Run:
    """Load the model(s) of a planned run and start its engine(s) and trainer(s), in this
    process or on Ray actors (workers/start.py)."""
    cfg, algo, tok = plan.cfg, plan.algo, plan.tokenizer
    disable_transformers_progress()  # the bars would break the run's own progress display
    torch.set_num_threads(cfg.threads)
    seed_all(cfg.seed)
    fn = rldsl.compile(algo)
    rollouts, trainers = start_workers(cfg, algo, fn, plan.model_path, tok, plan.reward, run_dir)
    return Run(cfg, algo, fn, run_dir, tok, plan.prompts, plan.heldout, rollouts, trainers, plan.reward, plan.source,
               notes=plan.notes, warnings=plan.warnings, eval_sets=plan.eval_sets,
               reference=reference_rollouts(cfg, algo, plan.model_path, plan.reward),
               **carried_state(algo, fn, tok.pad_token_id))


def build_run(spec: str, cfg: RunConfig, run_dir: Path, spec_text: str | None = None) -> Run:
    """:func:`plan_run` then :func:`build`: a run of ``spec`` (``spec_text`` when given) under ``cfg``."""
    return build(plan_run(load_spec(spec, spec_text), cfg), run_dir)
