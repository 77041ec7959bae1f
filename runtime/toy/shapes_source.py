"""The shapes task's row of the sources table (data/sources.py): ``data.task = "shapes"`` (and the
evaluation set ``shapes:eval``) reads its rows from toy/shapes.py, scores them with ``exact`` and
trains the embedded tiny Qwen2-VL of toy/shapes_warmup.py, which loads only when a run builds it."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..config import SHAPES_TASK, RunConfig
from ..data.datasets import Example
from ..data.sources import Rows, Source, heldout_count
from ..errors import ConfigError
from .shapes import EVAL_PATH, EVAL_SEED, examples, heldout_scenes, question_of, scenes, train_scenes


def _rows(cfg: RunConfig) -> Rows:
    size = heldout_count(cfg)
    return Rows(examples(train_scenes(cfg.seed)), examples(heldout_scenes(size)) if size else [])


def _eval_rows(cfg: RunConfig, path: str, count: int | None,
               exclude: Sequence[str] | None) -> tuple[dict[str, list[Example]], str | None]:
    """``shapes:eval``: ``count`` held-out-side scenes (default 200) from the evaluation seed; no
    training scene can be one of them (the split is by scene)."""
    n = 200 if count is None else count
    return {"": examples(scenes(n, EVAL_SEED, heldout=True))}, f"{path}: {n} held-out-side scenes from seed {EVAL_SEED}"


def _model(cfg: RunConfig) -> tuple[Path, str]:
    if cfg.rollout.engine == "vllm":
        raise ConfigError(f"data.task={SHAPES_TASK}: its embedded vision-language model runs on the HF engine "
                          "(rollout.engine = 'hf'); give a model folder (--model) for vLLM")
    from .shapes_warmup import embedded_model
    return embedded_model()


def _tokenizer() -> Any:
    from .shapes_warmup import build_tokenizer
    return build_tokenizer()


def _claims(cfg: RunConfig) -> bool:
    path = cfg.data.path
    return (path is None and cfg.data.task == SHAPES_TASK) or (path is not None and path == EVAL_PATH)


#: The visual task: pictures drawn offline, a one-word answer scored by ``exact``, its embedded
#: tiny Qwen2-VL warm-started (toy/shapes_warmup.py); rendered with that model's chat template
SOURCE = Source(SHAPES_TASK, f"the built-in {SHAPES_TASK} task", claims=_claims, rows=_rows,
                reward="exact", max_new_tokens=3, model=_model, tokenizer=_tokenizer, vision=True,
                eval_rows=_eval_rows, task_of=question_of, precedence=1)
