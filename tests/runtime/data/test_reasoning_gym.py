"""reasoning-gym data, its verifiers as rewards, mixes, curricula, evaluation and bad input
(runtime/reasoning_gym.py; docs/reasoning_gym.md)."""
from __future__ import annotations

import math
import sys

import pytest
import torch

reasoning_gym = pytest.importorskip("reasoning_gym")
from reasoning_gym.utils import extract_answer  # noqa: E402

from rldsl.runtime.data import reasoning_gym as rg  # noqa: E402
from rldsl.runtime.data.sources import source_of  # noqa: E402
from rldsl.runtime.batch import RolloutBatch  # noqa: E402
from rldsl.runtime.config import load_config  # noqa: E402
from rldsl.runtime.errors import ConfigError, DataError, RewardError  # noqa: E402
from rldsl.runtime.rewards import RewardFn  # noqa: E402


def batch_of(completions: list[str], prompts: list[str], answers: list[str]) -> RolloutBatch:
    B = len(completions)
    z = torch.zeros(B, 1, dtype=torch.long)
    return RolloutBatch(z, z, z, z, torch.zeros(B, 1), ["stop"] * B, prompts, completions, 1, answers=answers)


def score(spec: str, examples, completions, on_error: str = "raise"):
    fn = RewardFn(spec, on_error=on_error)
    b = batch_of(completions, [e.prompt for e in examples], [e.answer for e in examples])
    return fn.score(b, [e.reward_prompt for e in examples])


# ------------------------------------------------------------------------------ rewards
@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum", "spell_backward", "letter_counting",
                                  "word_sorting", "mini_sudoku"])
def test_the_reward_is_the_tasks_own_score_of_the_extracted_answer(task):
    data = rg.generate(f"reasoning_gym:{task}", {"size": 6, "seed": 3}, run_seed=0, heldout=0)
    rows = data.train
    # the rows are reasoning-gym's composite of the one task (its seed + 1 for the first task)
    ds = reasoning_gym.create_dataset(task, size=6, seed=3 + 1)
    for i, e in enumerate(rows):
        assert (e.prompt, e.answer) == (ds[i]["question"], str(ds[i]["answer"]))
    right = [f"thinking...<answer>{e.answer}</answer>" for e in rows]
    # a near miss: the answer with its last character changed (partial credit where the task gives it)
    near = [f"<answer>{e.answer[:-1] + ('x' if e.answer[-1] != 'x' else 'y')}</answer>" for e in rows]
    untagged = [e.answer for e in rows]
    for completions in (right, near, untagged):
        got = score("reasoning_gym", rows, completions).rewards.tolist()
        want = [ds.score_answer(extract_answer(c), ds[i]) for i, c in enumerate(completions)]
        assert got == pytest.approx(want)
    assert score("reasoning_gym", rows, right).rewards.tolist() == [1.0] * 6
    assert score("reasoning_gym", rows, untagged).rewards.tolist() == [0.0] * 6  # no tag: no answer


def test_partial_credit_is_kept_and_the_plain_format_reads_the_whole_completion():
    data = rg.generate("reasoning_gym:spell_backward", {"size": 1, "seed": 0, "min_word_len": 8},
                       run_seed=0, heldout=0)
    e = data.train[0]
    wrong_last = e.answer[:-1] + ("a" if e.answer[-1] != "a" else "b")
    r = score("reasoning_gym", [e], [f"<answer>{wrong_last}</answer>"]).rewards
    assert 0.0 < float(r[0]) < 1.0
    assert float(r[0]) == pytest.approx((len(e.answer) - 1) / len(e.answer))
    assert score("reasoning_gym(answer_format=plain)", [e], [f"  {e.answer}\n"]).rewards.tolist() == [1.0]
    # weighted with another term
    both = score("reasoning_gym=0.5,exact=0.25", [e], [e.answer])
    assert both.components["reasoning_gym"].tolist() == [0.0] and both.rewards.tolist() == [0.25]


def test_each_row_of_a_mix_is_scored_by_its_own_task():
    data = rg.generate("reasoning_gym:spell_backward=1,basic_arithmetic=1", {"size": 40, "seed": 1},
                       run_seed=0, heldout=0)
    tasks = {rg.task_of(e.reward_prompt) for e in data.train}
    assert tasks == {"spell_backward", "basic_arithmetic"}
    completions = [f"<answer>{e.answer}</answer>" for e in data.train]
    assert score("reasoning_gym", data.train, completions).rewards.tolist() == [1.0] * 40


