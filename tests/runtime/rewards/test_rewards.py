"""Built-in rewards, the spec syntax, user functions, and error handling."""
from __future__ import annotations

import math
import re
import sys
import textwrap
import time

import pytest
import torch

from rldsl.runtime.batch import RolloutBatch
from rldsl.runtime.errors import RewardError, RewardSpecError
from rldsl.runtime.rewards.functions import RewardFn
from rldsl.runtime.rewards.spec import parse_reward_spec
from rldsl.runtime.rewards.verify import (
    addition_reward,
    exact_reward,
    extract_final_answer,
    find_final_answer,
    gsm8k_reward,
    judge_gsm8k,
    judge_math,
    math_reward,
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
    ("completion", "found", "rule"),
    [
        (r"so \boxed{\frac{1}{2}} done", r"\frac{1}{2}", "boxed"),
        (r"\boxed{1} then \boxed{ {2}+1 }", "{2}+1", "boxed"),  # the last box, nested braces
        (r"\boxed{3} and finally \boxed{12", None, "not closed"),  # the final box was cut off
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", "####"),
        ("#### 1,000\n", "1,000", "####"),
        ("Answer: 2/3", "2/3", "anchored"),
        ("The answer is 12, which is even.", "12", "anchored"),
        ("Step 1 gives 5. The final answer is $\\frac{2}{3}$. I hope it is correct.", r"\frac{2}{3}", "anchored"),
        ("**Answer:** 17 apples.", "17", "anchored"),
        ("The answer is: -3.5", "-3.5", "anchored"),
        ("answer: x = 5", "5", "anchored"),
        ("The answer is 4. Earlier I thought the answer is 3, but answer: 7", "7", "anchored"),  # the last anchor
        ("The answer is unclear", None, "nothing math-like"),
        ("42", "42", "whole"),
        ("  $-3.5$.\n", "-3.5", "whole"),
        (r"\frac{2}{3}", r"\frac{2}{3}", "whole"),
        ("3*4 = 12", "12", "whole"),
        ("first 3, then -4.5 and 1,000", None, "free text"),  # no last-number fallback
        ("Step 1: 3*4 = 12. Step 2: 12 + 5 = 17, so", None, "free text"),
        ("The roots are x = 1,2", None, "free text"),
        ("", None, "free text"),
    ],
)
def test_find_final_answer(completion, found, rule) -> None:
    got = find_final_answer(completion)
    assert got.text == found
    assert extract_final_answer(completion) == found
    key = {"boxed": "\\boxed{}", "####": "'####'", "anchored": "anchored", "whole": "the whole completion",
           "free text": "a number inside free text is not taken", "not closed": "not closed",
           "nothing math-like": "nothing math-like"}[rule]
    assert key in got.rule


