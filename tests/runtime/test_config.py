"""RunConfig: toy defaults, --set parsing, TOML loading, errors, exact save/load round-trip."""
from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from rldsl.runtime.config import RunConfig, config_keys, config_reference, load_config
from rldsl.runtime.data.sources import max_new_tokens
from rldsl.runtime.errors import ConfigError
from rldsl.runtime.records.run_dir import CONFIG_FILE, SPEC_FILE, load_run_config, save_config


def test_defaults_are_the_toy_study_settings():
    cfg = RunConfig()
    assert cfg.model.path is None and cfg.data.path is None and cfg.reward.name is None
    assert (cfg.rollout.prompts_per_step, cfg.rollout.n) == (16, 8)
    assert (cfg.rollout.temperature, cfg.rollout.top_p) == (1.0, 1.0)
    assert cfg.rollout.max_new_tokens is None and max_new_tokens(cfg) == 4
    t = cfg.train
    assert (t.lr, t.betas, t.weight_decay, t.grad_clip) == (3e-4, (0.9, 0.99), 0.0, 1.0)
    assert (t.ppo_epochs, t.minibatches, t.lr_schedule, t.warmup_steps) == (1, 1, "constant", 0)
    assert t.steps == 300
    assert (cfg.threads, cfg.device, cfg.model.dtype) == (1, "cpu", "float32")
    assert cfg.reward.on_error == "raise" and cfg.log.tensorboard is False
    assert cfg.out is None


def test_every_key_is_documented():
    rows = config_reference()
    assert [r[0] for r in rows] == config_keys()
    assert len(rows) >= 35
    undocumented = [key for key, _type, _default, doc in rows if len(doc) < 10]
    assert undocumented == []
    assert ("train.lr", "float", "0.0003") == rows[config_keys().index("train.lr")][:3]


def test_max_new_tokens_default_follows_the_task():
    assert max_new_tokens(load_config(overrides=["data.path=train.jsonl"])) == 1024
    assert max_new_tokens(load_config(overrides=["rollout.max_new_tokens=7"])) == 7
    assert load_config(overrides=["rollout.max_new_tokens=7"]).max_new_tokens == 7
    with pytest.raises(ValueError, match="resolve the config first"):  # null until resolve fills it in
        RunConfig().max_new_tokens


def test_set_values_are_parsed_by_field_type():
    cfg = load_config(overrides=[
        "train.lr=1e-4", "rollout.n=4", "log.tensorboard=true", "data.answer_key=null",
        "model.path=null", "reward.name=my_rewards:score", "train.betas=0.8,0.95",
        "out=123", "rollout.temperature=0.5", "train.critic_lr=2",
    ])
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.rollout.n == 4 and isinstance(cfg.rollout.n, int)
    assert cfg.log.tensorboard is True and cfg.data.answer_key is None
    assert cfg.model.path is None
    assert cfg.reward.name == "my_rewards:score"
    assert cfg.train.betas == (0.8, 0.95)
    assert cfg.out == "123"  # a str field keeps digits as text
    assert cfg.rollout.temperature == 0.5
    assert cfg.train.critic_lr == 2.0 and isinstance(cfg.train.critic_lr, float)


def test_set_accepts_brackets_quotes_and_spaces():
    cfg = load_config(overrides=["train.betas=[0.5, 0.6]", "reward.name='null'", " seed = 7 "])
    assert cfg.train.betas == (0.5, 0.6)
    assert cfg.reward.name == "null"  # quoted: the text, not None
    assert cfg.seed == 7


def test_set_a_key_inside_a_table_option():
    """`--set data.options.size=64` is `--set 'data.options={"size": 64}'`; keys of a mix's task
    tables and of other table options too, the table's other keys kept (issue 45)."""
    dotted = load_config(overrides=["data.path=reasoning_gym:chain_sum", "data.options.size=64"])
    whole = load_config(overrides=["data.path=reasoning_gym:chain_sum", 'data.options={"size": 64}'])
    assert dotted == whole and dotted.data.options == {"size": 64}
    cfg = load_config(overrides=['data.options={"seed": 3}', "data.options.chain_sum.min_terms=2",
                                 "data.options.flag=true", "data.options.word=abc", "data.options.rate=0.5",
                                 "data.chat_template_kwargs.enable_thinking=false"])
    assert cfg.data.options == {"seed": 3, "chain_sum": {"min_terms": 2}, "flag": True, "word": "abc", "rate": 0.5}
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="not a table"):
        load_config(overrides=["data.options.size=64", "data.options.size.x=1"])


