"""``rm:PATH``: a sequence-classification reward model as a batch reward term.

The folder holds an HF ``*ForSequenceClassification`` model with one output (the reward) and
its own tokenizer. Each sample is scored on the conversation (user: the row's prompt,
assistant: the completion) rendered with the reward model's chat template -- or, for a
tokenizer without one, on ``prompt + completion`` -- in batches of ``batch_size`` rows, on
``device``. The reward is the model's output for the last real token (as HF's
sequence-classification heads pool), optionally ``(score - shift) / scale``.

``rm:PATH(step_separator=...)`` makes it a process reward: each step of the completion (the text
up to and after each separator; ``\n\n`` as written in the option is a blank line) is scored
where it ends, and the sample's reward is the sum of its step scores; a spec with ``rewards
dense`` also gets each step score on the response token that ends the step
(runtime/train/inputs.py).

``rm:PATH(actor=true)`` puts the model on a Ray actor of its own (:class:`RewardModelActor`):
scoring then runs in another process, beside the engine, and the model's memory lives there.
An actor that dies is restarted and its call made again by Ray (``max_restarts``, 3 by
default: it holds no state but the model folder's); once they are spent the run stops.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import WorkerError
from ..models.loading import quiet_transformers


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
                 scale: float = 1.0, shift: float = 0.0, max_length: int | None = None,
                 step_separator: str | None = None) -> None:
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
        with quiet_transformers():  # no "Loading weights" bar
            self.model = AutoModelForSequenceClassification.from_pretrained(
                str(folder), dtype=getattr(torch, dtype)).to(self.device).eval()
        if self.model.config.pad_token_id is None:  # the head pools the last non-pad token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.step_separator = separator(step_separator) if step_separator is not None else None
        if self.step_separator is not None and (not getattr(self.tokenizer, "is_fast", False)
                                                or not isinstance(getattr(self.model, "score", None), torch.nn.Module)):
            raise ValueError(f"reward model {path!r}: step scores need a fast tokenizer (token offsets) and a "
                             "sequence-classification head named `score` (Llama, Qwen2, Mistral, ... folders)")

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
                    finish_reasons: Sequence[str]) -> list[float | BaseException]:
        """One reward per sample; with a step separator, the sum of its step scores (or the error
        that sample's steps raised)."""
        if self.step_separator is not None:
            return [s if isinstance(s, BaseException) else sum(v for _, v in s)
                    for s in self.score_steps(prompts, completions, answers, finish_reasons)]
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        out: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                 truncation=self.max_length is not None, max_length=self.max_length,
                                 add_special_tokens=not getattr(self.tokenizer, "chat_template", None))
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits  # [b, 1]
            out.extend(((logits[:, 0].float() - self.shift) / self.scale).tolist())
        return out

    @torch.no_grad()
    def score_steps(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str],
                    finish_reasons: Sequence[str]) -> list[list[list[float]] | BaseException]:
        """A process reward: each step of a completion scored where it ends. Steps end after each
        ``step_separator`` and at the end of the completion; step k's score is the model's head at
        the last token of the text up to the end of step k (a causal model: the score of that
        prefix; the last step's is the completion's own score). Per sample ``[[end, score], ...]``
        (``end`` a character offset into the completion), or a ValueError when the completion
        holds no separator -- a process reward that finds no step is an error, never a 0."""
        assert self.step_separator is not None
        out: list[list[list[float]] | BaseException] = []
        for i in range(0, len(completions), self.batch_size):
            rows = range(i, min(i + self.batch_size, len(completions)))
            texts = [self.text(prompts[j], completions[j]) for j in rows]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, return_offsets_mapping=True,
                                 truncation=self.max_length is not None, max_length=self.max_length,
                                 add_special_tokens=not getattr(self.tokenizer, "chat_template", None))
            offsets = enc.pop("offset_mapping")  # [b, L, 2]
            hidden = self.model(**{k: v.to(self.device) for k, v in enc.items()},
                                output_hidden_states=True).hidden_states[-1]  # [b, L, H]
            head = self.model.score(hidden)[..., 0].float()  # [b, L] the head at every position
            for b, j in enumerate(rows):
                out.append(self._steps(texts[b], completions[j], offsets[b], enc["attention_mask"][b], head[b]))
        return out

    def _steps(self, text: str, completion: str, offsets: torch.Tensor, attention: torch.Tensor,
               head: torch.Tensor) -> list[list[float]] | BaseException:
        sep = self.step_separator
        assert sep is not None
        ends = [k + len(sep) for k in _find_all(completion, sep)]
        if not ends:
            return ValueError(f"no step separator {sep!r} in the completion (rm step_separator): a process "
                              "reward scores steps; give the separator the model writes between its steps")
        start = text.rfind(completion)
        if start < 0:
            return ValueError("the reward model's chat template rewrites the completion: its steps cannot be "
                              "found in the text it scores")
        real = (attention > 0) & (offsets[:, 1] > offsets[:, 0])  # [L] tokens with text
        last_real = int(torch.nonzero(attention > 0)[-1])
        steps = []
        for end in ends:
            inside = real & (offsets[:, 0] < start + end)  # tokens that begin before the step's end
            if not bool(inside.any()):
                return ValueError(f"step ending at character {end} lies outside the text the reward model "
                                  "scored (max_length?)")
            steps.append([float(end), float(head[int(torch.nonzero(inside)[-1])])])
        if ends[-1] < len(completion):  # the text after the last separator: the final step
            steps.append([float(len(completion)), float(head[last_real])])
        return [[e, (v - self.shift) / self.scale] for e, v in steps]

    def __call__(self, prompt: str, completion: str, answer: str, finish_reason: str = "stop") -> float:
        value = self.score_batch([prompt], [completion], [answer], [finish_reason])[0]
        if isinstance(value, BaseException):
            raise value
        return value