def test_a_verifier_that_raises_follows_reward_on_error(monkeypatch):
    data = rg.generate("reasoning_gym:basic_arithmetic", {"size": 2, "seed": 0}, run_seed=0, heldout=0)

    def broken(answer, entry):
        if answer == "boom":
            raise ValueError("strange completion")
        return 1.0

    # each row's own scorer: a row whose question an earlier test generated too keeps that one's
    for e in data.train:
        monkeypatch.setattr(rg.ENTRIES.get(e.reward_prompt)[0], "score_answer", broken)
    completions = ["<answer>boom</answer>", "<answer>1</answer>"]
    skipped = score("reasoning_gym", data.train, completions, on_error="skip")
    assert skipped.num_errors == 1 and math.isnan(skipped.rewards[0]) and skipped.rewards[1] == 1.0
    with pytest.raises(RewardError, match="strange completion"):
        score("reasoning_gym", data.train, completions)


# ------------------------------------------------------------------------------ data
def test_the_heldout_rows_hold_no_training_question_and_the_drops_are_counted():
    # 2 terms of 1 digit, + only: 121 questions, so a held-out draw meets training questions often
    opts = {"size": 60, "seed": 5, "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
            "operators": ["+"], "allow_parentheses": False}
    data = rg.generate("reasoning_gym:basic_arithmetic", opts, run_seed=0, heldout=40)
    train = {e.prompt for e in data.train}
    held = [e.prompt for e in data.heldout]
    assert len(held) == 40 and len(set(held)) == 40 and not train & set(held)
    dropped = int(data.notes[0].split("(")[1].split()[0])
    assert dropped > 0  # said in the run's notes
    with pytest.raises(DataError, match="lower data.eval_size"):
        rg.generate("reasoning_gym:basic_arithmetic", opts, run_seed=0, heldout=200)


def test_mix_weights_within_sampling_error():
    data = rg.generate("reasoning_gym:basic_arithmetic=3,spell_backward=1", {"size": 4000, "seed": 2},
                       run_seed=0, heldout=0)
    share = sum(rg.task_of(e.reward_prompt) == "basic_arithmetic" for e in data.train) / 4000
    sigma = math.sqrt(0.75 * 0.25 / 4000)
    assert abs(share - 0.75) < 4 * sigma


def test_options_reach_the_generator_and_a_mix_takes_a_table_per_task():
    data = rg.generate("reasoning_gym:basic_arithmetic", {"size": 20, "seed": 0, "min_digits": 3,
                                                          "max_digits": 3, "operators": ["*"]},
                       run_seed=0, heldout=0)
    assert all(e["metadata"]["num_digits"] == 3 and "*" in e["metadata"]["expression"]
               for _, e in (rg.ENTRIES.rows[x.prompt] for x in data.train))
    mix = rg.generate("reasoning_gym:basic_arithmetic,spell_backward",
                      {"size": 30, "basic_arithmetic": {"operators": ["+"]}, "spell_backward": {"min_word_len": 9}},
                      run_seed=0, heldout=0)
    for x in mix.train:
        task, e = rg.ENTRIES.rows[x.prompt]
        if task == "spell_backward":
            assert len(e["answer"]) >= 9
        else:
            assert "+" in e["metadata"]["expression"]


# ------------------------------------------------------------------------------ bad input
def test_an_unknown_task_lists_the_valid_names_closest_first():
    with pytest.raises(DataError) as err:
        rg.parse_tasks("reasoning_gym:chain_sun")
    msg = str(err.value)
    assert "unknown reasoning-gym task 'chain_sun'" in msg
    assert msg.split("(closest first): ")[1].startswith("chain_sum")
    assert "spell_backward" in msg


def test_an_unknown_option_names_reasoning_gyms_error():
    with pytest.raises(DataError, match=r"basic_arithmetic.*unexpected keyword argument 'digits'.*"
                                        r"BasicArithmeticDatasetConfig.*its options: .*max_digits"):
        rg.generate("reasoning_gym:basic_arithmetic", {"digits": 3}, run_seed=0, heldout=0)
    with pytest.raises(DataError, match="refuses them: max_terms must be >= min_terms"):
        rg.generate("reasoning_gym:chain_sum", {"min_terms": 5, "max_terms": 2}, run_seed=0, heldout=0)


