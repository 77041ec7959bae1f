"""What a run's rollouts are made of beside the engine: its multi-turn episodes (an agent's
endpoint, tool calls, an environment) or none, and their checks before any model loads
(resolve.py and run/ call them); a verifiers taskset's row of the sources table (its tasks are
the run's rows: data/sources.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import RunConfig, env_library
from ..data.sources import Rows, Source, split_rows, system_prompt
from ..errors import ConfigError
from .agents.environments import agent_runner, check_agent, verifiers_examples
from .episodes.env import load_env
from .episodes.runner import EpisodeRunner
from .episodes.tools import SHARED_TOOL_POOL, load_tools, tool_schema


def check_tools(cfg: RunConfig) -> None:
    """``rollout.tools`` import and can be described, ``rollout.env`` is a usable class (before any
    model loads); the two are exclusive (an environment brings its own tools). ``cfg``: a settled
    config (data/sources.py ``settle``: a built-in task's tools are filled in)."""
    r = cfg.rollout
    if r.tools is not None and r.env is not None:
        raise ConfigError("rollout.tools and rollout.env are exclusive: an environment gives its episodes "
                          "their tools itself (set self.tools in reset); rollout.tools is the default "
                          "tool environment")
    if r.agent is not None and (r.tools is not None or r.env is not None):
        raise ConfigError("rollout.agent excludes rollout.tools and rollout.env: the agent program "
                          "runs its own tools and environment, calling the policy's endpoint")
    if r.tools is not None:
        load_tools(r.tools)
    library = env_library(r.env)
    if library == "verifiers" and cfg.data.path is not None:
        raise ConfigError(f"rollout.env {r.env!r} takes its rows from the taskset (one per task): "
                          f"data.path ({cfg.data.path}) must be unset")
    if r.env is not None and library is None:
        load_env(r.env)
    # the agent function; a verifiers / OpenEnv environment's packages, taskset, server
    check_agent(r.agent, r.env, library)


def check_episode_template(cfg: RunConfig, tokenizer: Any, model_dir: Path | None = None) -> None:
    """Multi-turn episodes render every turn with the tokenizer's chat template (with the tools),
    whatever ``data.chat_template`` says: a tokenizer without one, or (``rollout.tools``) one whose
    template does not render tools, is refused before any model loads. ``model_dir``: the folder
    the tokenizer came from (the message names the template's file)."""
    episodes = cfg.rollout.tools is not None or cfg.rollout.env is not None
    if episodes and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("rollout.tools / rollout.env need a tokenizer with a chat template (it renders each "
                          "turn of an episode and the tools); the model folder's tokenizer has none: add one "
                          "(tokenizer.chat_template in tokenizer_config.json or chat_template.jinja)")
    if cfg.rollout.tools is not None:
        check_template_renders_tools(cfg, tokenizer, model_dir)


#: A tool name no template writes by chance: a conversation rendered with it shows whether the
#: template puts the tools' schemas in the prompt.
PROBE_TOOL = "rldsl_probe_tool_q7z"


def check_template_renders_tools(cfg: RunConfig, tokenizer: Any, model_dir: Path | None = None) -> None:
    """``rollout.tools`` need a chat template that renders ``tools``: one that ignores them (Qwen2-VL's
    and Qwen2.5-VL's released templates) trains a model that never sees the tools' schemas. Checked by
    rendering: a conversation with a probe tool must name it -- or ``data.system_prompt`` names every
    tool (the user describes them there)."""
    probe = {"type": "function", "function": {"name": PROBE_TOOL, "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe], tokenize=False,
                                             add_generation_prompt=True, **cfg.data.chat_template_kwargs)
        why = "a conversation rendered with a tool schema does not name the tool"
    except Exception as e:  # noqa: BLE001 - jinja's and transformers' errors alike: the template cannot
        text, why = "", f"rendering a conversation with a tool schema raised {type(e).__name__}: {e}"
    if PROBE_TOOL in text:
        return
    names = [tool_schema(fn)["function"]["name"] for fn in load_tools(cfg.rollout.tools or "")]
    described = system_prompt(cfg) or ""
    if names and all(name in described for name in names):  # described by the user in every system message
        return
    raise ConfigError(
        f"rollout.tools: the chat template of {_template_file(model_dir)} does not render tools ({why}): the "
        f"model would never see the schemas of {', '.join(names)}. Use a template that renders `tools` (the "
        "model family's tool-use template, as chat_template.jinja in the model folder), or describe each tool, "
        "its name and arguments, in the system prompt: --set data.system_prompt='...' (accepted when it names "
        "every tool)")


def _template_file(model_dir: Path | None) -> str:
    """Where a model folder's tokenizer got its chat template (transformers' order), for messages."""
    if model_dir is None:
        return "the tokenizer"
    for name in ("chat_template.jinja", "chat_template.json"):
        if (model_dir / name).is_file():
            return str(model_dir / name)
    return str(model_dir / "tokenizer_config.json")


def _taskset_rows(cfg: RunConfig) -> Rows:
    return split_rows(cfg, verifiers_examples(cfg.rollout.env))


#: A verifiers taskset (``rollout.env = verifiers:...``, ``data.path`` unset): its tasks are the
#: rows (held out as a data file's), scored by the environment's own reward
TASKSET = Source("verifiers", "a verifiers taskset",
                 claims=lambda cfg: cfg.data.path is None and env_library(cfg.rollout.env) == "verifiers",
                 rows=_taskset_rows, reward="env", precedence=1)


def episode_runner(cfg: RunConfig, model_path: str | Path, context: int | None) -> Any:
    """The multi-turn episodes of a run: an ``AgentRunner`` with ``rollout.agent``, an
    ``EpisodeRunner`` with ``rollout.tools`` or ``rollout.env``, else None (single-turn
    completions). Both have ``run(engine, prompts, answers, params) -> RolloutBatch``.
    ``context``: the model's positions (models/loading.py ``model_context`` of ``model_path``,
    read by whoever loads the model)."""
    r = cfg.rollout
    runner = agent_runner(cfg, model_path, context)  # the endpoint's episodes
    if runner is not None:
        return runner
    if r.tools is None and r.env is None:
        return None
    SHARED_TOOL_POOL.resize(r.tool_workers)  # this process's tool pool
    return EpisodeRunner.from_config(cfg, context=context)
