"""Prompt datasets: loaders (.jsonl, .json, .parquet, local HF ``datasets`` folders) and ``PromptSource``.

A dataset is a list of ``Example(id, prompt, answer)``; ``id`` is the row number in the
loaded file, so it is stable across runs and can be saved (resume, pass-rate cap).

A row's prompt is a string or a list of ``{"role", "content"}`` messages (TRL's
conversational format). ``apply_chat_template`` turns every prompt into the text the model
is fed (``Example.prompt``), keeping the row's own prompt in ``Example.source``; rewards
receive that original (``Example.reward_prompt``), never the templated text.

The standard conversational columns are found without a flag (``data.prompt_key`` and
``data.answer_key`` at their defaults ``prompt`` / ``answer``; :func:`conversational_row`):

- ``prompt`` as a messages list: used as it is;
- ``messages`` (a whole chat, no ``prompt`` column): the prompt is the messages before the
  last assistant turn; that turn's content is the answer when the row has no ``answer``;
- TRL's prompt-completion rows (``prompt`` and ``completion``, strings or messages lists) with
  no ``answer``: the completion's text (an assistant message's content) is the answer.

``PromptSource`` deals batches of P prompts in a seeded order: epoch e visits every
non-excluded example once, in the order of a permutation drawn from (seed, e). Its
position is (epoch, index into that permutation); ``state_dict()`` /
``load_state_dict()`` restore it exactly, excluded ids included.
"""
from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from rldsl.config_files import decode_utf8, too_deep

from ..errors import DataError
from ..models.vision import VisionPrompt
from . import images


@dataclass(frozen=True)
class Example:
    """One prompt; ``id`` is unique within its dataset."""

    id: int
    prompt: str
    answer: str
    source: str | tuple = ""  # the row's prompt before any template ("" = same as prompt)
    # a privileged teacher's prompt (teacher.context_key): the row's prompt with its context column
    # in it (with_context), before any template, and that prompt rendered for the model; "" = none
    teacher_source: str | tuple = ""
    teacher_prompt: str = ""
    # the row's other columns with a plain value (str, number, bool): (name, value) pairs in the
    # file's order; what a spec's group_by=FIELD reads (e.g. a ``role`` column). Not part of the
    # prompt's identity (equality, hash)
    fields: tuple = field(default=(), compare=False)

    def column(self, name: str) -> Any:
        """The value of the row's column ``name``; a DataError naming the columns it has."""
        for k, v in self.fields:
            if k == name:
                return v
        have = ", ".join(repr(k) for k, _ in self.fields) or "none"
        raise DataError(f"prompt {self.id}: no column {name!r} with a plain value (str, number, bool) for "
                        f"group_by={name} (its columns: {have})")

    @property
    def reward_prompt(self) -> str:
        """The prompt a reward function receives: the row's own prompt, untemplated -- a
        string as it is, a messages list as its contents joined by blank lines (roles
        dropped; ``data.system_prompt`` is not part of the row). docs/rewards.md."""
        src = self.row_prompt
        return src if isinstance(src, str) else "\n\n".join(images.content_text(m["content"]) for m in src)

    @property
    def row_prompt(self) -> str | tuple:
        """The row's own prompt, untemplated: a string, or its messages."""
        return self.source if self.source else self.prompt


#: teacher.context_template's default: the row's prompt, then its context column
CONTEXT_TEMPLATE = "{prompt}\n\nReference solution:\n{context}"


def with_context(prompt: str | tuple, context: str, template: str = CONTEXT_TEMPLATE) -> str | tuple:
    """The privileged teacher's prompt of a row (teacher.context_key): ``template`` filled with
    ``{prompt}`` = the row's prompt and ``{context}`` = its context column; of a chat, the last
    user message's content is filled in (the other messages are kept as they are)."""
    if isinstance(prompt, str):
        return template.format(prompt=prompt, context=context)
    messages = [dict(m) for m in prompt]
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
    messages[last]["content"] = template.format(prompt=messages[last]["content"], context=context)
    return tuple(messages)


