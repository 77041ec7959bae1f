"""What ``rldsl eval`` evaluates: a run folder's checkpoint (exported to a model folder; the run's
config, so that its episodes run as they trained) or a Hugging Face model folder (the default
config), loaded with its tokenizer and its multi-turn episode runner, if any.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from torch import nn

from ...errors import UsageError
from ..config import RunConfig
from ..models.loading import load_policy, load_tokenizer, model_context
from ..records.export import export_run
from ..records.run_dir import CONFIG_FILE, load_run_config
from ..rollout.multi_turn import check_episode_template, check_tools, episode_runner


@dataclass
class EvalTarget:
    """An evaluation target, opened by :func:`open_target` (its config read and checked, nothing
    loaded) and loaded by :meth:`load`. ``is_run``: a run folder (``cfg`` is its saved config);
    ``folder``: the model folder (a run's checkpoint exported to a temporary one, kept until
    :meth:`close`: a vLLM engine loads it); ``runner``: the multi-turn runner (``run(engine,
    prompts, answers, params)``), None for single-turn completions."""

    path: Path
    cfg: RunConfig
    is_run: bool
    tokenizer: Any = None
    model: nn.Module | None = None
    runner: Any = None
    folder: Path | None = None
    _tmp: Any = None

    def load(self, step: Optional[int] = None) -> "EvalTarget":
        """The model (float32; the engine casts it to ``model.dtype``) and tokenizer: a run's
        checkpoint of ``step`` (else its newest), exported to a model folder, or the model folder
        itself; the episode runner, if any."""
        if self.is_run:
            self._tmp = tempfile.TemporaryDirectory()
            self.folder = export_run(self.path, Path(self._tmp.name) / "model", step)
        else:
            self.folder = self.path
        folder = self.folder
        if not (folder / "config.json").is_file():
            raise UsageError(f"{folder} is not a Hugging Face model folder (no config.json) nor a run "
                             "folder with checkpoints")
        self.tokenizer = load_tokenizer(folder)
        check_episode_template(self.cfg, self.tokenizer, folder)
        self.model = load_policy(folder, "float32")
        self.runner = episode_runner(self.cfg, folder, model_context(folder))  # None: single-turn completions
        return self

    def close(self) -> None:
        """Remove the exported model folder, if any."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def open_target(target: Path, *, tools: Optional[str] = None, env: Optional[str] = None) -> EvalTarget:
    """``target`` -- a run folder or a model folder -- with the config it is evaluated under;
    ``tools`` / ``env`` replace the run's own; a folder that is neither, or a tool that does not
    import, fails here, before any model loads."""
    if not target.exists():
        raise UsageError(f"{target} does not exist (give a run folder or a Hugging Face model folder)")
    is_run = (target / "checkpoints").is_dir() and (target / CONFIG_FILE).is_file()
    if not is_run and not (target / "config.json").is_file():  # before the data is read
        raise UsageError(f"{target} is not a Hugging Face model folder (no config.json) nor a run "
                         "folder with checkpoints")
    cfg = load_run_config(target) if is_run else RunConfig()
    if tools is not None or env is not None:  # the flags replace the run's own
        cfg.rollout.tools, cfg.rollout.env = tools, env
    check_tools(cfg)
    return EvalTarget(target, cfg, is_run)
