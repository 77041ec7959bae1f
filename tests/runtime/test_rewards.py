"""Built-in rewards, the spec syntax, user functions, and error handling."""
from __future__ import annotations

import math
import textwrap
import time

import pytest
import torch

from rldsl.runtime.batch import RolloutBatch
from rldsl.runtime.errors import RewardError
from rldsl.runtime.rewards import (
    RewardFn,
    addition_reward,
    exact_reward,
    extract_final_answer,
    math_reward,
    parse_reward_spec,
)


def make_batch(completions, answers, finish=None, prompts=None) -> RolloutBatch:
    """A RolloutBatch carrying only what rewards read (texts); tensors are placeholders."""
    B = len(completions)
    empty = torch.zeros(B, 1, dtype=torch.long)
    return RolloutBatch(
        prompt_ids=empty, prompt_mask=empty, response_ids=empty, response_mask=empty,
        logprobs=torch.zeros(B, 1),
        finish_reason=finish or ["stop"] * B,
        prompts=prompts or [f"prompt {i}" for i in range(B)],
        completions=list(completions),
        group_size=1,
        answers=list(answers),
    )


def test_exact() -> None:
    assert exact_reward("", " 42\n", "42") == 1.0
    assert exact_reward("", "42.0", "42") == 0.0


def test_addition_needs_exact_text_and_eos() -> None:
    assert addition_reward("1+2=", "3", "3", finish_reason="stop") == 1.0
    assert addition_reward("1+2=", "3", "3", finish_reason="length") == 0.0
    assert addition_reward("1+2=", " 3", "3", finish_reason="stop") == 0.0
    assert addition_reward("1+2=", "33", "3", finish_reason="stop") == 0.0


@pytest.mark.parametrize(
    ("completion", "found"),
    [
        (r"so \boxed{\frac{1}{2}} done", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{ {2}+1 }", "{2}+1"),  # last box, nested braces
        ("first 3, then -4.5 and 1,000", "1,000"),
        (r"cut off \boxed{12", "12"),  # unbalanced box: falls back to the last number
        ("no answer", None),
    ],
)
def test_extract_final_answer(completion, found) -> None:
    assert extract_final_answer(completion) == found


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        (r"The answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{x^2+1}", "1+x^2", 1.0),
        (r"\boxed{\sqrt{2}}", r"\sqrt 2", 1.0),
        ("so 6 * 7 = 42", "42", 1.0),
        ("total: 1,000 apples", "1000", 1.0),
        ("it is 41", "42", 0.0),
        (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
        ("I do not know", "42", 0.0),
        (r"\boxed{\frac{{{}", "42", 0.0),  # garbage: 0, not an exception
        (r"\boxed{)(*&}", r"\frac{1}{2}", 0.0),
    ],
)
def test_math(completion, answer, reward) -> None:
    assert math_reward("", completion, answer) == reward


def test_math_is_fast() -> None:
    math_reward("", r"\boxed{\frac{1}{2}}", "0.5")  # import and warm up
    start = time.perf_counter()
    for i in range(50):
        math_reward("", rf"\boxed{{\frac{{{i}}}{{2}}}}", str(i / 2))
        math_reward("", f"answer {i}", str(i))
    assert time.perf_counter() - start < 5.0


