"""The run recipe: every check before a model loads, one resolved (frozen) config that config.json
records, the spec parsed once, and the defaults a run would otherwise take silently."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from typer.testing import CliRunner

import rldsl.spec
from rldsl.cli import app
from rldsl.runtime.run import loop
from rldsl.runtime.config import load_config
from rldsl.runtime.errors import ConfigError, DataError, RewardSpecError, RunError
from rldsl.runtime.records.run_dir import load_run_config
from rldsl.runtime.run.plan import load_spec, plan_run

HERE = Path(__file__).parent
runner = CliRunner()


@pytest.fixture
def gpt2_64(tmp_path, tokenizer):
    """A model with a context of 64 positions (the toy tokenizer)."""
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2,
                                       n_positions=64, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2"


def data_file(path: Path, rows: int = 4, **fields: str) -> Path:
    recs = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), **fields} for i in range(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def run_config(model: Path, out: Path, *extra: str):
    return load_config(None, [f"model.path={model}", f"out={out}", "rollout.prompts_per_step=2",
                              "rollout.n=2", "train.steps=1", "eval.every=0", "eval.samples=0",
                              "data.eval_size=0", "checkpoint.every=0", "log.progress=false", *extra])


# ----------------------------------------------------------------------------- the saved config is what ran

def test_the_saved_config_is_the_config_that_ran(gpt2_64, tmp_path, monkeypatch, capsys):
    """Default reward and max_new_tokens, clipped to the 64-position context, are in config.json."""
    data = data_file(tmp_path / "d.jsonl")
    ran = []
    real_build = loop.build

    def spy(plan, run_dir):
        run = real_build(plan, run_dir)
        ran.append(run)
        return run

    monkeypatch.setattr(loop, "build", spy)
    out = loop.train("grpo", run_config(gpt2_64, tmp_path / "run", f"data.path={data}"))
    (run,) = ran
    saved = load_run_config(out)
    assert saved == run.cfg
    assert saved.reward.name == "exact"  # not null: the reward that scored the run
    longest = max(len(ids) for ids in run.tokenizer([e.prompt for e in run.prompts.examples])["input_ids"])
    assert saved.rollout.max_new_tokens == 64 - longest  # clipped from the default 1024
    text = capsys.readouterr().out
    assert "reward: exact (the default for a data file; choose one with --reward)" in text
    assert f"generating at most {64 - longest} new tokens" in text
    with pytest.raises(TypeError, match="resolved config is frozen: RolloutConfig.max_new_tokens"):
        run.cfg.rollout.max_new_tokens = 8
    # resuming from that config resolves to the same config: nothing is rewritten
    before = (out / "config.json").read_text()
    loop.train("grpo", None, resume=out)
    assert (out / "config.json").read_text() == before


def test_the_toy_run_records_its_reward(tmp_path):
    plan = plan_run(load_spec("grpo"), load_config(None, [f"out={tmp_path}"]))
    assert plan.cfg.reward.name == "addition" and plan.cfg.rollout.max_new_tokens == 4
    assert plan.cfg.is_frozen and "reward: addition (the default for the built-in addition task" in plan.notes[0]


def test_the_default_reward_is_settled_once_before_the_reward_is_built(tmp_path, monkeypatch):
    """plan_run settles what the config leaves to its source once, before any check, and names the
    task's own reward before building it; the reward recipe never guesses."""
    from rldsl.runtime import resolve
    from rldsl.runtime.data import sources
    from rldsl.runtime.run import plan as plan_module

    calls = []
    monkeypatch.setattr(plan_module, "settle", lambda cfg, source: calls.append(source) or sources.settle(cfg, source))
    asked = []
    real_source_of = sources.source_of
    monkeypatch.setattr(sources, "source_of", lambda cfg: asked.append(cfg) or real_source_of(cfg))
    built = []
    real_fn = resolve.reward_fn
    monkeypatch.setattr(resolve, "reward_fn", lambda cfg: built.append(cfg.reward.name) or real_fn(cfg))
    plan = plan_run(load_spec("grpo"), load_config(None, [f"out={tmp_path}"]))
    assert len(calls) == 1 and built == ["addition"] and plan.reward.spec == plan.cfg.reward.name == "addition"
    assert asked == []  # the plan's own source_of (imported by name) only: no helper asked the table again
    with pytest.raises(ValueError, match="not settled"):
        real_fn(load_config(None, []))


