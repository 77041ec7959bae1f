"""Planning a run: everything checked and settled before any model loads (:func:`plan_run`),
cheapest first, so that a mistake costs seconds, not a model load. The result is a
:class:`~rldsl.runtime.run.state.Plan`; run/build.py loads its models.
"""
from __future__ import annotations

import rldsl

from ..config import MODEL_RUN_DEFAULTS, RunConfig
from ..resolve import (check_group_size, check_settings, check_teacher_settings,
                       checked_reward, resolve, reward_note)
from .eval_sets import eval_rows_of, eval_sets_of
from ..data.sources import settle, source_of
from ..records.trackers import check_trackers
from .sources import check_image_model, examples_of, model_folder, model_of, prompts_of
from .state import Plan


def load_spec(spec: str, spec_text: str | None = None) -> rldsl.Algorithm:
    """The run's spec, parsed once: ``spec_text`` (named ``spec``) when given, else the file or
    library name ``spec``."""
    return rldsl.loads(spec_text, spec) if spec_text is not None else rldsl.load(spec)


def plan_run(algo: rldsl.Algorithm, cfg: RunConfig) -> Plan:
    """Everything checked and settled before a model loads (runtime/resolve.py), cheapest first.
    First what needs neither torch nor transformers (this module and the ones it imports load
    neither: ``rldsl run`` rejects a typo in about a second, tests/test_cli_startup.py): what the
    config leaves to its prompt source, settled once (the reward's name, the tools,
    ``max_new_tokens``: every check below reads the keys); the device, engine, the prompt source's needs and the tools, environment or agent
    (resolve.check_settings); the trackers; the reward, named once (a server's address, a reward
    model's folder; reasoning_gym only on reasoning-gym data; its functions' signatures); the
    teacher's settings; the model folder; the data's files, fields and reasoning-gym tasks, the
    ``eval.data`` sets' likewise (and their own rewards' signatures); prompts with images for a
    text model (run/sources.py ``check_image_model``). Then the model's tokenizer and context, a
    teacher's vocabulary, the resolved config, the group-size check and the rollout-stage inputs
    the spec reads. A mistake in any of them fails in seconds, never after a model load."""
    source = source_of(cfg)  # where the prompts come from (data/sources.py): bound here, once; the run carries it
    cfg, origin = settle(cfg, source)  # what the config leaves to the source, asked once
    check_settings(algo, cfg, source)
    check_trackers(cfg.log.report_to)  # installed
    reward = checked_reward(cfg)  # the task's own when none is named, built once
    named = reward_note(cfg, origin)  # the run-start line naming it
    check_teacher_settings(algo, cfg)
    if cfg.model.path is not None:
        model_folder(cfg, source)  # a user's model folder exists (the toy's is built by model_of)
    notes: list[str] = []
    rows = examples_of(cfg, source, notes.append)
    read = eval_rows_of(cfg, source, reward, [e.reward_prompt for e in rows.train])  # eval.data, not yet rendered
    data = f"data.path={cfg.data.path}" if cfg.data.path else source.what
    check_image_model(cfg, source, [(data, rows.train + rows.heldout)]
                      + [(f"eval.data set {s.name!r}", s.examples) for s in read])
    # -- from here on the tokenizer (transformers) and, for the toy's warm start, torch
    from ..train.inputs import check_rollout_inputs  # torch (the compiled algorithm's inputs)

    path, label, tok = model_of(algo, cfg, source)
    prompts, held = prompts_of(cfg, source, tok, rows=rows)
    eval_sets = eval_sets_of(cfg, source, tok, reward, read=read)
    resolved, more = resolve(cfg, path, tok, [e.prompt for e in prompts.examples + held]
                             + [e.prompt for s in eval_sets for e in s.examples], label)
    warnings = check_group_size(algo, resolved)
    # the rollout-stage inputs the spec reads can be made in this run (per-turn rewards need a
    # reward term that gives them, and turns)
    check_rollout_inputs(algo, [(t.name, t.weight) for t in reward.terms],
                         resolved.rollout.env is not None or resolved.rollout.tools is not None)
    return Plan(resolved, algo, path, tok, source, prompts, held, reward, notes + [named] + more, warnings,
                eval_sets)


def optimizer_note(cfg: RunConfig) -> str:
    """The run-start line naming the optimizer settings and where their defaults come from."""
    t = cfg.train
    note = f"optimizer: AdamW lr {t.lr:g}, betas ({t.betas[0]:g}, {t.betas[1]:g})"
    if cfg.model.path is None:
        return note + " (the toy's tuned defaults)"
    if t.lr == MODEL_RUN_DEFAULTS["train.lr"] and tuple(t.betas) == MODEL_RUN_DEFAULTS["train.betas"]:
        return note + " (defaults for a user's model, as TRL and verl; set train.lr / train.betas to change)"
    return note