@pytest.mark.parametrize("path", ["reasoning_gym:chain_sum=0", "reasoning_gym:chain_sum=-1,spell_backward",
                                  "reasoning_gym:chain_sum=x", "reasoning_gym:chain_sum=nan"])
def test_mix_weights_must_be_positive_numbers(path):
    with pytest.raises(DataError, match="weight"):
        rg.parse_tasks(path)


def test_missing_reasoning_gym_names_the_extra_before_any_model_loads(monkeypatch, tmp_path):
    from rldsl.runtime.run import sources
    from rldsl.runtime.run.plan import load_spec, plan_run

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails
    monkeypatch.setattr(sources, "model_folder", lambda cfg: pytest.fail("a model was looked for"))
    cfg = load_config(None, ["data.path=reasoning_gym:chain_sum"])
    with pytest.raises(DataError, match=r"rldsl\[tasks\]"):
        plan_run(load_spec("grpo"), cfg)


def test_curriculum_needs_reasoning_gym_data():
    with pytest.raises(ConfigError, match="data.curriculum needs reasoning-gym data"):
        load_config(None, ["data.curriculum=true"])


# ------------------------------------------------------------------------------ metrics
def test_per_task_metrics_of_a_step():
    data = rg.generate("reasoning_gym:basic_arithmetic=1,spell_backward=1", {"size": 50, "seed": 0},
                       run_seed=0, heldout=0)
    source = rg.ReasoningGymSource(data, data.train, seed=0, name="mix", curriculum=None)
    batch = source.next_batch(8)
    rewards = torch.tensor([[1.0, 0.5]] * 8)
    tasks = [rg.task_of(e.reward_prompt) for e in batch]
    m = source.observe([e.id for e in batch], rewards)
    for t in set(tasks):
        assert m[f"task/{t}/reward"] == pytest.approx(0.75)
        assert m[f"task/{t}/acc"] == pytest.approx(0.5)  # only full credit counts as solved


# ------------------------------------------------------------------------------ curricula
def curriculum_source(window: int = 4):
    data = rg.generate("reasoning_gym:chain_sum", {"size": 100, "seed": 0}, run_seed=0, heldout=20)
    settings = rg.CurriculumSettings(window=window, raise_at=0.7, lower_at=0.2)
    return data, rg.ReasoningGymSource(data, data.train, seed=0, name="cs", curriculum=settings,
                                       heldout_questions=[e.prompt for e in data.heldout])


def test_curriculum_levels_move_up_on_a_scripted_pass_rate_sequence_and_down_again():
    data, source = curriculum_source()
    assert source.levels() == {"chain_sum": {"num_terms": 0, "num_digits": 0}}
    # level 0: two terms of one digit (reasoning-gym's lowest level), whatever data.options say
    assert all(len(e["metadata"]["expression"].split()) == 3 for _, e in
               (rg.ENTRIES.rows[x.prompt] for x in source.examples))
    trail = []
    for passed in [1.0, 1.0, 0.5, 0.5, 1.0, 1.0, 0.0, 0.0]:  # a window of 4 = two steps of 1 x 2
        batch = source.next_batch(1)
        m = source.observe([e.id for e in batch], torch.full((1, 2), passed))
        trail.append((m["curriculum/chain_sum/num_terms"], m["curriculum/chain_sum/num_digits"]))
    # the last 4 samples decide (the window restarts after a move): up one attribute at a time
    # (the lowest first), held by a middling rate, down on failures (the highest, last declared)
    assert trail == [(0, 0), (1, 0), (1, 0), (1, 0), (1, 1), (1, 1), (1, 1), (1, 0)]
    held = {e.prompt for e in data.heldout}
    assert not held & {e.prompt for e in source.examples}
    terms = [len(rg.ENTRIES.rows[x.prompt][1]["metadata"]["expression"].split()) // 2 + 1
             for x in source.examples]
    assert max(terms) == 3  # level 1 of num_terms: 2..3 terms


def test_curriculum_levels_and_position_survive_a_restore():
    _, source = curriculum_source()
    for passed in [1.0, 1.0, 1.0, 1.0, 1.0]:
        batch = source.next_batch(1)
        source.observe([e.id for e in batch], torch.full((1, 2), passed))
    state = source.state_dict()
    want = [e.prompt for e in source.next_batch(5)]
    _, fresh = curriculum_source()
    fresh.load_state_dict(state)
    assert fresh.levels() == {"chain_sum": {"num_terms": 1, "num_digits": 1}} == source.levels() | {}
    assert [e.prompt for e in fresh.next_batch(5)] == want