# (completion, answer, finish_reason, reward): the cases first
MATH_CASES = [
    # reasoning cut off at the length limit: 17 is a step, not an answer
    ("Step 1: 3*4 = 12. Step 2: 12 + 5 = 17, so", "17", "length", 0.0),
    ("Step 1: 3*4 = 12. Step 2: 12 + 5 = 17, so", "17", "stop", 0.0),  # and not anchored either
    # a comma list is not the thousands-separated number 12
    ("The roots are x = 1,2", "12", "stop", 0.0),
    ("The answer is 1,2", "12", "stop", 0.0),
    (r"The answer is \boxed{1,2}", r"\{1, 2\}", "stop", 1.0),  # ... but equals the set {1, 2}
    ("total: 1,000 apples. Answer: 1,000", "1000", "stop", 1.0),  # thousands separator
    # fractions
    ("Answer: 2/3", r"\frac{2}{3}", "stop", 1.0),
    (r"The answer is $\dfrac{4}{6}$.", "2/3", "stop", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", "stop", 1.0),
    (r"The answer is \boxed{\frac{1}{2}}.", "0.5", "stop", 1.0),
    (r"\boxed{\frac{1}{3}}", "0.5", "stop", 0.0),
    ("Answer: 0.333", "1/3", "stop", 0.0),  # exact rationals: a rounding is not the fraction
    # \boxed{} (expressions through math_verify)
    (r"\boxed{x^2+1}", "1+x^2", "stop", 1.0),
    (r"\boxed{\sqrt{2}}", r"\sqrt 2", "stop", 1.0),
    (r"First \boxed{3}, corrected: \boxed{4}", "4", "stop", 1.0),
    (r"First \boxed{4}, then \boxed{3", "4", "stop", 0.0),  # the final box is unclosed
    (r"\boxed{\frac{{{}", "42", "stop", 0.0),  # garbage: 0, not an exception
    (r"\boxed{)(*&}", r"\frac{1}{2}", "stop", 0.0),
    # plain final answers
    ("42", "42", "stop", 1.0),
    ("42", "42", "length", 0.0),  # cut off: the next token might have been another digit
    (" 42.0\n", "42", "stop", 1.0),
    ("it is 41", "42", "stop", 0.0),
    ("so 6 * 7 = 42", "42", "stop", 0.0),  # free text: no credit without an anchor
    ("6 * 7 = 42", "42", "stop", 1.0),  # the whole completion is an equation
    ("I do not know", "42", "stop", 0.0),
    ("The answer is 42 because 6 * 7 = 42.", "42", "stop", 1.0),
    ("The final answer: $x = -3$", "-3", "stop", 1.0),
    # GSM8K style
    ("She has 6 * 7 = 42 apples.\n#### 42", "42", "stop", 1.0),
    ("#### 42", "41", "stop", 0.0),
    ("The cost is 1,200 dollars.\n#### 1,200", "1200", "stop", 1.0),
]


@pytest.mark.parametrize(("completion", "answer", "finish", "reward"), MATH_CASES)
def test_math(completion, answer, finish, reward) -> None:
    assert math_reward("", completion, answer, finish_reason=finish) == reward


def test_math_credits_cut_off_answers_when_asked() -> None:
    cut = ("Step 1: 3*4 = 12. Answer: 17, and", "17")
    assert math_reward("", *cut, finish_reason="length") == 0.0
    assert math_reward("", *cut, finish_reason="length", allow_truncated=True) == 1.0
    fn = RewardFn("math(allow_truncated=true)")
    batch = make_batch([cut[0], cut[0]], [cut[1], cut[1]], finish=["length", "stop"])
    assert fn(batch).tolist() == [1.0, 1.0]
    assert RewardFn("math")(batch).tolist() == [0.0, 1.0]


@pytest.mark.parametrize(("completion", "answer", "reward"), [
    ("48/2 = 24 in May, 48 + 24 = 72 in all.\n#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
    ("The answer is 72.", "She sold 48+24 = 72 clips altogether.\n#### 72", 1.0),
    (r"\boxed{72}", "#### 72", 1.0),
    ("#### 70", "48/2 = 24 clips.\n#### 72", 0.0),
    ("#### 1,000", "#### 1000", 1.0),
    ("The answer is 72.", "72", 1.0),  # a bare number column works too
])
def test_gsm8k(completion, answer, reward) -> None:
    assert gsm8k_reward("", completion, answer) == reward
    assert gsm8k_reward("", completion, answer, finish_reason="length") == 0.0


def test_verdicts_say_why() -> None:
    v = judge_math("Answer: 2/3", r"\frac{2}{3}")
    assert (v.reward, v.extracted, v.gold, v.why) == (1.0, "2/3", r"\frac{2}{3}", "equal numbers")
    assert "anchored" in v.rule
    v = judge_math("Step 2: 12 + 5 = 17, so", "17", finish_reason="length")
    assert v.reward == 0.0 and "cut off" in v.why
    v = judge_gsm8k("#### 72", "She sold 72 clips.\n#### 72")
    assert (v.reward, v.gold) == (1.0, "72")
    assert judge_math(r"\boxed{x+1}", "1+x").why == "math_verify: equivalent"
    assert judge_math("it is 41", "42").why == "no final answer"


def test_math_is_fast() -> None:
    math_reward("", r"\boxed{\frac{1}{2}}", "0.5")  # import and warm up
    start = time.perf_counter()
    for i in range(50):
        math_reward("", rf"\boxed{{\frac{{{i}}}{{2}}}}", str(i / 2))
        math_reward("", f"The answer is {i}", str(i))
    assert time.perf_counter() - start < 5.0


def test_parse_reward_spec() -> None:
    assert parse_reward_spec("math") == [("math", 1.0)]
    assert parse_reward_spec(" math = 0.9 , pkg.mod:fn=0.1") == [("math", 0.9), ("pkg.mod:fn", 0.1)]
    assert parse_reward_spec("exact=-1") == [("exact", -1.0)]
    assert parse_reward_spec("math(allow_truncated=true, x=1)=2,exact") == [
        ("math(allow_truncated=true, x=1)", 2.0), ("exact", 1.0)]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("math,", "empty term"),
        ("=2", "no reward name"),
        ("math=abc", "weight 'abc' of 'math' is not a number"),
        ("math=inf", "must be finite"),
        ("math,math=2", "'math' appears twice"),
        ("math(allow_truncated=true", "unclosed '\\('"),
        ("math)=2", "unbalanced '\\)'"),
    ],
)
def test_bad_specs(spec, match) -> None:
    with pytest.raises(ValueError, match=match):
        parse_reward_spec(spec)


