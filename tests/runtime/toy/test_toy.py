"""The embedded toy: tokenizer, model config, addition task, carry-dropping teacher, warm start + cache."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from rldsl.runtime import toy
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.rewards.functions import RewardFn
from rldsl.runtime.toy import warmup



def test_tokenizer_one_token_per_character(tokenizer) -> None:
    assert len(tokenizer) == 23
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2, 3)
    # <bos> then '1' '2' '+' '3' '=' : digits are 4 + d, '+' is 14, '=' is 17
    assert tokenizer("12+3=").input_ids == [1, 5, 6, 14, 7, 17]
    assert tokenizer("(1, 2): -3 * 4").input_ids[1:] == [20, 5, 18, 22, 6, 21, 19, 22, 15, 7, 22, 16, 22, 8]
    assert tokenizer("1x").input_ids == [1, 5, 3]  # unknown character
    assert tokenizer.decode([1, 5, 6, 14, 7, 17, 2, 0], skip_special_tokens=True) == "12+3="


def test_tokenizer_left_pads_and_round_trips_offline(tokenizer, tmp_path) -> None:
    batch = tokenizer(["1+2=", "10+20="], padding=True)
    assert batch.input_ids[0] == [0, 0, 1, 5, 14, 6, 17]
    assert batch.attention_mask[0] == [0, 0, 1, 1, 1, 1, 1]
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.padding_side == "left" and loaded.pad_token_id == 0 and loaded.eos_token_id == 2
    assert loaded(["1+2=", "10+20="], padding=True).input_ids == batch.input_ids


def test_tiny_config_parameter_count(tokenizer) -> None:
    config = toy.tiny_config(tokenizer)
    model = LlamaForCausalLM(config)
    V, H, M, L = 23, 96, 384, 4
    per_layer = 4 * H * H + 3 * H * M + 2 * H  # attention, MLP, two RMSNorms
    assert sum(p.numel() for p in model.parameters()) == V * H + L * per_layer + H == 592_896
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert config.attention_dropout == 0.0 and config.pad_token_id != config.eos_token_id


def test_task_split_is_fixed_and_disjoint() -> None:
    task = toy.AdditionTask()
    train, held = task.train_examples(), task.heldout_examples()
    assert len(held) == 200 and len(train) == 90 * 90 - 200
    assert {e.prompt for e in train}.isdisjoint(e.prompt for e in held)
    assert held == toy.AdditionTask().heldout_examples()
    assert held != toy.AdditionTask(heldout_seed=5).heldout_examples()
    ex = next(e for e in train if e.prompt == "58+67=")
    assert ex.answer == "125"


def test_no_heldout_prompt_has_its_commuted_twin_in_train() -> None:
    task = toy.AdditionTask()
    train = {e.prompt for e in task.train_examples()}
    held = task.heldout_examples()
    twins = [f"{b}+{a}=" for a, b in (e.prompt[:-1].split("+") for e in held)]
    assert not train.intersection(twins)
    assert sum(t in {e.prompt for e in held} for t in twins) == len(held)  # every twin is held out too
    valid = task.validation_examples()
    assert len(valid) == 200 and {e.prompt for e in valid} <= train  # a slice of the training pairs
    assert {e.prompt for e in valid}.isdisjoint(e.prompt for e in held)


@pytest.mark.filterwarnings("ignore:toy warm start")
def test_warm_start_never_reads_heldout_prompts(monkeypatch, tokenizer) -> None:
    """The stopping rule looks at the validation slice; the supervised steps skip it too."""
    def forbidden(self):
        raise AssertionError("the warm start read the held-out prompts")

    task = toy.AdditionTask()
    held = {e.prompt for e in task.heldout_examples()}
    valid = {e.prompt for e in task.validation_examples()}
    seen_train, seen_eval = set(), []
    real_batch, real_greedy = warmup._answer_batch, warmup.greedy_answers

    def spy_batch(tok, pairs, answers):
        seen_train.update(f"{a}+{b}=" for a, b in pairs)
        return real_batch(tok, pairs, answers)

    def spy_greedy(engine, prompts, max_new_tokens=4):
        seen_eval.append(set(prompts))
        return real_greedy(engine, prompts, max_new_tokens)

    monkeypatch.setattr(toy.AdditionTask, "heldout_examples", forbidden)
    monkeypatch.setattr(warmup, "_answer_batch", spy_batch)
    monkeypatch.setattr(warmup, "greedy_answers", spy_greedy)
    config = toy.WarmStartConfig(max_steps=4, eval_every=2, batch_size=64)
    _, report = warmup._train_warm_start(config, toy.tiny_config(tokenizer), tokenizer, verbose=False)
    assert seen_eval == [valid, valid] and report["steps"] == 4
    assert len(seen_train) > 100 and seen_train.isdisjoint(held) and seen_train.isdisjoint(valid)
    assert "validation_accuracy" in report and "heldout_accuracy" not in report


@pytest.mark.parametrize(("a", "b", "carry_free"), [(58, 67, "15"), (45, 54, "99"), (19, 11, "20"), (99, 99, "88")])
def test_teacher_hand_cases(a, b, carry_free) -> None:
    assert toy.carry_free_sum(a, b) == carry_free
    assert toy.teacher_answer(a, b, drop_carry=0.0, rng=random.Random(0)) == str(a + b)


def test_teacher_drops_each_carry_with_probability() -> None:
    rng = random.Random(0)
    n = 4000
    # 19+11 has one carry: right 1/4 of the time; 99+99 has two: right 1/16
    one = sum(toy.teacher_answer(19, 11, drop_carry=0.75, rng=rng) == "30" for _ in range(n)) / n
    two = sum(toy.teacher_answer(99, 99, drop_carry=0.75, rng=rng) == "198" for _ in range(n)) / n
    assert abs(one - 0.25) < 0.03 and abs(two - 1 / 16) < 0.015


def test_cache_dir_precedence(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("RLDSL_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert toy.cache_dir() == tmp_path / "home" / ".cache" / "rldsl"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert toy.cache_dir() == tmp_path / "xdg" / "rldsl"
    monkeypatch.setenv("RLDSL_CACHE", str(tmp_path / "mine"))
    assert toy.cache_dir() == tmp_path / "mine"


def test_cache_key_covers_every_setting(tokenizer) -> None:
    base, model_config = toy.WarmStartConfig(), toy.tiny_config(tokenizer)
    key = toy.warm_start_key(base, model_config)
    assert key == toy.warm_start_key(toy.WarmStartConfig(), toy.tiny_config(tokenizer))
    variants = [
        toy.warm_start_key(replace(base, seed=1), model_config),
        toy.warm_start_key(replace(base, drop_carry=0.5), model_config),
        toy.warm_start_key(replace(base, task=toy.AdditionTask(heldout_seed=2)), model_config),
        toy.warm_start_key(replace(base, task=toy.AdditionTask(num_validation=100)), model_config),
        toy.warm_start_key(base, toy.tiny_config(tokenizer, hidden_size=64)),
    ]
    assert len({key, *variants}) == 6


def test_warm_start_cache_is_atomic_and_reused(monkeypatch, tmp_path, tokenizer, tiny_model_factory) -> None:
    calls = []

    def fake_train(config, model_config, tok, *, verbose):
        calls.append(config.seed)
        return tiny_model_factory(tok), {"heldout_accuracy": 0.3}

    monkeypatch.setattr(warmup, "_train_warm_start", fake_train)
    path = toy.warm_start(toy.WarmStartConfig(seed=3), cache=tmp_path)
    assert path.parent == tmp_path / "warm_start"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp dir left behind
    assert toy.warm_start(toy.WarmStartConfig(seed=3), cache=tmp_path) == path and calls == [3]
    model, tok = toy.load_warm_start(path)
    assert tok("1+2=").input_ids == tokenizer("1+2=").input_ids
    assert torch.equal(model.model.norm.weight, tiny_model_factory(tokenizer).model.norm.weight)


def test_a_cache_entry_is_published_whole_or_not_at_all(tmp_path) -> None:
    """rldsl.cache.publish, which every warm start uses: a write that fails leaves neither the entry
    nor its temporary folder; when another process published the entry first, its copy is kept."""
    from rldsl.cache import publish
    target = tmp_path / "warm_start" / "k"

    def broken(folder):
        (folder / "weights").write_text("half")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError, match="disk full"):
        publish(target, broken, done="warm_start.json")
    assert list((tmp_path / "warm_start").iterdir()) == []

    def first(folder):
        (folder / "warm_start.json").write_text("first")
    assert publish(target, first, done="warm_start.json") == target

    def second(folder):
        (folder / "other").write_text("x")
        (folder / "warm_start.json").write_text("second")
    assert publish(target, second, done="warm_start.json") == target  # the rename meets a full folder
    assert (target / "warm_start.json").read_text() == "first" and not (target / "other").exists()
    assert [p.name for p in (tmp_path / "warm_start").iterdir()] == ["k"]


def sampled_accuracy(path, n: int = 8) -> float:
    """Mean addition reward of n samples at temperature 1 per held-out prompt."""
    model, tok = toy.load_warm_start(path)
    heldout = toy.AdditionTask().heldout_examples()
    batch = HFEngine(model, tok).generate(
        [e.prompt for e in heldout], SamplingParams(n=n, temperature=1.0, max_new_tokens=4, seed=0)
    )
    batch.answers = [e.answer for e in heldout for _ in range(n)]
    return RewardFn("addition")(batch).mean().item()


def test_evaluate_greedy_counts_exact_answers(tiny_model, tokenizer) -> None:
    examples = toy.AdditionTask().heldout_examples()[:20]
    answers = toy.greedy_answers(HFEngine(tiny_model, tokenizer), [e.prompt for e in examples])
    assert len(answers) == 20
    # make the first three "right" by construction: their answers become the model's outputs
    relabeled = [
        replace(e, answer=a) if i < 3 and a is not None else replace(e, answer="x")
        for i, (e, a) in enumerate(zip(examples, answers))
    ]
    expected = sum(a is not None for a in answers[:3]) / 20
    assert toy.evaluate_greedy(tiny_model, tokenizer, relabeled) == expected


@pytest.mark.slow
def test_warm_start_end_to_end(monkeypatch) -> None:
    """The default warm start, from the user's cache: trained by whichever test (or run) asked
    first on a fresh machine (CI), not a second time here; a cached folder is returned as it is."""
    path = toy.warm_start()
    model, tok = toy.load_warm_start(path)
    greedy = toy.evaluate_greedy(model, tok, toy.AdditionTask().heldout_examples())
    assert 0.2 <= greedy <= 0.4
    assert (path / "warm_start.json").is_file()
    # carries are learned as the teacher's distribution: sampling finds more right answers
    assert sampled_accuracy(path) > greedy

    def trained_again(*a, **k):
        raise AssertionError("a cached warm start was trained again")

    monkeypatch.setattr(warmup, "_train_warm_start", trained_again)
    assert toy.warm_start() == path