def test_later_set_wins():
    assert load_config(overrides=["seed=1", "seed=2"]).seed == 2


def test_unknown_key_suggests_and_lists_valid_keys():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["train.lrr=1e-4"])
    msg = str(err.value)
    assert "unknown config key 'train.lrr'" in msg and "--set train.lrr=1e-4" in msg
    assert "'train.lr'" in msg and "did you mean" in msg
    assert "valid keys in [train]: train.steps, train.lr," in msg


def test_bare_leaf_name_points_to_its_section():
    with pytest.raises(ConfigError, match=r"did you mean 'train.lr'\?"):
        load_config(overrides=["lr=1e-4"])


@pytest.mark.parametrize("name, key", [
    ("learning_rate", "train.lr"), ("num_generations", "rollout.n"), ("max_completion_length", "rollout.max_new_tokens"),
    ("per_device_train_batch_size", "rollout.prompts_per_step"), ("max_grad_norm", "train.grad_clip"),
    ("train.learning_rate", "train.lr"), ("ppo_mini_batch_size", "train.minibatches"),
])
def test_a_peers_name_points_to_the_run_key(name, key):
    """TRL's and verl's names got no "did you mean"; the translate module's table knows them."""
    with pytest.raises(ConfigError, match=rf"did you mean '{re.escape(key)}'\?\n.*\({name.rsplit('.')[-1]} is "):
        load_config(overrides=[f"{name}=1"])


@pytest.mark.parametrize("name", ["beta", "epsilon", "loss_type", "clip_ratio_high"])
def test_a_peers_algorithm_option_is_said_to_be_the_specs(name):
    with pytest.raises(ConfigError, match=rf"{name} is an algorithm option of TRL or verl: a parameter of the spec"):
        load_config(overrides=[f"{name}=0.1"])


def test_misspelt_section_lists_the_near_section():
    with pytest.raises(ConfigError, match=r"valid keys in \[train\]"):
        load_config(overrides=["trian.steps=3"])