def test_unknown_reward_names() -> None:
    with pytest.raises(ValueError, match=r"unknown reward 'maht': use one of \['addition', 'exact', 'gsm8k', 'math', 'reasoning_gym'\]"):
        RewardFn("maht")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod_xyz'"):
        RewardFn("no_such_mod_xyz:f")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        RewardFn("math:nope")


def test_reward_options() -> None:
    with pytest.raises(ValueError, match="reward 'math' has no option 'strict'; its options: allow_truncated"):
        RewardFn("math(strict=true)")
    with pytest.raises(ValueError, match="reward 'exact' has no option 'x'; its options: none"):
        RewardFn("exact(x=1)")
    with pytest.raises(ValueError, match="option 'allow_truncated' is not key=value"):
        RewardFn("math(allow_truncated)")
    with pytest.raises(ValueError, match="option 'a' given twice"):
        RewardFn("math(a=1, a=2)")
    fn = RewardFn("math(allow_truncated=true)=0.5,exact")
    assert [t.name for t in fn.terms] == ["math(allow_truncated=true)", "exact"]
    assert fn.terms[0].takes_finish_reason  # the bound function still gets finish_reason
    cut = make_batch(["Answer: 3", "Answer: 3"], ["3", "3"], finish=["length", "stop"])
    assert fn.score(cut).components["math(allow_truncated=true)"].tolist() == [1.0, 1.0]


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

        def numeric_text(prompt, completion, answer):
            return "1.0"
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
    expected = torch.tensor([0.5 + 0.2 - 1 + 0.5, 0 + 1.0 - 1 + 0.5, 0 + 0.2 + 1 + 0], dtype=torch.float64)
    torch.testing.assert_close(result.rewards, expected)
    assert result.rewards.dtype == torch.float64 and result.num_errors == 0  # the values as returned
    torch.testing.assert_close(result.components["addition"], torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
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


@pytest.mark.parametrize(("name", "match"), [("nan", "non-finite value nan"), ("text", "returned 'high' .a str., not a number"),
                                             ("numeric_text", "returned '1.0' .a str., not a number")])
def test_bad_return_values_raise(user_module, name, match) -> None:
    batch = make_batch(["bad"], [""])
    with pytest.raises(RewardError, match=match):
        RewardFn(f"my_rewards_mod:{name}")(batch)


def test_one_check_of_a_reward_value_accepts_numbers_and_refuses_text() -> None:
    """rewards/values.py reward_value, what docs/rewards.md lists: every path that produces a
    reward (functions, the env term's environments and agents, reward servers) calls it."""
    import numpy as np

    from rldsl.runtime.rewards.values import reward_value

    accepted = [(1, 1.0), (0.25, 0.25), (True, 1.0), (False, 0.0), (np.float32(0.5), 0.5), (np.int64(2), 2.0),
                (np.bool_(True), 1.0), (torch.tensor(0.75), 0.75)]
    for value, number in accepted:
        got = reward_value(value, "x")
        assert got == number and type(got) is float, value
    text = "not a number: text is not a score"
    refused = [("1.0", text), (b"1", text), (np.str_("1"), text), (None, "not a number"), ([1.0], "not a number"),
               (torch.ones(2), "not a number"), (1j, "not a number")]
    for value, why in refused:
        said = f"the agent returned {value!r} (a {type(value).__name__}), {why}"
        with pytest.raises(ValueError, match=f"^{re.escape(said)}$"):
            reward_value(value, "the agent")
    for value in (float("nan"), float("inf"), np.float32("-inf")):
        with pytest.raises(ValueError, match=f"^the agent returned a non-finite value {float(value)}$"):
            reward_value(value, "the agent")


def test_skip_gives_nan_and_counts(user_module) -> None:
    batch = make_batch(["ok", "bad", "bad", "ok"], [""] * 4)
    result = RewardFn("my_rewards_mod:boom=2,exact", on_error="skip").score(batch)
    assert result.num_errors == 2
    assert [math.isnan(v) for v in result.rewards.tolist()] == [False, True, True, False]
    assert result.rewards[0].item() == 2.0
    assert "failed on sample 1" in result.first_error
    nan_result = RewardFn("my_rewards_mod:nan", on_error="skip").score(batch)
    assert nan_result.num_errors == 2


def test_a_reward_that_calls_sys_exit_fails_its_sample(tmp_path, monkeypatch) -> None:
    """sys.exit() in a reward function (or its module, on import) is that code's error: said with
    the sample and skipped like any other failure, never the run's silent end with its exit code."""
    (tmp_path / "exiting_rewards.py").write_text(textwrap.dedent("""
        import sys

        def bye(prompt, completion, answer):
            if completion == "bad":
                sys.exit(0)
            return 1.0

        def three(prompt, completion, answer):
            raise SystemExit(3)
        """))
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    batch = make_batch(["ok", "bad"], ["", ""])
    with pytest.raises(RewardError, match=r"failed on sample 1: RuntimeError: the function called sys.exit\(0\)"):
        RewardFn("exiting_rewards:bye").score(batch)
    with pytest.raises(RewardError, match=r"sample 0: RuntimeError: the function called sys.exit\(3\)"):
        RewardFn("exiting_rewards:three").score(batch)
    skipped = RewardFn("exiting_rewards:bye", on_error="skip").score(batch)
    assert skipped.rewards[0].item() == 1.0 and math.isnan(skipped.rewards[1]) and skipped.num_errors == 1
    with pytest.raises(RewardSpecError, match="importing module 'exits_on_import' failed: SystemExit: 2"):
        RewardFn("exits_on_import:f")
    with pytest.raises(RewardSpecError, match="failed: SystemExit: 2"):
        RewardFn(f"{tmp_path / 'exits_on_import.py'}:f")


def test_answers_must_be_set() -> None:
    batch = make_batch(["1"], ["1"])
    batch.answers = []
    with pytest.raises(ValueError, match="set RolloutBatch.answers"):
        RewardFn("exact")(batch)
    with pytest.raises(ValueError, match="on_error"):
        RewardFn("exact", on_error="ignore")


# ------------------------------------------------------------ the user's own reward modules
DIGITS = "def digits(prompt, completion, answer):\n    return float(sum(c.isdigit() for c in completion))\n"


def test_module_beside_the_command_is_found(tmp_path, monkeypatch) -> None:
    (tmp_path / "myreward_beside.py").write_text(DIGITS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "myreward_beside", raising=False)
    fn = RewardFn("myreward_beside:digits")
    assert fn.terms[0].fn("p", "a1b22", "x") == 3.0


def test_path_form_loads_the_file(tmp_path, monkeypatch) -> None:
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "fmt.py").write_text(DIGITS + "HELPER = 1\n")
    monkeypatch.chdir(tmp_path)
    fn = RewardFn("rewards/fmt.py:digits=0.5")
    assert fn.terms[0].weight == 0.5 and fn.terms[0].fn("p", "12", "x") == 2.0
    absolute = RewardFn(f"{tmp_path / 'rewards' / 'fmt.py'}:digits")
    assert absolute.terms[0].fn("p", "7", "x") == 1.0
    with pytest.raises(RewardSpecError, match=r"has no function 'nope'; its functions: digits"):
        RewardFn("rewards/fmt.py:nope")
    with pytest.raises(RewardSpecError) as err:
        RewardFn("rewards/missing.py:digits")
    assert f"file not found: {tmp_path / 'rewards' / 'missing.py'}" in str(err.value)
    assert f"relative to the current folder {tmp_path}" in str(err.value)