def rollout_prompts(examples: Iterable[Example], multi_turn: bool) -> list[str | tuple]:
    """What the rollouts start from: each example's prompt rendered for the model, or -- for
    multi-turn episodes (rollout.tools / rollout.env / rollout.agent) -- the row's own prompt,
    which the environment's ``reset`` (or the agent) receives and the episode runner renders
    once, with the tools."""
    return [e.row_prompt if multi_turn else e.prompt for e in examples]


@dataclass
class PromptSplits:
    """A training split and a held-out split (possibly empty)."""

    train: list[Example]
    heldout: list[Example]


# ---------------------------------------------------------------------------- loaders
def _read_rows(path: Path, split: str) -> Iterator[tuple[int, Any]]:
    """Yield (1-based row number, row) from a .jsonl / .parquet file or a datasets folder."""
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if path.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except FileNotFoundError as e:
            raise DataError(f"{path}: not a folder written by datasets.save_to_disk ({e})") from e
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{path}: no split {split!r} (splits: {sorted(ds)})")
            ds = ds[split]
        for i, row in enumerate(ds, start=1):
            yield i, row
    elif path.suffix == ".jsonl":
        with path.open("rb") as f:
            for i, raw in enumerate(f, start=1):
                line = decode_utf8(raw, path, DataError, first_line=i)
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: line {i}: invalid JSON ({e})") from e
                except RecursionError:
                    raise DataError(too_deep(path, i)) from None
    elif path.suffix == ".json":
        yield from enumerate(_json_rows(path, split), start=1)
    elif path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except pyarrow.ArrowException as e:  # not Parquet (magic bytes), a damaged footer or page
            raise DataError(f"{path}: not a readable Parquet file ({e})") from None
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row
    else:
        raise DataError(
            f"{path}: unknown dataset format {path.suffix!r} "
            "(expected .jsonl, .json, .parquet or a datasets.save_to_disk folder)"
        )


def _json_rows(path: Path, split: str) -> list[Any]:
    """The rows of a .json file: a JSON array of rows, or an object holding the rows as its
    one list (``{"data": [...]}``) or per split (``{"train": [...], "test": [...]}``)."""
    try:
        data = json.loads(decode_utf8(path.read_bytes(), path, DataError))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}:{e.colno}: invalid JSON ({e.msg})") from e
    except RecursionError:
        raise DataError(too_deep(path)) from None
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        lists = {k: v for k, v in data.items() if isinstance(v, list)}
        if split in lists:
            return lists[split]
        if len(lists) == 1:
            return next(iter(lists.values()))
        if lists:
            raise DataError(f"{path}: an object with several lists of rows ({', '.join(map(repr, lists))}) "
                            f"and none named after the split {split!r}: keep one list, or an array of rows")
    raise DataError(f"{path}: expected a JSON array of rows (or an object holding one list of rows), "
                    f"got {type(data).__name__}")


#: How every hint names the columns: the config keys, as --set flags.
COLUMN_HINT = ("choose the columns with --set data.prompt_key=COLUMN and --set data.answer_key=COLUMN "
               "(data.answer_key=null: rows without answers)")


def _text_of(value: Any) -> str | None:
    """A completion's text: a string, or the content of the last assistant message of a list."""
    if isinstance(value, str):
        return value
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        contents = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "assistant"]
        if contents and isinstance(contents[-1], str):
            return contents[-1]
    return None


def conversational_row(row: dict[str, Any], where: str, base: Path | None = None) -> tuple[Any, str | None] | None:
    """(prompt, answer found in the chat or None) for a row in a standard conversational
    format with no ``prompt`` column of its own (a ``messages`` chat), or for TRL's
    prompt-completion rows; None when the row is in neither."""
    if "prompt" in row and row["prompt"] is not None:
        completion = row.get("completion")
        return row["prompt"], (_text_of(completion) if completion is not None else None)
    messages = row.get("messages")
    if messages is None:
        return None
    messages = list(_messages(messages, f"{where}: field 'messages'", base))
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:  # no assistant turn: the whole chat is the prompt
        return tuple(messages), None
    if last == 0:
        raise DataError(f"{where}: field 'messages' starts with the assistant turn, so no prompt is "
                        f"left before it; {COLUMN_HINT}")
    return tuple(messages[:last]), messages[last]["content"]


