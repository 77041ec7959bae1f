"""What a run's rollouts are made of beside the engine: its multi-turn episodes (an agent's
endpoint, tool calls, an environment) or none, and their checks before any model loads
(resolve.py and run/ call them); a verifiers taskset's row of the sources table (its tasks are
the run's rows: data/sources.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import RunConfig, env_library
from ..data.sources import Rows, Source, default_tools, split_rows
from ..errors import ConfigError
from ..models.loading import model_context
from .agents.environments import agent_runner, check_agent, verifiers_examples
from .episodes.env import load_env
from .episodes.runner import EpisodeRunner
from .episodes.tools import SHARED_TOOL_POOL, load_tools


def check_tools(cfg: RunConfig) -> None:
    """``rollout.tools`` import and can be described, ``rollout.env`` is a usable class (before any
    model loads); the two are exclusive (an environment brings its own tools)."""
    tools = default_tools(cfg)
    if tools is not None and cfg.rollout.env is not None:
        raise ConfigError("rollout.tools and rollout.env are exclusive: an environment gives its episodes "
                          "their tools itself (set self.tools in reset); rollout.tools is the default "
                          "tool environment")
    if tools is not None:
        load_tools(tools)
    if env_library(cfg.rollout.env) == "verifiers" and cfg.data.path is not None:
        raise ConfigError(f"rollout.env {cfg.rollout.env!r} takes its rows from the taskset (one per task): "
                          f"data.path ({cfg.data.path}) must be unset")
    if cfg.rollout.env is not None and env_library(cfg.rollout.env) is None:
        load_env(cfg.rollout.env)
    if cfg.rollout.agent is not None and (cfg.rollout.tools is not None or cfg.rollout.env is not None):
        raise ConfigError("rollout.agent excludes rollout.tools and rollout.env: the agent program "
                          "runs its own tools and environment, calling the policy's endpoint")
    check_agent(cfg)  # the agent function; a verifiers / OpenEnv environment's packages, taskset, server


def check_episode_template(cfg: RunConfig, tokenizer: Any) -> None:
    """Multi-turn episodes render every turn with the tokenizer's chat template (with the tools),
    whatever ``data.chat_template`` says: a tokenizer without one is refused before any model loads."""
    episodes = default_tools(cfg) is not None or cfg.rollout.env is not None
    if episodes and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("rollout.tools / rollout.env need a tokenizer with a chat template (it renders each "
                          "turn of an episode and the tools); the model folder's tokenizer has none: add one "
                          "(tokenizer.chat_template in tokenizer_config.json or chat_template.jinja)")


def _taskset_rows(cfg: RunConfig) -> Rows:
    return split_rows(cfg, verifiers_examples(cfg.rollout.env))


#: A verifiers taskset (``rollout.env = verifiers:...``, ``data.path`` unset): its tasks are the
#: rows (held out as a data file's), scored by the environment's own reward
TASKSET = Source("verifiers", "a verifiers taskset",
                 claims=lambda cfg: cfg.data.path is None and env_library(cfg.rollout.env) == "verifiers",
                 rows=_taskset_rows, reward="env", precedence=1)


def episode_runner(cfg: RunConfig, model_path: str | Path) -> Any:
    """The multi-turn episodes of a run: an ``AgentRunner`` with ``rollout.agent``, an
    ``EpisodeRunner`` with ``rollout.tools`` or ``rollout.env``, else None (single-turn
    completions). Both have ``run(engine, prompts, answers, params) -> RolloutBatch``."""
    r = cfg.rollout
    runner = agent_runner(cfg, model_path, model_context(Path(model_path)))  # the endpoint's episodes
    if runner is not None:
        return runner
    if r.tools is None and r.env is None:
        return None
    SHARED_TOOL_POOL.resize(r.tool_workers)  # this process's tool pool
    return EpisodeRunner.from_config(cfg, context=model_context(Path(model_path)))