# ------------------------------------------------------------------------------ a run
@pytest.mark.slow
def test_a_curriculum_run_logs_levels_and_task_metrics_to_trackers_and_resumes_at_its_levels(model_dir, tmp_path,
                                                                                            monkeypatch):
    """Every step scores 1.0 (reward_helpers:quarter x 4; the verifier runs at weight 0), so with a
    window of one step (4 prompts x 4) the levels rise every step; killed after step 2 and resumed,
    the run logs the same levels as one that was never stopped."""
    from rldsl.runtime.records.metrics import read_metrics
    from rldsl.runtime.run import loop
    from tracker_readers import wandb_history

    monkeypatch.setenv("WANDB_MODE", "offline")  # W&B writes its history under the run folder
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    def sets(out):
        return [f"model.path={model_dir}", f"out={out}", "data.path=reasoning_gym:basic_arithmetic",
                'data.options={"size": 64, "allow_parentheses": false}', "data.eval_size=4", "data.system_prompt=", "data.curriculum=true",
                "data.curriculum_window=16", "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=4",
                "train.steps=4", "eval.every=0", "eval.samples=0", "checkpoint.every=1", "log.progress=false",
                "reward.name=reasoning_gym=0,reward_helpers:quarter=4", "log.report_to=[wandb]", "log.project=rg"]

    whole = loop.train("grpo", load_config(None, sets(tmp_path / "whole")))
    cut = loop.train("grpo", load_config(None, sets(tmp_path / "cut")), stop_after=2)
    cut = loop.train("grpo", resume=cut)

    def levels(run):
        return [(r["step"], r["curriculum/basic_arithmetic/num_terms"], r["curriculum/basic_arithmetic/num_digits"])
                for r in read_metrics(run / "metrics.jsonl") if "curriculum/basic_arithmetic/num_terms" in r]

    assert levels(whole) == [(1, 1, 0), (2, 1, 1), (3, 2, 1), (4, 2, 2)]
    assert levels(cut) == levels(whole)
    history, _, _ = wandb_history(whole)
    for step in (1, 2, 3, 4):
        assert history[step]["task/basic_arithmetic/acc"] == 1.0
        assert history[step]["task/basic_arithmetic/reward"] == 1.0
        assert "curriculum/basic_arithmetic/num_digits" in history[step]


def test_an_eval_set_of_a_mix_is_one_set_per_task_and_holds_no_training_question(tokenizer):
    from rldsl.runtime.run.eval_sets import load_sets

    data = rg.generate("reasoning_gym:basic_arithmetic", {"size": 200, "seed": 0, "max_digits": 1,
                                                          "allow_parentheses": False, "operators": ["+"]},
                       run_seed=0, heldout=0)
    fn = RewardFn("reasoning_gym")
    cfg = load_config(None, [])  # another run's data: reasoning-gym's default options
    sets = load_sets("reasoning_gym:basic_arithmetic=1,spell_backward=1", cfg, fn, tokenizer, count=30,
                     exclude=[e.prompt for e in data.train])
    assert sorted(s.name for s in sets) == ["basic_arithmetic", "spell_backward"]
    assert sum(len(s.examples) for s in sets) == 30
    system = rg.default_system_prompt()
    assert system.endswith(".\n")  # reasoning-gym's own ends in a newline: still one blank line below
    for s in sets:  # the plain format with reasoning-gym's default system prompt (no chat template)
        assert all(e.prompt == system[:-1] + "\n\n" + e.reward_prompt for e in s.examples)
        assert {rg.task_of(e.reward_prompt) for e in s.examples} == {s.name}
    single = load_sets("reasoning_gym:basic_arithmetic", load_config(None, ["data.system_prompt="]), fn,
                       tokenizer, count=5)
    assert [s.name for s in single] == ["basic_arithmetic"]  # one rule: eval/<task>/..., single or mixed
    assert all(e.prompt == e.reward_prompt for e in single[0].examples)
    named = load_sets("reasoning_gym:basic_arithmetic=1,spell_backward=1", cfg, fn, tokenizer, count=6,
                      name="hard")
    assert sorted(s.name for s in named) == ["hard/basic_arithmetic", "hard/spell_backward"]