def test_parse_reward_spec() -> None:
    assert parse_reward_spec("math") == [("math", 1.0)]
    assert parse_reward_spec(" math = 0.9 , pkg.mod:fn=0.1") == [("math", 0.9), ("pkg.mod:fn", 0.1)]
    assert parse_reward_spec("exact=-1") == [("exact", -1.0)]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("math,", "empty term"),
        ("=2", "no reward name"),
        ("math=abc", "weight 'abc' of 'math' is not a number"),
        ("math=inf", "must be finite"),
        ("math,math=2", "'math' appears twice"),
    ],
)
def test_bad_specs(spec, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_reward_spec(spec)


def test_unknown_reward_names() -> None:
    with pytest.raises(ValueError, match=r"unknown reward 'maht': use one of \['addition', 'exact', 'gsm8k', 'math'\]"):
        RewardFn("maht")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod_xyz'"):
        RewardFn("no_such_mod_xyz:f")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        RewardFn("math:nope")


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(textwrap.dedent(
        """
        calls = []

        def length(prompt, completion, answer):
            return len(completion) / 10

        def stops(prompt, completion, answer, finish_reason):
            calls.append(finish_reason)
            return 1.0 if finish_reason == "stop" else -1.0

        def kw(prompt, completion, answer, **extra):
            return 0.5 if extra.get("finish_reason") == "stop" else 0.0

        def boom(prompt, completion, answer):
            if completion == "bad":
                raise ZeroDivisionError("division by zero in my reward")
            return 1.0

        def nan(prompt, completion, answer):
            return float("nan") if completion == "bad" else 1.0

        def text(prompt, completion, answer):
            return "high"
        """
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import my_rewards_mod

    return importlib.reload(my_rewards_mod)


def test_weighted_sum_with_user_functions(user_module) -> None:
    batch = make_batch(["3", "12345", "7"], ["3", "5", "7"], finish=["stop", "stop", "length"])
    result = RewardFn("addition=0.5, my_rewards_mod:length=2, my_rewards_mod:stops=-1, my_rewards_mod:kw").score(batch)
    # addition: [1, 0, 0]; length: [.1, .5, .1]; stops: [1, 1, -1]; kw: [.5, .5, 0]
    expected = torch.tensor([0.5 + 0.2 - 1 + 0.5, 0 + 1.0 - 1 + 0.5, 0 + 0.2 + 1 + 0])
    torch.testing.assert_close(result.rewards, expected)
    assert result.rewards.dtype == torch.float32 and result.num_errors == 0
    torch.testing.assert_close(result.components["addition"], torch.tensor([1.0, 0.0, 0.0]))
    assert user_module.calls == ["stop", "stop", "length"]  # finish_reason passed by keyword


def test_error_names_reward_sample_and_texts(user_module) -> None:
    batch = make_batch(["ok", "bad"], ["", ""], prompts=["p0", "x" * 500])
    with pytest.raises(RewardError) as err:
        RewardFn("my_rewards_mod:boom")(batch)
    msg = str(err.value)
    assert "reward 'my_rewards_mod:boom' failed on sample 1" in msg
    assert "ZeroDivisionError: division by zero in my reward" in msg
    assert "'bad'" in msg and "x" * 190 + "..." in msg and "x" * 201 not in msg  # prompt truncated
    assert isinstance(err.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(("name", "match"), [("nan", "non-finite value nan"), ("text", "returned 'high', not a number")])
def test_bad_return_values_raise(user_module, name, match) -> None:
    batch = make_batch(["bad"], [""])
    with pytest.raises(RewardError, match=match):
        RewardFn(f"my_rewards_mod:{name}")(batch)


def test_skip_gives_nan_and_counts(user_module) -> None:
    batch = make_batch(["ok", "bad", "bad", "ok"], [""] * 4)
    result = RewardFn("my_rewards_mod:boom=2,exact", on_error="skip").score(batch)
    assert result.num_errors == 2
    assert [math.isnan(v) for v in result.rewards.tolist()] == [False, True, True, False]
    assert result.rewards[0].item() == 2.0
    assert "failed on sample 1" in result.first_error
    nan_result = RewardFn("my_rewards_mod:nan", on_error="skip").score(batch)
    assert nan_result.num_errors == 2


def test_answers_must_be_set() -> None:
    batch = make_batch(["1"], ["1"])
    batch.answers = []
    with pytest.raises(ValueError, match="set RolloutBatch.answers"):
        RewardFn("exact")(batch)
    with pytest.raises(ValueError, match="on_error"):
        RewardFn("exact", on_error="ignore")