@pytest.mark.parametrize("item, pattern", [
    ("rollout.n=abc", r"invalid value for rollout.n \(--set rollout.n=abc\): .*integer"),
    ("seed=null", r"seed cannot be null"),
    ("train=3", r"'train' is a section, not a value"),
    ("novalue", r"--set expects key=value"),
    ("=3", r"--set expects key=value"),
    ("device=gpu", r"'cpu' or 'cuda'"),
    ("rollout.temperature=-1", r"rollout.temperature: .*greater than or equal to 0 "
                               r"\(--set rollout.temperature=-1\)"),
    ("train.minibatches=3", r"train.minibatches=3 must divide rollout.prompts_per_step=16"),
])
def test_bad_values_give_clear_errors(item, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(overrides=[item])


def _keys_of_type(name: str) -> list[str]:
    return [key for key, typ, _default, _doc in config_reference() if name in typ.replace("|", " ").split()
            or f"[{name}," in typ]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_every_float_setting_is_finite(value):
    """inf passed every range check: train.lr=inf failed late, rollout.temperature=inf trained nothing."""
    keys = _keys_of_type("float")
    assert {"train.lr", "train.weight_decay", "train.eps", "rollout.temperature", "train.betas"} <= set(keys)
    for key in keys:
        raw = f"0.9,{value}" if key == "train.betas" else value
        with pytest.raises(ConfigError, match=rf"{key}: .*(finite|greater|less).*\(--set {key}="):
            load_config(overrides=[f"{key}={raw}"])


def test_non_finite_floats_in_a_file_or_a_table_are_refused(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nlr = inf\n")
    with pytest.raises(ConfigError, match=rf"train.lr: must be a finite number, got inf \(in {path}\)"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"data.options: must be a finite number, got nan"):
        load_config(overrides=["data.options.ratio=NaN"])


def test_every_integer_setting_fits_what_torch_and_the_os_take():
    """rollout.n = 2**63-1 failed after the model loaded (numel overflow); a seed >= 2**32 fails in
    numpy's seeding (vLLM's engine seeds numpy with it), one >= 2**64 in torch's."""
    keys = _keys_of_type("int")
    assert {"rollout.n", "train.steps", "threads", "seed"} <= set(keys)
    for key in keys:
        with pytest.raises(ConfigError, match=rf"{key}: .*\(--set {key}=9223372036854775807\)"):
            load_config(overrides=[f"{key}=9223372036854775807"])
    assert load_config(overrides=["seed=4294967295"]).seed == 2**32 - 1
    for seed in (2**32, -1):
        with pytest.raises(ConfigError, match=rf"seed: .* \(--set seed={seed}\)"):
            load_config(overrides=[f"seed={seed}"])


def test_every_timeout_is_a_wait_the_os_takes():
    """A finite 1e12-second timeout is an OverflowError in the wait (threading.TIMEOUT_MAX ~ 9.2e9 s)."""
    keys = [k for k in config_keys() if k.endswith(("timeout", "timeout_s"))]
    assert {"teacher.timeout_s", "rollout.tool_timeout_s", "distributed.collective_timeout"} <= set(keys)
    for key in keys:
        with pytest.raises(ConfigError, match=rf"{key}: must be at most \d+ seconds \(the longest wait"):
            load_config(overrides=[f"{key}=1e12"])


def test_a_table_nested_deeper_than_any_option_is_refused(tmp_path):
    """A JSON config whose data.options nested 900 lists deep was a RecursionError copying the config."""
    path = tmp_path / "nested.json"
    path.write_text('{"data": {"options": {"x": ' + "[" * 900 + "]" * 900 + "}}}")
    with pytest.raises(ConfigError, match=rf"data.options: nests lists or tables more than 32 deep \(in {path}\)"):
        load_config(path).frozen()
    assert load_config(overrides=['data.options={"a": {"b": [[1, 2]]}}']).frozen().data.options == {"a": {"b": [[1, 2]]}}


def test_toml_file_then_set_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('seed = 3\n[train]\nlr = 1e-3\nsteps = 50\nbetas = [0.8, 0.9]\n'
                    '[rollout]\nn = 4\n')
    cfg = load_config(path)
    assert (cfg.seed, cfg.train.lr, cfg.train.steps, cfg.train.betas, cfg.rollout.n) == \
        (3, 1e-3, 50, (0.8, 0.9), 4)
    cfg = load_config(path, ["train.steps=20", "train.lr=2e-4"],
                      flags={"train.steps": 7, "seed": None, "model.path": "m"})
    assert cfg.train.steps == 7          # flag > --set > file
    assert cfg.train.lr == 2e-4          # --set > file
    assert cfg.seed == 3                 # a None flag is "not given"
    assert cfg.model.path == "m"
    assert cfg.rollout.n == 4            # untouched file value


def test_toml_unknown_key_is_an_error(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[rollout]\ntemprature = 0.7\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"unknown config key 'rollout.temprature' (in {path})" in str(err.value)
    assert "did you mean 'rollout.temperature'?" in str(err.value)


def test_toml_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
    section = tmp_path / "section.toml"
    section.write_text("train = 3\n")
    with pytest.raises(ConfigError, match=r"'train' is a section.*\[train\] table"):
        load_config(section)
    typed = tmp_path / "typed.toml"
    typed.write_text('[rollout]\nn = "many"\n')
    with pytest.raises(ConfigError, match=rf"rollout.n: .*integer.*\(in {typed}\)"):
        load_config(typed)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.toml")
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'seed = 1\n[data]\nsystem_prompt = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=rf"{latin}:3:21: not UTF-8 text \(byte 0xe9\)"):
        load_config(latin)
    for name, text in (("deep.toml", "a = " + "[" * 5000 + "]" * 5000), ("deep.json", "[" * 5000 + "]" * 5000)):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"{tmp_path / name}: lists or tables nested too deeply"):
            load_config(tmp_path / name)


def _everything_changed() -> RunConfig:
    return load_config(overrides=[
        "seed=12345", "device=cuda", "threads=2", "out=runs/x", "model.path=/m",
        "model.dtype=bfloat16", "data.path=d.jsonl", "data.eval_path=e.jsonl",
        "data.prompt_key=q", "data.answer_key=null", "data.eval_size=17", "reward.name=math", "reward.on_error=skip",
        "rollout.engine=vllm", "rollout.prompts_per_step=12", "rollout.n=3",
        "rollout.temperature=0.7000000000000001", "rollout.top_p=0.95",
        "rollout.max_new_tokens=9", "train.steps=11", "train.lr=1.2345678901234567e-05",
        "train.betas=0.1,0.2", "train.grad_clip=0", "train.ppo_epochs=2", "train.minibatches=4",
        "train.lr_schedule=cosine", "train.warmup_steps=3", "train.min_lr_ratio=0.1",
        "train.critic_lr=1e-5", "eval.every=5", "eval.samples=0", "checkpoint.every=7",
        "checkpoint.keep_last=0", "log.tensorboard=true",
    ])


def test_saved_config_round_trips_exactly(tmp_path):
    for cfg in (RunConfig(), _everything_changed()):
        run = tmp_path / str(cfg.seed)
        path = save_config(cfg, run, "algorithm a extends grpo\n")
        assert path == run / CONFIG_FILE
        assert (run / SPEC_FILE).read_text() == "algorithm a extends grpo\n"
        json.loads(path.read_text())  # plain JSON a person can read
        again = load_run_config(run)
        assert again == cfg
        assert again.model_dump() == cfg.model_dump()
        assert load_config(path) == cfg  # a saved config is a valid --config file


def test_resume_base_keeps_saved_values(tmp_path):
    cfg = _everything_changed()
    save_config(cfg, tmp_path, None)
    resumed = load_config(overrides=["train.steps=40"], base=load_run_config(tmp_path))
    assert resumed.train.steps == 40
    assert resumed.model_copy(update={"train": cfg.train}) == cfg
    with pytest.raises(ConfigError, match="not a run folder"):
        load_run_config(tmp_path / "nothing")


def test_assignment_is_validated():
    cfg = RunConfig()
    cfg.train.lr = 1e-5
    with pytest.raises(ValidationError):
        cfg.train.lr = "fast"
    with pytest.raises(ValidationError):
        RunConfig(train={"lr": 1e-4, "bogus": 1})


def test_built_in_tasks_are_one_table():
    """Each built-in task is one row of the sources table (toy/sources.py: what it fills in, its
    prompts and model); data.task accepts exactly the names config.BUILTIN_TASKS gives them and no
    module tests a task's name."""
    import re
    from pathlib import Path

    from rldsl.runtime.config import BUILTIN_TASKS, DataConfig
    from rldsl.runtime.data.sources import SOURCES, source_of
    from rldsl.runtime.toy.shapes_source import SOURCE as SHAPES
    from rldsl.runtime.toy.sources import CALCULATOR

    assert source_of(load_config(None, ["data.task=shapes"])) is SHAPES
    assert set(BUILTIN_TASKS) == {"addition", "calculator", "shapes"} <= set(SOURCES)
    assert set(DataConfig.model_fields["task"].annotation.__args__) == set(BUILTIN_TASKS)
    calc = load_config(None, ["data.task=calculator"])
    assert source_of(calc) is CALCULATOR and max_new_tokens(calc) == CALCULATOR.max_new_tokens
    assert source_of(load_config(None, ["data.path=x.jsonl"])).name == "file"
    runtime = Path(__file__).resolve().parents[2] / "runtime"
    branches = [f"{p.relative_to(runtime)}:{n}" for p in runtime.rglob("*.py")
                for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                if re.search(r"task\s*[!=]=\s*['\"]|['\"]\s*[!=]=\s*\S*task\b", line)]
    assert branches == []


def test_sampling_parameters_come_from_the_config_in_one_place():
    from rldsl.runtime.rollout.engines.base import SamplingParams

    cfg = load_config(None, ["rollout.n=3", "rollout.temperature=0.7", "rollout.top_p=0.9",
                             "rollout.max_new_tokens=6", "rollout.min_new_tokens=9"])
    assert SamplingParams.for_rollout(cfg, seed=5) == SamplingParams(
        n=3, temperature=0.7, top_p=0.9, max_new_tokens=6, seed=5, min_new_tokens=6)  # within the budget
    assert SamplingParams.for_evaluation(cfg, 4, seed=1) == SamplingParams(
        n=4, temperature=0.7, top_p=0.9, max_new_tokens=6, seed=1)
    assert SamplingParams.greedy(6) == SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