def test_eval_sets_that_would_log_under_one_name_are_refused(tokenizer, tmp_path):
    """A task in two eval.data sets, or a set named like the held-out split's per-task metrics
    (eval/heldout/<task>/...) on a run whose data has tasks, is a ConfigError before any model
    loads; a file's name steps aside -- only then: `heldout.jsonl` is the set `heldout` on a run of
    plain data and in `rldsl eval`, which log no per-task held-out metrics."""
    from rldsl.runtime.run.eval_sets import command_sets, eval_sets_of

    def sets(*entries: str, data: str = "reasoning_gym:chain_sum=1,spell_backward=1"):
        (tmp_path / "run.toml").write_text("".join(f"[[eval.data]]\n{e}\n" for e in entries))
        cfg = load_config(tmp_path / "run.toml", ["data.eval_size=4", f"data.path={data}"])
        return eval_sets_of(cfg, source_of(cfg), tokenizer, RewardFn("reasoning_gym"))

    with pytest.raises(ConfigError, match="eval.data: two sets are named 'chain_sum'"):
        sets('path = "reasoning_gym:chain_sum"', 'path = "reasoning_gym:chain_sum=1,spell_backward=1"')
    with pytest.raises(ConfigError, match="would log under eval/heldout/"):
        sets('path = "reasoning_gym:chain_sum"\nname = "heldout"')
    (tmp_path / "heldout.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert [s.name for s in sets(f'path = "{tmp_path / "heldout.jsonl"}"', 'path = "reasoning_gym:chain_sum"')] \
        == ["heldout_2", "chain_sum"]
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    assert [s.name for s in sets(f'path = "{tmp_path / "heldout.jsonl"}"', data=str(plain))] == ["heldout"]
    assert [s.name for s in command_sets([tmp_path / "heldout.jsonl"], load_config(None, []), RewardFn("exact"),
                                         tokenizer)] == ["heldout"]


@pytest.mark.parametrize("kind", ["tools", "env", "agent"])
def test_multi_turn_episodes_open_with_reasoning_gyms_system_prompt(real_model, kind):
    """--tools, --env and --agent on reasoning-gym data: the model sees reasoning-gym's system
    prompt (the one asking for the <answer> tags its reward reads) as single-turn runs do -- not
    the chat template's default system turn (Qwen2.5's "You are Qwen, ..."); an environment's
    reset (a ToolEnv's, here) and an agent get it as row["system"]. data.system_prompt set still
    wins."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rldsl.runtime.models.loading import model_context
    from rldsl.runtime.rollout.engines.base import SamplingParams
    from rldsl.runtime.rollout.engines.hf import HFEngine
    from rldsl.runtime.rollout.multi_turn import episode_runner

    if kind == "agent":
        pytest.importorskip("openai")
    folder = real_model("qwen2.5")
    tok = AutoTokenizer.from_pretrained(folder)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(folder).eval(), tok)
    rollout = {"tools": "rollout.tools=real_tools:get_weather", "env": "rollout.env=episode_helpers:CalcEnv",
               "agent": "rollout.agent=agent_helpers:system_chat"}[kind]
    for given, want in ((None, rg.default_system_prompt()), ("Be brief.", "Be brief.")):
        cfg = load_config(None, ["data.path=reasoning_gym:basic_arithmetic", rollout, "rollout.max_turns=1",
                                 *([f"data.system_prompt={given}"] if given else [])])
        runner = episode_runner(cfg, folder, model_context(Path(folder)))
        try:
            batch = runner.run(engine, ["What is 1 + 2?"], ["3"], SamplingParams(n=1, max_new_tokens=2, seed=0))
        finally:
            getattr(runner, "close", lambda: None)()
        seen = tok.decode(batch.prompt_ids[0][batch.prompt_mask[0].bool()].tolist())  # what the engine saw
        assert f"<|im_start|>system\n{want}" in seen and "You are Qwen" not in seen
        assert batch.episodes[0].messages[0] == {"role": "system", "content": want}


def test_the_demo_teacher_is_exact_without_drops_and_its_mode_makes_both_mistakes():
    import random

    from rldsl.runtime.toy.basic_arithmetic import teacher_answer, teacher_mode

    rng = random.Random(0)
    for a in range(0, 101, 7):
        for b in range(0, 101, 3):
            assert teacher_answer(f"{a} + {b}", drop=0.0, rng=rng) == str(a + b)
            assert teacher_answer(f"{a} - {b}", drop=0.0, rng=rng) == str(a - b)
    assert teacher_mode("58 + 67") == "15"    # both carries dropped (the hundreds' 1 too)
    assert teacher_mode("58 + 7") == "28"     # 7 under the 5: 58 + 70, carries dropped
    assert teacher_mode("52 - 37") == "25"    # the borrow dropped
    assert teacher_mode("23 - 67") == "44"    # the sign dropped


def test_without_model_path_the_embedded_arithmetic_model_is_warm_started_for_its_own_data(monkeypatch, tmp_path):
    from rldsl.runtime.errors import RunError
    from rldsl.runtime.run import sources
    from rldsl.runtime.toy import basic_arithmetic

    asked = []
    monkeypatch.setattr(basic_arithmetic, "arithmetic_warm_start",
                        lambda settings, **kw: asked.append(settings) or tmp_path)
    cfg = load_config("examples/reasoning_gym.toml")
    assert sources.model_folder(cfg, source_of(cfg))[0] == tmp_path
    (settings,) = asked
    assert dict(settings.options)["operators"] == ("+",) and settings.size == 4000 and settings.data_seed == 0
    assert settings.answer_format == "plain"
    with pytest.raises(RunError, match="no embedded model for reasoning_gym:spell_backward"):
        cfg = load_config(None, ["data.path=reasoning_gym:spell_backward"])
        sources.model_folder(cfg, source_of(cfg))
    with pytest.raises(RunError, match="min_terms = max_terms = 2"):
        cfg = load_config("examples/reasoning_gym.toml", ['data.options={"max_terms": 3}'])
        sources.model_folder(cfg, source_of(cfg))


def test_the_answer_format_reaches_the_default_reward_and_the_run_says_so():
    from rldsl.runtime.data.sources import settle, source_of
    from rldsl.runtime.resolve import reward_spec

    def settled(cfg):
        return settle(cfg, source_of(cfg))[0]

    assert reward_spec(settled(load_config(None, ["data.path=reasoning_gym:chain_sum"]))) == "reasoning_gym"
    cfg = load_config(None, ["data.path=reasoning_gym:chain_sum", "reward.answer_format=plain"])
    assert reward_spec(settled(cfg)) == "reasoning_gym(answer_format=plain)"
    cfg = load_config(None, ["data.path=reasoning_gym:chain_sum", "reward.answer_format=plain",
                             "reward.name=reasoning_gym=0.9,exact=0.1"])
    assert reward_spec(cfg) == "reasoning_gym(answer_format=plain)=0.9,exact=0.1"


def test_an_unknown_answer_format_fails_before_any_model_loads(monkeypatch):
    from rldsl.runtime.run import sources
    from rldsl.runtime.run.plan import load_spec, plan_run

    monkeypatch.setattr(sources, "model_folder", lambda cfg: pytest.fail("a model was looked for"))
    cfg = load_config(None, ["data.path=reasoning_gym:chain_sum", "reward.name=reasoning_gym(answer_format=xml)"])
    with pytest.raises(ConfigError, match="answer_format must be one of tag, plain, got 'xml'"):
        plan_run(load_spec("grpo"), cfg)


@pytest.mark.slow
def test_rldsl_eval_of_a_run_on_its_own_data_holds_none_of_its_training_questions(model_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    from pathlib import Path

    from rldsl.runtime.run import eval_command, loop

    opts = '{"size": 80, "max_digits": 1, "operators": ["+"], "allow_parentheses": false}'
    run = loop.train("grpo", load_config(None, [
        f"model.path={model_dir}", f"out={tmp_path / 'run'}", "data.path=reasoning_gym:basic_arithmetic",
        f"data.options={opts}", "data.eval_size=4", "data.system_prompt=", "rollout.prompts_per_step=2",
        "rollout.n=2", "rollout.max_new_tokens=3", "train.steps=1", "eval.every=0", "log.progress=false"]))
    made = []
    real = rg.generate_eval
    monkeypatch.setattr(rg, "generate_eval", lambda *a, **kw: made.append(kw) or real(*a, **kw))
    eval_command.evaluate_target(run, [Path("reasoning_gym:basic_arithmetic")], n=1, max_new_tokens=3)
    training = {e["question"] for e in rg.training_entries("reasoning_gym:basic_arithmetic",
                                                          load_config(run / "config.json").data.options,
                                                          run_seed=0)}
    assert set(made[0]["exclude"]) == training and made[0]["count"] == 4
    assert "4 evaluation rows" in capsys.readouterr().out