def load_examples(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    split: str = "train",
    context_field: str | None = None,
    context_template: str = CONTEXT_TEMPLATE,
    image_field: str | None = None,
    max_images: int = 8,
) -> list[Example]:
    """Read prompts (and answers) from ``path``: ``.jsonl``, ``.json``, ``.parquet`` or a
    datasets folder.

    ``context_field`` (the config's ``teacher.context_key``): a column each row must have (a
    string or a number) that a privileged teacher sees: ``Example.teacher_source`` is the row's
    prompt with it (:func:`with_context` by ``context_template``), the policy's prompt unchanged.

    ``prompt_field`` / ``answer_field`` are the config's ``data.prompt_key`` /
    ``data.answer_key``; at their defaults the standard conversational columns are found
    (module docstring). ``answer_field=None`` means the task has no reference answers
    (answer ``""``). Answers that are numbers are converted with ``str``. A row missing a
    field, or a prompt that is not a string, raises ``DataError`` naming the file, the row
    (1-based; the line for .jsonl), the fields the row has and the ``--set`` keys that choose
    the columns. ``split`` picks the split of a saved ``DatasetDict`` (or of a .json object).

    Images (docs/vlm.md, data/images.py): user turns may hold image parts, and ``image_field``
    (``data.image_key``) names a column of image paths beside a text prompt; paths are resolved
    against the file's folder, and every image is checked (exists, reads as an image, at most
    ``max_images`` per row: ``data.max_images``) here, before any model loads.
    """
    path = Path(path)
    unit = "line" if path.suffix == ".jsonl" else "row"
    detect = prompt_field == "prompt"  # the standard columns apply when the user chose none
    examples: list[Example] = []
    for row_no, row in _read_rows(path, split):
        where = f"{path}: {unit} {row_no}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with fields, got {type(row).__name__}")
        columns = list(row)  # as in the file, for the messages below
        found = conversational_row(row, where, path.parent) if detect else None
        if found is not None:
            chat_prompt, chat_answer = found
            row = {**row, prompt_field: chat_prompt}
            if answer_field == "answer" and row.get("answer") is None and chat_answer is not None:
                row["answer"] = chat_answer
        wanted = ([prompt_field] + ([answer_field] if answer_field is not None else [])
                  + ([context_field] if context_field is not None else []))
        missing = [f for f in wanted if f not in row or row[f] is None]
        if missing:
            raise DataError(
                f"{where}: missing field {', '.join(map(repr, missing))} "
                f"(the row has: {', '.join(map(repr, columns)) or 'no fields'}); {COLUMN_HINT}"
            )
        prompt = row[prompt_field]
        if not isinstance(prompt, str):
            prompt = _messages(prompt, f"{where}: field {prompt_field!r}", path.parent)
        if image_field is not None:
            if row.get(image_field) is None:
                raise DataError(f"{where}: missing field {image_field!r} (data.image_key; the row has: "
                                f"{', '.join(map(repr, columns))})")
            prompt = images.with_image_column(prompt, row[image_field], where, path.parent, image_field)
        elif not images.prompt_images(prompt):  # a chat whose turns hold the images reads them there
            images.check_unused_columns(row, where, wanted)
        images.check_images(prompt, where, max_images)
        answer = row[answer_field] if answer_field is not None else ""
        if isinstance(answer, (list, dict)):
            raise DataError(
                f"{where}: field {answer_field!r} must be a string or a number, "
                f"got {type(answer).__name__}"
            )
        teacher: str | tuple = ""
        if context_field is not None:
            context = row[context_field]
            if isinstance(context, (list, dict)):
                raise DataError(f"{where}: field {context_field!r} (teacher.context_key) must be a string or a "
                                f"number, got {type(context).__name__}")
            teacher = with_context(prompt, str(context), context_template)
        fields = tuple((k, v) for k, v in row.items()  # plain columns: what group_by=FIELD reads
                       if k not in (prompt_field, answer_field) and isinstance(v, (str, int, float, bool)))
        if isinstance(prompt, str):
            examples.append(Example(id=len(examples), prompt=prompt, answer=str(answer), teacher_source=teacher,
                                    teacher_prompt=teacher if isinstance(teacher, str) else "", fields=fields))
        else:  # rendered by apply_chat_template once the tokenizer is known
            examples.append(Example(id=len(examples), prompt="", answer=str(answer), source=prompt,
                                    teacher_source=teacher, fields=fields))
    if not examples:
        raise DataError(f"{path}: no rows")
    return examples


