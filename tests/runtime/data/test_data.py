"""Loaders (.jsonl, .parquet, datasets folders), held-out splits and PromptSource order/resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rldsl.runtime.data.datasets import (
    Example,
    PromptSource,
    load_examples,
    load_prompts,
    split_heldout,
)
from rldsl.runtime.errors import DataError
from rldsl.runtime.toy import AdditionTask

ROWS = [
    {"question": "1+1=", "solution": 2, "extra": "x"},
    {"question": "2+3=", "solution": "5", "extra": "y"},
    {"question": "what is 7*6?", "solution": "42", "extra": "z"},
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _hf_folder(path: Path, rows: list[dict], split: str | None = None) -> Path:
    import datasets

    ds = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({split: ds}) if split else ds).save_to_disk(str(path))
    return path


EXPECTED = [
    Example(0, "1+1=", "2"),  # a number answer becomes a string
    Example(1, "2+3=", "5"),
    Example(2, "what is 7*6?", "42"),
]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf", "hf_dict"])
def test_loaders_with_custom_fields(tmp_path, kind) -> None:
    rows = [{k: (str(v) if kind != "jsonl" else v) for k, v in r.items()} for r in ROWS]
    path = {
        "jsonl": lambda: _jsonl(tmp_path / "d.jsonl", ROWS),
        "parquet": lambda: _parquet(tmp_path / "d.parquet", rows),
        "hf": lambda: _hf_folder(tmp_path / "d", rows),
        "hf_dict": lambda: _hf_folder(tmp_path / "d", rows, split="train"),
    }[kind]()
    assert load_examples(path, prompt_field="question", answer_field="solution") == EXPECTED


def test_no_answer_field(tmp_path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    assert load_examples(path, answer_field=None) == [Example(0, "a", ""), Example(1, "b", "")]


def test_jsonl_missing_field_names_file_line_and_fields(tmp_path) -> None:
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}, {"prompt": "c", "label": "3"}]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n" + json.dumps(rows[2]) + "\n")
    with pytest.raises(DataError) as err:
        load_examples(path)
    msg = str(err.value)
    assert str(path) in msg and "line 4" in msg  # the blank line 2 still counts
    assert "missing field 'answer'" in msg and "'prompt', 'label'" in msg


def test_parquet_missing_field_names_row(tmp_path) -> None:
    path = _parquet(tmp_path / "d.parquet", [{"q": "a", "a": "1"}, {"q": "b", "a": None}])
    with pytest.raises(DataError, match=r"d\.parquet: row 2: missing field 'a' \(the row has: 'q', 'a'\)"):
        load_examples(path, prompt_field="q", answer_field="a")


def test_hf_folder_missing_split(tmp_path) -> None:
    path = _hf_folder(tmp_path / "d", [{"prompt": "a", "answer": "1"}], split="test")
    with pytest.raises(DataError, match=r"no split 'train' \(splits: \['test'\]\)"):
        load_examples(path)


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("bad.jsonl", '{"prompt": "a", "answer": "1"}\n{not json\n', "line 2: invalid JSON"),
        ("list.jsonl", "[1, 2]\n", "line 1: expected an object"),
        ("num.jsonl", '{"prompt": 3, "answer": "1"}\n', "'prompt' must be a string"),
        ("empty.jsonl", "\n", "no rows"),
        ("d.csv", "prompt,answer\n", "unknown dataset format '.csv'"),
    ],
)
def test_bad_files(tmp_path, name, content, match) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=match):
        load_examples(path)


@pytest.mark.parametrize(("name", "content", "match"), [
    ("latin.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9"}\n', r"latin\.jsonl:2:16: not UTF-8 text \(byte 0xe9\)"),
    ("latin.json", b'[{"prompt": "a"},\n {"prompt": "\xff"}]', r"latin\.json:2:14: not UTF-8 text \(byte 0xff\)"),
    ("deep.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}\n",
     r"deep\.jsonl:2: lists or tables nested too deeply"),
    ("deep.json", b"[" * 5000 + b"]" * 5000, r"deep\.json: lists or tables nested too deeply"),
    ("fake.parquet", b"prompt,answer\na,1\n", r"fake\.parquet: not a readable Parquet file \(.*magic bytes"),
])
def test_unreadable_bytes_name_the_file_and_line(tmp_path, name, content, match) -> None:
    """Python's UnicodeDecodeError / RecursionError / pyarrow's ArrowInvalid were exit 1 naming no file."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=match):
        load_examples(path)