@pytest.mark.slow
def test_the_spec_is_parsed_once_per_run(model_dir, tmp_path, monkeypatch):
    parses = []
    real = rldsl.spec.resolve

    def counting(source, file="<string>", _chain=()):
        if not _chain:  # a top-level parse (a parent spec is parsed inside it)
            parses.append(file)
        return real(source, file, _chain)

    monkeypatch.setattr(rldsl.spec, "resolve", counting)
    out = loop.train("grpo", run_config(model_dir, tmp_path / "run", "reward.name=reward_helpers:parity"))
    assert len(parses) == 1
    parses.clear()
    loop.train("grpo", load_config(None, ["train.steps=2"], base=load_run_config(out)), resume=out)
    assert len(parses) == 1


# ----------------------------------------------------------------------------- checks before the model loads

def test_an_unknown_reward_fails_before_the_model_loads(model_dir, tmp_path, no_model_load):
    with pytest.raises(ValueError, match="unknown reward 'maht'"):
        loop.train("grpo", run_config(model_dir, tmp_path / "run", "reward.name=maht"))
    assert no_model_load == [] and not (tmp_path / "run").exists()  # no run folder either


def test_a_data_file_without_the_field_fails_before_the_model_loads(model_dir, tmp_path, no_model_load):
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(DataError, match="missing field 'prompt'"):
        loop.train("grpo", run_config(model_dir, tmp_path / "run", f"data.path={data}"))
    assert no_model_load == []


def test_an_engine_the_run_cannot_use_fails_before_the_model_loads(model_dir, tmp_path, no_model_load,
                                                                  monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    for extra in ([], ["distributed.rollout_workers=1"]):  # in one process, and on Ray rollout workers
        with pytest.raises(RunError, match="rollout.engine=vllm but vllm is not installed here.*make setup-vllm"):
            loop.train("grpo", run_config(model_dir, tmp_path / "run", "rollout.engine=vllm", *extra))
    assert no_model_load == []


def test_device_cuda_without_cuda_is_a_sentence(model_dir, tmp_path, monkeypatch, no_model_load):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["run", "grpo", "--model", str(model_dir), "--device", "cuda",
                              "--out", str(tmp_path / "run"), "--set", "log.progress=false"])
    assert res.exit_code == 2, res.output
    assert "--device cuda" in res.output and "--device cpu" in res.output
    assert "AssertionError" not in res.output and "Traceback" not in res.output
    assert no_model_load == []


def test_group_statistics_with_one_sample_are_refused_unless_allowed(model_dir, tmp_path, no_model_load):
    with pytest.raises(ConfigError) as e:
        loop.train("grpo", run_config(model_dir, tmp_path / "run", "rollout.n=1",
                                      "reward.name=reward_helpers:parity"))
    msg = str(e.value)
    assert "rollout.n=1" in msg and "every advantage is 0" in msg and "train.allow_zero_advantages=true" in msg
    assert no_model_load == []
    # a spec without group statistics starts with n=1 (plan only: no model is needed to decide)
    plan = plan_run(load_spec("reinforce"),
                          run_config(model_dir, tmp_path / "r2", "rollout.n=1", "reward.name=reward_helpers:parity"))
    assert plan.cfg.rollout.n == 1