def _messages(value: Any, where: str, base: Path | None = None) -> tuple:
    """A conversational prompt as a tuple of {"role", "content"} dicts (hashable container); a
    content may be a list of text and image parts (data/images.py; paths resolved against ``base``)."""
    if hasattr(value, "tolist"):  # a numpy array from parquet
        value = value.tolist()
    ok = isinstance(value, (list, tuple)) and len(value) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)
    contents = [m["content"] if isinstance(m["content"], str)
                else images.parts(m["content"], where, base or Path.cwd()) for m in value] if ok else []
    if not ok or any(c is None for c in contents):
        raise DataError(f"{where} must be a string or a non-empty list of "
                        f'{{"role": ..., "content": ...}} messages (a content: a string, or a list of '
                        f'text and image parts), got {str(value)[:80]!r}')
    return tuple({"role": m["role"], "content": c} for m, c in zip(value, contents))


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(example: Example, tokenizer: Any, *, mode: str = "auto",
                  kwargs: dict[str, Any] | None = None, system_prompt: str | None = None) -> Example:
    """The example with ``prompt`` = the text fed to the model, ``source`` = the row's prompt.

    ``mode``: "on" always applies the tokenizer's chat template (an error without one), "off"
    never (messages are joined by blank lines), "auto" applies it when the tokenizer has one.
    The template runs with ``add_generation_prompt=True`` and ``kwargs`` (e.g.
    ``enable_thinking=False``); ``system_prompt`` is prepended as a system message (a row that
    has its own system message keeps it). A BOS token the template writes is removed from the
    text when the tokenizer adds one itself, so that tokenizing ``prompt`` as the engines do
    gives exactly ``apply_chat_template``'s ids.
    """
    source = example.source if example.source else example.prompt
    messages = [{"role": "user", "content": source}] if isinstance(source, str) else [dict(m) for m in source]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    use = mode == "on" or (mode == "auto" and has_chat_template(tokenizer))
    if mode == "on" and not has_chat_template(tokenizer):
        raise DataError("data.chat_template=on but the tokenizer has no chat template "
                        "(use data.chat_template=off, or a model folder whose tokenizer has one)")
    teacher = example.teacher_prompt
    if example.teacher_source:  # a privileged teacher's prompt, rendered the same way
        ts = example.teacher_source
        teacher = render_prompt(Example(example.id, ts if isinstance(ts, str) else "", example.answer, ts), tokenizer,
                                mode=mode, kwargs=kwargs, system_prompt=system_prompt).prompt
    if not use:
        if isinstance(source, str) and not system_prompt:
            return dataclasses.replace(example, teacher_prompt=teacher)
        # one blank line between two messages: a content's own trailing newlines (reasoning-gym's
        # system prompt ends in one) add none
        text = "\n\n".join([images.content_text(m["content"]).rstrip("\n") for m in messages[:-1]]
                           + [images.content_text(messages[-1]["content"])])
    else:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **(kwargs or {}))
        bos = getattr(tokenizer, "bos_token", None)
        if bos and text.startswith(bos) and _adds_bos(tokenizer):
            text = text[len(bos):]
    refs = images.prompt_images(source)  # a prompt with images carries them (data/images.py)
    return Example(id=example.id, prompt=VisionPrompt(text, refs) if refs else text, answer=example.answer,
                   source=source, teacher_source=example.teacher_source, teacher_prompt=teacher,
                   fields=example.fields)


def _adds_bos(tokenizer: Any) -> bool:
    ids = tokenizer("x")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def split_heldout(
    examples: Sequence[Example], heldout: int | float, *, seed: int
) -> tuple[list[Example], list[Example]]:
    """(train, heldout): a fixed, seeded choice of ``heldout`` examples (a count or a fraction in (0, 1)).

    Both lists keep the original order and ids.
    """
    n = len(examples)
    if isinstance(heldout, float) and not isinstance(heldout, bool):
        if not 0.0 <= heldout < 1.0:
            raise ValueError(f"held-out fraction must be in [0, 1), got {heldout}")
        k = round(n * heldout)
    else:
        k = int(heldout)
    if not 0 <= k < n:
        raise ValueError(f"cannot hold out {k} of {n} examples (at least one must remain for training)")
    chosen = set(random.Random(seed).sample(range(n), k))
    train = [ex for i, ex in enumerate(examples) if i not in chosen]
    held = [ex for i, ex in enumerate(examples) if i in chosen]
    return train, held