def test_import_failures_say_where_and_why(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardSpecError) as err:
        RewardFn("no_such_reward_module:digits")
    msg = str(err.value)
    assert f"no no_such_reward_module.py (or package no_such_reward_module/) in the current folder {tmp_path}" in msg
    assert "--reward path/to/no_such_reward_module.py:digits" in msg
    (tmp_path / "needs_pkg_reward.py").write_text("import no_such_dependency_xyz\n" + DIGITS)
    monkeypatch.delitem(sys.modules, "needs_pkg_reward", raising=False)
    with pytest.raises(RewardSpecError, match="importing module 'needs_pkg_reward' failed: ModuleNotFoundError: "
                                              "No module named 'no_such_dependency_xyz'"):
        RewardFn("needs_pkg_reward:digits")
    (tmp_path / "broken.py").write_text("def digits(:\n")
    with pytest.raises(RewardSpecError, match=r"importing .*broken\.py failed: SyntaxError"):
        RewardFn("broken.py:digits")
    assert RewardSpecError.exit_code == 2 and issubclass(RewardSpecError, ValueError)


def test_reward_workers_call_a_per_sample_function_concurrently_in_row_order() -> None:
    """reward.workers = 4: four calls meet at a barrier (they only pass it together, so they ran at
    once); the values come back in row order, and a failing row stays that row's error."""
    import threading

    from rldsl.runtime.rewards.functions import RewardTerm

    barrier = threading.Barrier(4, timeout=10)

    def meet(prompt, completion, answer):
        barrier.wait()
        if completion == "bad":
            raise ValueError("bad row")
        return float(completion)

    completions = ["0", "1", "2", "3", "4", "bad", "6", "7"]
    fn = RewardFn("exact", on_error="skip", workers=4)
    fn.terms = [RewardTerm("meet", 1.0, meet, False)]
    out = fn.score(make_batch(completions, [""] * 8))
    assert out.rewards[:5].tolist() == [0, 1, 2, 3, 4] and out.rewards[6:].tolist() == [6, 7]
    assert math.isnan(out.rewards[5]) and out.num_errors == 1 and "bad row" in out.first_error
    barrier.reset()
    one = RewardFn("exact", on_error="skip", workers=1)  # one after another: the barrier breaks
    one.terms = [RewardTerm("meet", 1.0, lambda p, c, a: float(barrier.wait(0.2)), False)]
    assert one.score(make_batch(["1", "2"], ["", ""])).num_errors == 2
    with pytest.raises(ValueError, match="workers"):
        RewardFn("exact", workers=0)