def test_a_cut_parquet_file_is_a_data_error(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.table({"prompt": ["a"] * 100, "answer": ["1"] * 100}), whole)
    raw = whole.read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(raw[: len(raw) // 2] + raw[-8:])  # the footer's length and magic kept, its body gone
    with pytest.raises(DataError, match=r"cut\.parquet: not a readable Parquet file"):
        load_examples(cut)


def test_missing_file(tmp_path) -> None:
    with pytest.raises(DataError, match="no such file"):
        load_examples(tmp_path / "nope.jsonl")


def _examples(n: int) -> list[Example]:
    return [Example(i, f"p{i}", str(i)) for i in range(n)]


def test_split_heldout_count_fraction_and_seed() -> None:
    data = _examples(50)
    train, held = split_heldout(data, 10, seed=0)
    assert len(held) == 10 and len(train) == 40
    assert sorted(train + held, key=lambda e: e.id) == data
    assert [e.id for e in train] == sorted(e.id for e in train)  # original order kept
    assert split_heldout(data, 0.2, seed=0) == (train, held)  # 0.2 * 50 = 10, same draw
    assert split_heldout(data, 10, seed=1)[1] != held
    assert split_heldout(data, 0, seed=0) == (data, [])
    with pytest.raises(ValueError, match="at least one must remain"):
        split_heldout(data, 50, seed=0)


def test_load_prompts_heldout_file_or_split(tmp_path) -> None:
    train_path = _jsonl(tmp_path / "t.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)])
    held_path = _jsonl(tmp_path / "h.jsonl", [{"prompt": "h", "answer": "0"}])
    data = load_prompts(train_path, heldout_path=held_path)
    assert len(data.train) == 10 and data.heldout == [Example(0, "h", "0")]
    data = load_prompts(train_path, heldout=3, seed=5)
    assert len(data.train) == 7 and len(data.heldout) == 3
    with pytest.raises(ValueError, match="not both"):
        load_prompts(train_path, heldout_path=held_path, heldout=3)


def _deal(source: PromptSource, num_batches: int, P: int) -> list[list[int]]:
    return [[e.id for e in source.next_batch(P)] for _ in range(num_batches)]


def test_epochs_are_permutations_and_seeded() -> None:
    source = PromptSource(_examples(12), seed=3)
    ids = sum(_deal(source, 6, 4), [])  # two epochs of 12
    assert sorted(ids[:12]) == sorted(ids[12:]) == list(range(12))
    assert ids[:12] != ids[12:]  # each epoch reshuffled
    assert (source.epoch, source.index) == (1, 12)  # the next epoch starts on the next call
    assert sum(_deal(PromptSource(_examples(12), seed=3), 6, 4), []) == ids
    assert sum(_deal(PromptSource(_examples(12), seed=4), 6, 4), []) != ids


def test_batch_runs_across_epoch_boundary() -> None:
    source = PromptSource(_examples(5), seed=0)
    ids = sum(_deal(source, 3, 4), [])  # 12 prompts from epochs 0, 1 and 2
    assert sorted(ids[:5]) == sorted(ids[5:10]) == list(range(5))


def test_exclude_removes_from_later_batches_and_resume_keeps_it() -> None:
    source = PromptSource(_examples(10), seed=0)
    first = _deal(source, 1, 4)[0]
    source.exclude([first[0], 9])
    later = sum(_deal(source, 10, 4), [])
    assert first[0] not in later and 9 not in later
    assert len(source) == 8
    restored = PromptSource(_examples(10), seed=0)
    restored.load_state_dict(json.loads(json.dumps(source.state_dict())))
    assert _deal(restored, 5, 3) == _deal(source, 5, 3)
    with pytest.raises(KeyError, match="unknown example ids"):
        source.exclude([99])
    source.exclude(range(10))
    with pytest.raises(RuntimeError, match="every prompt is excluded"):
        source.next_batch(1)


def test_load_state_dict_refuses_another_dataset() -> None:
    state = PromptSource(_examples(10), seed=0).state_dict()
    with pytest.raises(ValueError, match="saved position is for 10 examples"):
        PromptSource(_examples(11), seed=0).load_state_dict(state)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 30),
    P=st.integers(1, 8),
    seed=st.integers(0, 2**31),
    before=st.integers(0, 12),
    excluded=st.sets(st.integers(0, 29), max_size=5),
)
def test_resume_is_exact(n, P, seed, before, excluded) -> None:
    """Saving after any number of batches and restoring gives the same future batches."""
    source = PromptSource(_examples(n), seed=seed)
    _deal(source, before, P)
    drop = {i for i in excluded if i < n}
    if len(drop) < n:
        source.exclude(drop)
    state = json.loads(json.dumps(source.state_dict()))
    restored = PromptSource(_examples(n), seed=seed)
    restored.load_state_dict(state)
    assert _deal(restored, 6, P) == _deal(source, 6, P)


def test_toy_task_plugs_in_as_prompt_source() -> None:
    task = AdditionTask()
    heldout = {e.prompt for e in task.heldout_examples()}
    source = task.prompt_source(seed=0)
    dealt = [e for _ in range(20) for e in source.next_batch(16)]
    assert all(e.prompt not in heldout for e in dealt)
    assert all(str(sum(map(int, e.prompt[:-1].split("+")))) == e.answer for e in dealt)


# ------------------------------------------------------------ conversational columns, .json
SYSTEM = {"role": "system", "content": "be brief."}
USER = {"role": "user", "content": "what is 2+3?"}
ASSISTANT = {"role": "assistant", "content": "5"}


def test_messages_column_is_the_prompt_up_to_the_last_assistant_turn(tmp_path) -> None:
    follow_up = [USER, ASSISTANT, {"role": "user", "content": "and 3+4?"},
                 {"role": "assistant", "content": "7"}]
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": [SYSTEM, USER, ASSISTANT]},
                                         {"messages": follow_up, "answer": "seven"},
                                         {"messages": [USER], "answer": "5"}])
    assert load_examples(path) == [
        Example(0, "", "5", source=(SYSTEM, USER)),  # the assistant's turn is the answer
        Example(1, "", "seven", source=tuple(follow_up[:3])),  # an answer column wins
        Example(2, "", "5", source=(USER,)),  # no assistant turn: the whole chat is the prompt
    ]