def load_prompts(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    split: str = "train",
    heldout_path: str | Path | None = None,
    heldout: int | float = 0,
    seed: int = 0,
) -> PromptSplits:
    """Load a training set and its held-out split.

    The held-out split is ``heldout_path`` (same field names) if given, else ``heldout``
    examples (a count, or a fraction) taken out of ``path`` by ``seed``; else empty.
    """
    examples = load_examples(path, prompt_field=prompt_field, answer_field=answer_field, split=split)
    if heldout_path is not None:
        if heldout:
            raise ValueError("give either heldout_path or heldout, not both")
        held = load_examples(
            heldout_path, prompt_field=prompt_field, answer_field=answer_field, split=split
        )
        return PromptSplits(train=examples, heldout=held)
    train, held = split_heldout(examples, heldout, seed=seed)
    return PromptSplits(train=train, heldout=held)


# ------------------------------------------------------------------------ PromptSource
class PromptSource:
    """Deterministic, resumable, endless batches of prompts.

    Epoch e is the permutation ``random.Random(f"{seed}:{e}")`` of the examples; a batch
    takes the next P non-excluded examples and runs into the next epoch when one ends.
    ``exclude(ids)`` removes examples from everything not yet dealt (the pass-rate cap:
    a prompt already dealt this epoch is not dealt again until the next epoch anyway).
    """

    def __init__(self, examples: Sequence[Example], *, seed: int, name: str = "prompts") -> None:
        if not examples:
            raise ValueError(f"{name}: a PromptSource needs at least one example")
        ids = [ex.id for ex in examples]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{name}: example ids must be unique")
        self.examples: list[Example] = list(examples)
        self.seed = seed
        self.name = name
        self.epoch = 0
        self.index = 0
        self.excluded: set[int] = set()
        self._by_id = {ex.id: k for k, ex in enumerate(self.examples)}
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        """Number of examples still dealt (not excluded)."""
        return len(self.examples) - len(self.excluded)

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(len(self.examples)))
            random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def next_batch(self, num_prompts: int) -> list[Example]:
        """The next ``num_prompts`` examples (an epoch boundary may fall inside a batch)."""
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        if len(self) == 0:
            raise RuntimeError(f"{self.name}: every prompt is excluded; nothing left to train on")
        batch: list[Example] = []
        while len(batch) < num_prompts:
            order = self._epoch_order()
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
                continue
            ex = self.examples[order[self.index]]
            self.index += 1
            if ex.id not in self.excluded:
                batch.append(ex)
        return batch

    def exclude(self, prompt_ids: Iterable[int]) -> None:
        """Never deal these example ids again (unknown ids raise ``KeyError``)."""
        ids = set(prompt_ids)
        unknown = ids - self._by_id.keys()
        if unknown:
            raise KeyError(f"{self.name}: unknown example ids {sorted(unknown)[:5]}")
        self.excluded |= ids

    def observe(self, prompt_ids: Sequence[int], rewards: Any) -> dict[str, float]:
        """Read a step's rewards ``[P, G]`` of prompts ``prompt_ids``; returns metrics to log. A
        plain source has none (a generated one reports per-task metrics and moves its curriculum:
        reasoning_gym.py)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The position and exclusions, JSON-serialisable."""
        return {
            "name": self.name,
            "seed": self.seed,
            "num_examples": len(self.examples),
            "epoch": self.epoch,
            "index": self.index,
            "excluded": sorted(self.excluded),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; the examples must be the same dataset."""
        if state["num_examples"] != len(self.examples) or state["seed"] != self.seed:
            raise ValueError(
                f"{self.name}: saved position is for {state['num_examples']} examples with seed "
                f"{state['seed']}, this source has {len(self.examples)} with seed {self.seed}"
            )
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self.excluded = set()
        self.exclude(state["excluded"])