def separator(text: str) -> str:
    """A step separator as a reward option writes it: backslash escapes read (``\\n\\n`` is
    a blank line); refused when empty."""
    import codecs
    sep = codecs.decode(str(text), "unicode_escape")
    if not sep:
        raise ValueError("step_separator must not be empty")
    return sep


def _find_all(text: str, sep: str) -> list[int]:
    out, k = [], text.find(sep)
    while k >= 0:
        out.append(k)
        k = text.find(sep, k + len(sep))
    return out


def reward_model_term(path: str, *, actor: bool = False, num_gpus: float = 0.0, num_cpus: float = 0.0,
                      start_timeout_s: float = 300.0, max_restarts: int = 3, batch_size: int = 16, device: str = "cpu",
                      dtype: str = "float32", scale: float = 1.0, shift: float = 0.0,
                      max_length: int | None = None,
                      step_separator: str | None = None) -> "RewardModel | RewardModelActor":
    """The ``rm:PATH`` term: the model in this process, or with ``actor=true`` on a Ray actor
    (``num_gpus`` / ``num_cpus``: what the actor reserves; ``start_timeout_s``: how long it may
    take to be placed and load the model; ``max_restarts``: how often a dead actor is restarted)."""
    options = dict(batch_size=batch_size, device=device, dtype=dtype, scale=scale, shift=shift,
                   max_length=max_length, step_separator=step_separator)
    if actor:
        return RewardModelActor(path, num_gpus=num_gpus, num_cpus=num_cpus, start_timeout_s=start_timeout_s,
                                max_restarts=max_restarts, **options)
    return RewardModel(path, **options)


class RewardModelActor:
    """A :class:`RewardModel` on a Ray actor of its own, started on first use (a run's driver
    builds its reward before Ray starts; only the processes that score start one). Inside a
    Ray run the actor joins the run's cluster; in a one-process run a local Ray is started.
    The folder is checked here, at construction, so a bad one fails at start-up."""

    def __init__(self, path: str, *, num_gpus: float = 0.0, num_cpus: float = 0.0,
                 start_timeout_s: float = 300.0, max_restarts: int = 3, **options: Any) -> None:
        _check_folder(Path(path))
        if num_gpus < 0 or num_cpus < 0 or not start_timeout_s > 0 or max_restarts < 0:
            raise ValueError(f"reward model {path!r}: num_gpus, num_cpus and max_restarts must be >= 0 and "
                             f"start_timeout_s > 0")
        self.max_restarts = int(max_restarts)
        if int(options.get("batch_size", 16)) < 1 or not float(options.get("scale", 1.0)) > 0:
            raise ValueError(f"reward model {path!r}: batch_size must be >= 1 and scale > 0")
        if options.get("step_separator") is not None:
            separator(options["step_separator"])  # an empty one fails at start-up
        self.path, self.options = path, options
        self.num_gpus, self.num_cpus, self.start_timeout_s = float(num_gpus), float(num_cpus), float(start_timeout_s)
        self._actor: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RewardModelActor({self.path!r})"

    def __getstate__(self) -> dict:  # shipped to Ray workers unstarted; each starts its own
        return {**self.__dict__, "_actor": None, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _started(self) -> Any:
        with self._lock:
            if self._actor is None:
                import ray

                if not ray.is_initialized():
                    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
                             _node_ip_address="127.0.0.1")
                actor = ray.remote(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=self.max_restarts,
                                   max_task_retries=self.max_restarts)(RewardModel).remote(self.path, **self.options)
                try:  # the actor is placed and has loaded the model (an empty batch scores nothing)
                    ray.get(actor.score_batch.remote([], [], [], []), timeout=self.start_timeout_s)
                except ray.exceptions.GetTimeoutError:
                    ray.kill(actor)
                    raise RuntimeError(
                        f"the reward model actor for {self.path!r} did not start within {self.start_timeout_s:g} s "
                        f"(it reserves num_cpus={self.num_cpus:g}, num_gpus={self.num_gpus:g}: does the cluster "
                        "have them free?)") from None
                self._actor = actor
            return self._actor

    def score_batch(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str],
                    finish_reasons: Sequence[str]) -> list[float]:
        import ray

        actor = self._started()
        try:  # a death is retried by Ray on the restarted actor, max_restarts times
            return ray.get(actor.score_batch.remote(list(prompts), list(completions), list(answers),
                                                    list(finish_reasons)))
        except ray.exceptions.RayActorError as e:
            raise WorkerError(f"the reward model actor for {self.path!r} died and its max_restarts="
                              f"{self.max_restarts} restarts are spent: {str(e).splitlines()[0]}") from None

    def score_steps(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str],
                    finish_reasons: Sequence[str]) -> list[list[list[float]] | BaseException]:
        import ray

        actor = self._started()
        try:
            return ray.get(actor.score_steps.remote(list(prompts), list(completions), list(answers),
                                                    list(finish_reasons)))
        except ray.exceptions.RayActorError as e:
            raise WorkerError(f"the reward model actor for {self.path!r} died and its max_restarts="
                              f"{self.max_restarts} restarts are spent: {str(e).splitlines()[0]}") from None

    @property
    def step_separator(self) -> str | None:
        sep = self.options.get("step_separator")
        return None if sep is None else separator(sep)

    def __call__(self, prompt: str, completion: str, answer: str, finish_reason: str = "stop") -> float:
        value = self.score_batch([prompt], [completion], [answer], [finish_reason])[0]
        if isinstance(value, BaseException):
            raise value
        return value

    def close(self) -> None:
        """Stop the actor (it is also stopped with the Ray cluster)."""
        if self._actor is not None:
            import ray

            ray.kill(self._actor)
            self._actor = None
