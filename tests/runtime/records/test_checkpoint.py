"""Checkpoints: HF layout, optimizer/scheduler/RNG round-trip, crash safety, rotation."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

from rldsl.runtime.records.checkpoint import (clean_incomplete, latest_checkpoint, list_checkpoints,
                                      load_checkpoint, load_weights, set_aside_after,
                                      save_checkpoint)
from rldsl.runtime.records.rng import capture_rng, restore_rng
from rldsl.runtime.records.run_dir import COMPLETE_MARKER, LATEST_FILE

VOCAB = ["<pad>", "<bos>", "<eos>", "<unk>"] + list("0123456789+=") + list("abcd")  # 20


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=20, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>", padding_side="left")


def train_step(model, optimizer, scheduler, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 20, (3, 6), generator=g)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def make_run(seed: int = 0):
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def save(run_dir, step, model, opt, sched, **kw):
    kw.setdefault("extra_state", {"step": step})
    return save_checkpoint(run_dir, step, policy=model, tokenizer=kw.pop("tokenizer", None),
                           optimizer=opt, scheduler=sched, **kw)


def test_policy_loads_with_from_pretrained(tmp_path):
    model, opt, sched = make_run()
    train_step(model, opt, sched, 1)
    path = save(tmp_path, 1, model, opt, sched, tokenizer=tiny_tokenizer())
    assert path == tmp_path / "checkpoints" / "step-1"
    assert (path / "policy" / "model.safetensors").is_file()

    loaded = AutoModelForCausalLM.from_pretrained(load_checkpoint(path).policy_path)
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    tok = AutoTokenizer.from_pretrained(path / "policy")
    assert tok.convert_tokens_to_ids(["1", "+", "="]) == [5, 14, 15]
    assert tok.pad_token == "<pad>" and tok.padding_side == "left"

    fresh = tiny_model(seed=99)
    load_weights(fresh, path / "policy")  # tied lm_head is not in the file: still loads
    assert all(torch.equal(want[k], fresh.state_dict()[k]) for k in want)


def test_optimizer_and_scheduler_resume_exactly(tmp_path):
    model, opt, sched = make_run()
    for s in range(3):
        train_step(model, opt, sched, s)
    path = save(tmp_path, 3, model, opt, sched, extra_state={"data_pos": 48, "ema": torch.tensor(0.25)})
    # The uninterrupted run goes on for two steps ...
    for s in range(3, 5):
        train_step(model, opt, sched, s)

    # ... and so does a run restored from the checkpoint, from fresh objects.
    ckpt = load_checkpoint(tmp_path)  # a run folder resolves to its newest checkpoint
    assert ckpt.path == path and ckpt.step == 3
    assert ckpt.extra["data_pos"] == 48 and torch.equal(ckpt.extra["ema"], torch.tensor(0.25))
    restored = AutoModelForCausalLM.from_pretrained(ckpt.policy_path)
    opt2 = torch.optim.AdamW(restored.parameters(), lr=1e-2, betas=(0.9, 0.99))
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (1 + s))
    ckpt.restore(optimizer=opt2, scheduler=sched2, rng=False)
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)
    for s in range(3, 5):
        train_step(restored, opt2, sched2, s)
    want, got = model.state_dict(), restored.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_rng_draws_after_restore_equal_the_originals(tmp_path):
    model, opt, sched = make_run()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(2)  # move away from the seeded start
    save(tmp_path, 0, model, opt, sched)
    original = (random.random(), np.random.normal(size=3).tolist(), torch.randn(4).tolist(),
                random.getrandbits(64))
    # Scramble every generator, then restore.
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    load_checkpoint(tmp_path).restore()
    again = (random.random(), np.random.normal(size=3).tolist(), torch.randn(4).tolist(),
             random.getrandbits(64))
    assert again == original


def test_restore_rng_round_trip_in_memory():
    np.random.seed(5)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    state = capture_rng()
    a = (np.random.normal(), random.random(), torch.rand(1).item())
    restore_rng(state)
    assert (np.random.normal(), random.random(), torch.rand(1).item()) == a


def test_interrupted_saves_are_ignored_and_cleaned(tmp_path):
    model, opt, sched = make_run()
    save(tmp_path, 5, model, opt, sched)
    root = tmp_path / "checkpoints"
    # A crash mid-write leaves a .tmp folder (even with a marker) ...
    leftover = root / ".tmp-step-9"
    leftover.mkdir()
    (leftover / COMPLETE_MARKER).write_text(json.dumps({"step": 9, "files": []}))
    # ... or a step folder without its marker, or with a marker naming a missing file.
    (root / "step-7" / "policy").mkdir(parents=True)
    (root / "step-8").mkdir()
    (root / "step-8" / COMPLETE_MARKER).write_text(json.dumps({"step": 8, "files": ["state.pt"]}))

    assert latest_checkpoint(tmp_path) == root / "step-5"
    assert list_checkpoints(tmp_path) == [root / "step-5"]
    assert load_checkpoint(tmp_path).step == 5
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(root / "step-7")

    save(tmp_path, 10, model, opt, sched)
    # the crash leftovers go; step folders that fail their marker are damaged: set aside, kept
    assert sorted(p.name for p in root.iterdir()) == ["damaged-step-7", "damaged-step-8", LATEST_FILE,
                                                      "step-10", "step-5"]
    assert (root / LATEST_FILE).read_text() == "step-10\n"
    assert clean_incomplete(tmp_path) == []


def test_latest_is_found_even_if_the_pointer_lags(tmp_path):
    model, opt, sched = make_run()
    save(tmp_path, 1, model, opt, sched)
    save(tmp_path, 2, model, opt, sched)
    (tmp_path / "checkpoints" / LATEST_FILE).write_text("step-1\n")  # crash before the update
    assert latest_checkpoint(tmp_path).name == "step-2"


def test_keep_last_rotates_old_checkpoints(tmp_path):
    model, opt, sched = make_run()
    for step in (10, 20, 30, 40):
        save(tmp_path, step, model, opt, sched, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-30", "step-40"]
    assert (tmp_path / "checkpoints" / LATEST_FILE).read_text() == "step-40\n"


def test_resaving_a_step_replaces_it_and_later_ones_can_be_set_aside(tmp_path):
    model, opt, sched = make_run()
    for step in (1, 2, 3):
        save(tmp_path, step, model, opt, sched, extra_state={"tag": "first"})
    moved = set_aside_after(tmp_path, 1)
    assert [p.name for p in moved] == ["step-3", "step-2"]
    assert (tmp_path / "checkpoints" / LATEST_FILE).read_text() == "step-1\n"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-1"]
    assert {"damaged-step-2", "damaged-step-3"} <= {p.name for p in (tmp_path / "checkpoints").iterdir()}
    save(tmp_path, 1, model, opt, sched, extra_state={"tag": "second"})
    assert load_checkpoint(tmp_path).extra == {"tag": "second"}


def test_critic_without_save_pretrained(tmp_path):
    model, opt, sched = make_run()
    critic = torch.nn.Linear(4, 1)
    copt = torch.optim.SGD(critic.parameters(), lr=0.1, momentum=0.9)
    critic(torch.ones(2, 4)).sum().backward()
    copt.step()
    save(tmp_path, 1, model, opt, sched, critic=critic, critic_optimizer=copt)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.critic_path is not None and (ckpt.critic_path / "model.safetensors").is_file()
    other = torch.nn.Linear(4, 1)
    load_weights(other, ckpt.critic_path)
    assert torch.equal(other.weight, critic.weight) and torch.equal(other.bias, critic.bias)
    copt2 = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    ckpt.restore(critic_optimizer=copt2, rng=False)
    buf = copt2.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(buf, copt.state_dict()["state"][0]["momentum_buffer"])


def test_unsafe_extra_state_is_refused_before_writing(tmp_path):
    model, opt, sched = make_run()
    with pytest.raises(TypeError, match=r"extra_state\['pos'\] holds a numpy.int64.*\.item\(\)"):
        save(tmp_path, 1, model, opt, sched, extra_state={"pos": np.int64(3)})
    assert list_checkpoints(tmp_path) == []


def test_load_weights_reports_mismatched_files(tmp_path):
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(1, 4), "stray": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="stray"):
        load_weights(torch.nn.Linear(4, 1), tmp_path)
    save_file({"weight": torch.zeros(1, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="bias"):
        load_weights(torch.nn.Linear(4, 1), tmp_path)


def test_no_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(tmp_path)
