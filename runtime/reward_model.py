"""``rm:PATH``: a sequence-classification reward model as a batch reward term.

The folder holds an HF ``*ForSequenceClassification`` model with one output (the reward) and
its own tokenizer. Each sample is scored on the conversation (user: the row's prompt,
assistant: the completion) rendered with the reward model's chat template -- or, for a
tokenizer without one, on ``prompt + completion`` -- in batches of ``batch_size`` rows, on
``device``. The reward is the model's output for the last real token (as HF's
sequence-classification heads pool), optionally ``(score - shift) / scale``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch


def _check_folder(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"reward model {str(path)!r}: no config.json there (give an HF model folder)")
    config = json.loads(config_file.read_text())
    archs = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"reward model {str(path)!r} is not a sequence-classification model: its config.json names "
            f"{', '.join(archs) or 'no architecture'}; a reward model is an "
            "AutoModelForSequenceClassification folder with num_labels=1")
    num_labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
    if num_labels != 1:
        raise ValueError(f"reward model {str(path)!r} has {num_labels} labels; a reward model has one "
                         "output (num_labels=1)")
    return config


class RewardModel:
    """A reward model folder loaded for scoring (``torch.no_grad``, eval mode)."""

    def __init__(self, path: str, *, batch_size: int = 16, device: str = "cpu", dtype: str = "float32",
                 scale: float = 1.0, shift: float = 0.0, max_length: int | None = None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        folder = Path(path)
        _check_folder(folder)
        if batch_size < 1 or not scale > 0:
            raise ValueError(f"reward model {path!r}: batch_size must be >= 1 and scale > 0")
        self.path, self.batch_size, self.device = path, int(batch_size), torch.device(device)
        self.scale, self.shift, self.max_length = float(scale), float(shift), max_length
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(folder), dtype=getattr(torch, dtype)).to(self.device).eval()
        if self.model.config.pad_token_id is None:  # the head pools the last non-pad token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def __repr__(self) -> str:
        return f"RewardModel({self.path!r})"

    def text(self, prompt: str, completion: str) -> str:
        """The conversation the model scores, as its own tokenizer renders it."""
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
                tokenize=False)
        return prompt + completion

    @torch.no_grad()
    def score_batch(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str],
                    finish_reasons: Sequence[str]) -> list[float]:
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        out: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                 truncation=self.max_length is not None, max_length=self.max_length,
                                 add_special_tokens=not getattr(self.tokenizer, "chat_template", None))
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits  # [b, 1]
            out.extend(((logits[:, 0].float() - self.shift) / self.scale).tolist())
        return out

    def __call__(self, prompt: str, completion: str, answer: str, finish_reason: str = "stop") -> float:
        return self.score_batch([prompt], [completion], [answer], [finish_reason])[0]