def test_distillation_alone_needs_no_groups_a_task_term_beside_it_does(model_dir, tmp_path, no_model_load):
    """gkd (distill jsd, task=false: TRL's rollout.n=1) has grpo's group baseline and std, but no term
    of its loss reads the advantages: it plans with n=1, no allow flag, no warning. grpo_distill
    keeps GRPO's task term, so n=1 is refused as for grpo."""
    def cfg(*extra):
        return run_config(model_dir, tmp_path / "run", "rollout.n=1", f"teacher.path={model_dir}", *extra)

    for name in ("gkd", "opd", "distill_topk"):
        plan = plan_run(load_spec(name), cfg())
        assert plan.cfg.rollout.n == 1 and "group-of-one" not in {w.rule for w in plan.warnings}, name
    with pytest.raises(ConfigError, match="baseline group_mean compares the samples of a prompt's group, "
                                          "but rollout.n=1.*every advantage is 0"):
        plan_run(load_spec("grpo_distill"), cfg())
    assert no_model_load == []


def test_allow_zero_advantages_starts_the_run_with_the_warning(model_dir, tmp_path):
    plan = plan_run(load_spec("grpo"),
                          run_config(model_dir, tmp_path / "run", "rollout.n=1", "train.allow_zero_advantages=true",
                                     "reward.name=reward_helpers:parity"))
    assert {w.rule for w in plan.warnings} == {"group-of-one"}  # baseline and normalizer


def test_the_checks_run_in_the_cli_with_exit_code_and_no_load(model_dir, tmp_path, no_model_load):
    res = runner.invoke(app, ["run", "grpo", "--model", str(model_dir), "--out", str(tmp_path / "run"),
                              "--set", "rollout.n=1", "--set", "log.progress=false"])
    assert res.exit_code == 2 and "train.allow_zero_advantages" in res.output and "Traceback" not in res.output
    assert no_model_load == []


@pytest.fixture
def no_tokenizer_load(monkeypatch):
    """Loading the policy's tokenizer fails the test: a check that needs the config and the rows
    alone comes before it (and before transformers is imported for it)."""
    from rldsl.runtime.run import sources

    calls: list[str] = []

    def refuse(path):
        calls.append(str(path))
        raise AssertionError(f"the tokenizer at {path} was loaded before the check")

    monkeypatch.setattr(sources, "load_tokenizer", refuse)
    return calls