def test_messages_without_an_answer_anywhere_names_the_set_keys(tmp_path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": [USER]}])
    with pytest.raises(DataError) as err:
        load_examples(path)
    msg = str(err.value)
    assert "missing field 'answer' (the row has: 'messages')" in msg
    assert "--set data.prompt_key=COLUMN and --set data.answer_key=COLUMN" in msg
    assert "prompt_field" not in msg and "answer_field" not in msg
    assert load_examples(path, answer_field=None) == [Example(0, "", "", source=(USER,))]
    starts = _jsonl(tmp_path / "s.jsonl", [{"messages": [ASSISTANT]}])
    with pytest.raises(DataError, match="starts with the assistant turn"):
        load_examples(starts)


def test_trl_prompt_completion_rows(tmp_path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": [SYSTEM, USER], "completion": [ASSISTANT]},  # conversational
        {"prompt": "12+3=", "completion": "15"},  # standard
        {"prompt": [USER], "completion": [ASSISTANT], "answer": "five"},  # an answer column wins
    ])
    assert load_examples(path) == [Example(0, "", "5", source=(SYSTEM, USER)), Example(1, "12+3=", "15"),
                                   Example(2, "", "five", source=(USER,))]


def test_a_chosen_prompt_key_turns_detection_off(tmp_path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": [USER, ASSISTANT]}])
    with pytest.raises(DataError, match=r"missing field 'question', 'answer' \(the row has: 'messages'\); "
                                        r"choose the columns with --set data.prompt_key"):
        load_examples(path, prompt_field="question")
    assert load_examples(path, prompt_field="messages", answer_field=None) == [
        Example(0, "", "", source=(USER, ASSISTANT))]


@pytest.mark.parametrize("layout", ["array", "one_list", "splits"])
def test_json_files(tmp_path, layout) -> None:
    rows = [{"prompt": "a", "answer": 1}, {"messages": [USER, ASSISTANT]}]
    data = {"array": rows, "one_list": {"data": rows, "version": 2},
            "splits": {"train": rows, "test": rows[:1]}}[layout]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(data))
    assert load_examples(path) == [Example(0, "a", "1"), Example(1, "", "5", source=(USER,))]


@pytest.mark.parametrize(("content", "match"), [
    ('{"a": [], "b": []}', r"several lists of rows \('a', 'b'\) and none named after the split 'train'"),
    ('"text"', "expected a JSON array of rows"),
    ('[{"prompt": "a", "answer": "1"},', r"d\.json:1:\d+: invalid JSON"),
    ('[1]', "row 1: expected an object"),
])
def test_bad_json_files(tmp_path, content, match) -> None:
    path = tmp_path / "d.json"
    path.write_text(content)
    with pytest.raises(DataError, match=match):
        load_examples(path)