def test_term_labels_name_each_term_shortly_and_once() -> None:
    """rewards/<label>/mean: the name as written, a function's name, a short form for batch terms."""
    from rldsl.runtime.rewards.spec import term_labels
    names = ["a", "math(allow_truncated=true)", "mypkg.rewards:fmt", "rewards/fmt.py:fmt",
             "http://127.0.0.1:8000/score", "judge:http://localhost:9000/v1(model=q)", "rm:./models/my-rm/", "math"]
    assert list(term_labels(names).values()) == ["a", "math", "fmt", "fmt_2", "server_127.0.0.1", "judge_localhost",
                                                 "rm_my-rm", "math_2"]


def test_scores_gathered_in_one_tensor_per_term(user_module, monkeypatch) -> None:
    """A term's B values become one tensor (they were written one element at a time: a tensor
    write per row, ~0.5 ms of the tiny step), the same values: a reward's exact float, NaN where
    it failed and is skipped."""
    batch = make_batch(["3", "12345", "7", "bad"], ["3", "5", "7", ""], finish=["stop", "stop", "length", "stop"])
    writes = []
    setitem = torch.Tensor.__setitem__
    monkeypatch.setattr(torch.Tensor, "__setitem__", lambda self, *a: writes.append(a) or setitem(self, *a))
    result = RewardFn("addition=0.5, my_rewards_mod:length=2", on_error="skip").score(batch)
    assert writes == []
    assert result.components["addition"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert result.components["my_rewards_mod:length"].tolist() == [0.1, 0.5, 0.1, 0.3]
    assert result.rewards.dtype == torch.float64 and result.num_errors == 0
    boom = RewardFn("my_rewards_mod:boom", on_error="skip").score(make_batch(["ok", "bad"], ["", ""]))
    assert [math.isnan(v) for v in boom.rewards.tolist()] == [False, True] and boom.num_errors == 1


def test_the_verifier_the_spec_language_and_the_weighted_sum_are_one_module_each():
    """verify.py: the built-in rewards and the math verifier; spec.py: the reward-spec language;
    functions.py: RewardFn, the weighted sum. Each name is defined in one of them only."""
    import ast
    import importlib
    from pathlib import Path

    def defined(module: str) -> set[str]:
        path = Path(importlib.import_module(f"rldsl.runtime.rewards.{module}").__file__)
        out = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                out |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                        if isinstance(t, ast.Name)}
        return out

    homes = {"verify": ["BUILTIN_REWARDS", "VERDICTS", "math_reward", "judge_math", "equivalent", "find_final_answer"],
             "spec": ["parse_reward_spec", "resolve_reward", "split_reward_name", "term_labels", "batch_reward",
                      "EnvironmentReward"],
             "functions": ["RewardFn", "RewardTerm", "RewardResult", "correct", "unscored"]}
    names = {m: defined(m) for m in homes}
    for module, wanted in homes.items():
        for name in wanted:
            assert [m for m in homes if name in names[m]] == [module], name