def test_a_reward_of_the_wrong_signature_fails_before_the_model_loads(model_dir, tmp_path, no_model_load):
    """A reward function is called as fn(prompt, completion, answer): one that cannot be (two
    parameters, a required keyword) is refused from its signature at plan time, exit 2, no run
    folder -- it failed after the model loaded and sampled a batch (issue 57)."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def two(prompt, completion):\n    return 1.0\n\n"
                       "def needs_key(prompt, completion, answer, *, scale):\n    return scale\n\n"
                       "def fine(prompt, completion, answer, finish_reason='stop', **kw):\n    return 1.0\n\n"
                       "def varargs(*args):\n    return 1.0\n")
    for name, shown in (("two", "(prompt, completion)"), ("needs_key", "(prompt, completion, answer, *, scale)")):
        res = runner.invoke(app, ["run", "grpo", "--model", str(model_dir), "--out", str(tmp_path / "run"),
                                  "--reward", f"{rewards}:{name}", "--set", "log.progress=false"])
        assert res.exit_code == 2, res.output
        assert f"its signature is {shown}" in res.output and "fn(prompt, completion, answer)" in res.output
        assert "Traceback" not in res.output
    data = data_file(tmp_path / "d.jsonl")
    toml = tmp_path / "run.toml"  # an eval.data set's own reward, likewise
    toml.write_text(f'[[eval.data]]\npath = "{data}"\nreward = "{rewards}:two"\n')
    with pytest.raises(RewardSpecError, match=r"reward '.*rewards.py:two' .*its signature is \(prompt, completion\)"):
        plan_run(load_spec("grpo"), load_config(toml, [f"model.path={model_dir}", f"out={tmp_path / 'run'}",
                                                       f"data.path={data}", "reward.name=reward_helpers:parity"]))
    assert no_model_load == [] and not (tmp_path / "run").exists()
    for name in ("fine", "varargs", "needs_key(scale=2)"):  # an option binds the keyword
        plan = plan_run(load_spec("grpo"), run_config(model_dir, tmp_path / "run", f"reward.name={rewards}:{name}"))
        assert plan.reward.terms[0].name == f"{rewards}:{name}"


def test_a_missing_eval_set_fails_before_the_tokenizer_loads(model_dir, tmp_path, no_tokenizer_load, no_model_load):
    data = data_file(tmp_path / "d.jsonl")
    with pytest.raises(DataError, match="nosuch.jsonl: no such file"):
        loop.train("grpo", run_config(model_dir, tmp_path / "run", f"data.path={data}",
                                      f"eval.data=['{tmp_path / 'nosuch.jsonl'}']"))
    assert no_tokenizer_load == no_model_load == [] and not (tmp_path / "run").exists()


def test_a_prompt_longer_than_the_context_exits_2_before_the_model_loads(gpt2_64, tmp_path, no_model_load):
    """The context check needs config.json and the tokenizer only: exit 2 naming both lengths, no
    weights read, no run folder."""
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "1" * 70, "answer": "1"}) + "\n" + json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    res = runner.invoke(app, ["run", "grpo", "--model", str(gpt2_64), "--data", str(data),
                              "--out", str(tmp_path / "run"), "--set", "log.progress=false"])
    assert res.exit_code == 2, res.output
    assert f"a prompt of data.path={data} has 71 tokens" in res.output and "context of 64 positions" in res.output
    assert "starts '1111" in res.output and "1 of 2 prompts do not fit" in res.output  # which prompt, how many
    assert no_model_load == [] and not (tmp_path / "run").exists()


def _image_rows(tmp_path: Path) -> Path:
    from PIL import Image
    Image.new("RGB", (28, 28), (200, 30, 30)).save(tmp_path / "red.png")
    chat = [{"role": "user", "content": [{"type": "image", "image": "red.png"}, {"type": "text", "text": "Colour?"}]}]
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": chat, "answer": "red"}]
    path = tmp_path / "pictures.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_images_with_a_text_model_exit_2_before_the_tokenizer_loads(model_dir, tmp_path, no_tokenizer_load,
                                                                    no_model_load):
    """Prompts with images and a text policy (a user's folder without vision_config, the embedded
    toy) exit 2 naming the data and its first row with images, before the tokenizer or a model
    loads, with no run folder: it failed after the model loaded (a chat template's TypeError, exit 1,
    or a missing preprocessor_config.json with a run folder left behind; issue 57)."""
    pictures = _image_rows(tmp_path)
    text = data_file(tmp_path / "d.jsonl")
    for flags, where, model in (
            (["--model", str(model_dir), "--data", str(pictures)], f"data.path={pictures}", f"the model {model_dir} is a text model"),
            (["--data", str(pictures)], f"data.path={pictures}", "the embedded toy model (no --model), a text model"),
            (["--model", str(model_dir), "--data", str(text), "--set", f"eval.data=['{pictures}']"],
             "eval.data set 'pictures'", "is a text model")):
        res = runner.invoke(app, ["run", "grpo", *flags, "--out", str(tmp_path / "run"), "--set", "log.progress=false"])
        assert res.exit_code == 2, res.output
        assert f"{where}: 1 of 2 prompts hold images (the first: row 2)" in res.output, res.output
        assert model in res.output and "Traceback" not in res.output
    assert no_tokenizer_load == no_model_load == [] and not (tmp_path / "run").exists()


def test_images_pass_the_check_for_a_vision_language_model(tmp_path):
    """A model folder whose config.json has a vision_config, and the shapes task's embedded
    Qwen2-VL, read the images: the check lets them through."""
    from rldsl.runtime.data.sources import SOURCES, source_of
    from rldsl.runtime.data.datasets import load_examples
    from rldsl.runtime.run.sources import check_image_model

    rows = load_examples(_image_rows(tmp_path))
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {}}))
    cfg = load_config(None, [f"model.path={vlm}", f"data.path={tmp_path / 'pictures.jsonl'}"])
    check_image_model(cfg, source_of(cfg), [("data", rows)])
    shapes = load_config(None, ["data.task=shapes"])
    check_image_model(shapes, SOURCES["shapes"], [("data", rows)])
    with pytest.raises(ConfigError, match="the embedded toy model"):
        check_image_model(load_config(None, []), source_of(load_config(None, [])), [("data", rows)])


# ----------------------------------------------------------------------------- silent defaults

def test_a_microbatch_budget_smaller_than_a_row_is_reported_with_the_numbers(model_dir, tmp_path, tokenizer):
    data = data_file(tmp_path / "d.jsonl")
    plan = plan_run(load_spec("grpo"),
                          run_config(model_dir, tmp_path / "run", f"data.path={data}", "rollout.max_new_tokens=8",
                                     "train.max_tokens_per_microbatch=6"))
    longest = max(len(tokenizer(e.prompt)["input_ids"]) for e in plan.prompts.examples)
    row = longest + 8
    (note,) = [n for n in plan.notes if "max_tokens_per_microbatch" in n]
    assert note.startswith(f"train.max_tokens_per_microbatch=6 is smaller than one row (up to {longest} "
                           f"prompt + 8 new tokens = {row})") and f"at least {row}" in note
    fits = plan_run(load_spec("grpo"),
                          run_config(model_dir, tmp_path / "run", f"data.path={data}", "rollout.max_new_tokens=8",
                                     f"train.max_tokens_per_microbatch={row}"))
    assert not [n for n in fits.notes if "max_tokens_per_microbatch" in n]


def test_a_chosen_reward_is_named_at_start(model_dir, tmp_path):
    plan = plan_run(load_spec("grpo"),
                          run_config(model_dir, tmp_path / "run", "reward.name=reward_helpers:parity"))
    assert "reward: reward_helpers:parity" in plan.notes


def test_a_broken_model_config_is_a_sentence_before_the_weights_load(model_dir, tmp_path, no_model_load):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(RunError, match=r"broken.*config.json' is not a valid JSON file"):
        plan_run(load_spec("grpo"), run_config(broken, tmp_path / "run"))
    assert no_model_load == []


def test_a_users_model_without_data_does_not_fall_back_to_the_builtin_task(model_dir, tmp_path):
    """A model that is not the embedded one (another tokenizer) and no data.path: a ConfigError
    naming data.path (it trained on the toy's addition task silently); data.task set explicitly,
    or the embedded model's tokenizer (the tests' models), runs the built-in task."""
    from rldsl.runtime import toy
    tok = toy.build_tokenizer()
    tok.add_tokens(["<my_token>"])  # another vocabulary: a user's model
    other = tmp_path / "other"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64)).save_pretrained(other)
    tok.save_pretrained(other)
    algo = rldsl.spec.load("grpo")
    with pytest.raises(ConfigError, match=r"data.path is not set: the model .*other would train on the built-in "
                                          r"'addition' task.*--data FILE \(data.path\).*--set data.task=addition"):
        plan_run(algo, load_config(None, [f"model.path={other}"]))
    res = CliRunner().invoke(app, ["run", "grpo", "--model", str(other), "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and "error: data.path is not set" in res.output, res.output
    plan_run(algo, load_config(None, [f"model.path={other}", "data.task=addition"]))  # asked for: runs
    plan_run(algo, load_config(None, [f"model.path={model_dir}"]))  # the toy's tokenizer
