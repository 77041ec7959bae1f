"""``toy:arithmetic-chat`` (runtime/tinker/arithmetic_chat.py): a tiny model warm-started on the
cookbook's arithmetic recipe as its role_colon renderer writes it, served by ``rldsl serve-tinker
--model Qwen/Qwen3-8B-Base=toy:arithmetic-chat``; the unchanged recipe gets a reward above 0 from it.
Its tokenizer is its own: the embedded toy's tokenizer and warm-start cache key stay as they were."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from rldsl.runtime.errors import RunError
from rldsl.runtime.rewards.server import BackgroundServer
from rldsl.runtime.tinker.arithmetic_chat import MAX_TOKENS, arithmetic_chat_model, chat_tokenizer, shared_prefix_loss
from rldsl.runtime.tinker.models import MODEL_REF, served_models
from rldsl.runtime.tinker.server import make_app
from rldsl.runtime.tinker.service import Service
from rldsl.runtime.toy.model import build_tokenizer, tiny_config, vllm_variant_config
from rldsl.runtime.toy.warmup import WarmStartConfig, warm_start_key

from tinker_helpers import KEY, NAME


def test_the_chat_tokenizer_keeps_the_renderers_newlines():
    """The role_colon format is "User: ...\\n\\nAssistant:" and stops at "\\n\\nUser:": every character,
    the newlines included, is a token of its own (a "." split once made "\\n\\n" one unknown token)."""
    tok = chat_tokenizer()
    text = "User: What is 57 + 23?\n\nAssistant: 80\n\nUser:"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_the_embedded_toys_tokenizer_and_warm_start_key_are_unchanged():
    """The chat model's tokenizer is its own: the embedded toy's (and so the folder its cached warm
    start is found under, and the tokenizer saved beside it) is what it was before the chat model."""
    chat_tokenizer()
    toy = build_tokenizer().backend_tokenizer.to_str()
    assert hashlib.sha256(toy.encode()).hexdigest()[:16] == "18e591a2b19ded91"
    assert warm_start_key(WarmStartConfig(), tiny_config()) == "1daa0e1686f22249"
    assert warm_start_key(WarmStartConfig(), vllm_variant_config()) == "508efc079e7894cc"


def test_the_shared_prefix_gives_the_whole_rows_loss_and_gradient():
    """A warm-start step runs the few-shot prefix once for the batch: the same loss and gradient as
    running every row whole."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(max_position_embeddings=64))
    prefix = torch.randint(4, 20, (9,)).tolist()
    rows = [torch.randint(4, 20, (n,)).tolist() for n in (5, 8, 3)]
    labels = [[-100, -100, *r[2:]] for r in rows]
    loss = shared_prefix_loss(model, prefix, rows, labels, pad_id=0)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    width = len(prefix) + max(map(len, rows))
    ids = torch.zeros((3, width), dtype=torch.long)
    lab = torch.full((3, width), -100)
    for i, (row, label) in enumerate(zip(rows, labels)):
        ids[i, :len(prefix) + len(row)] = torch.tensor(prefix + row)
        lab[i, len(prefix):len(prefix) + len(row)] = torch.tensor(label)
    whole = model(input_ids=ids, labels=lab).loss
    whole_grads = torch.autograd.grad(whole, list(model.parameters()))
    assert loss.item() == pytest.approx(whole.item(), abs=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(grads, whole_grads)) < 1e-5


def test_a_bad_model_option_is_refused_before_the_warm_start(monkeypatch, tmp_path):
    monkeypatch.setattr("rldsl.runtime.tinker.arithmetic_chat.arithmetic_chat_model",
                        lambda **_: pytest.fail("warm-started before every option was checked"))
    with pytest.raises(RunError, match="no config.json"):
        served_models([f"{NAME}={MODEL_REF}", f"other={tmp_path}"])


def test_a_tokenizer_that_cannot_write_the_stop_string_is_refused_before_training(monkeypatch, tmp_path):
    """The warm start once trained for 17 minutes on a tokenizer that made "\\n\\n" one unknown token:
    its answers could never stop. Such a tokenizer is refused before any step."""
    pytest.importorskip("tinker_cookbook")
    from rldsl.runtime.tinker import arithmetic_chat

    monkeypatch.setattr(arithmetic_chat, "CHAT_CHARACTERS", arithmetic_chat.CHAT_CHARACTERS.replace("\n", ""))
    with pytest.raises(RuntimeError, match="stop string"):
        arithmetic_chat.arithmetic_chat_model(cache=tmp_path)
    assert not list(tmp_path.rglob("warm_start.json"))


@pytest.mark.slow
def test_the_recipe_gets_a_reward_from_the_warm_started_model(tmp_path):
    """``--model NAME=toy:arithmetic-chat`` resolves to the cached warm start (built on the first
    use: minutes); the unchanged ``math_rl.train env=arithmetic`` answers some of its problems
    right (reward > 0) and in its format."""
    pytest.importorskip("tinker_cookbook")
    (folder,) = served_models([f"{NAME}={MODEL_REF}"]).values()
    assert folder == arithmetic_chat_model()
    home = tmp_path / "home"
    (home / NAME).parent.mkdir(parents=True)
    (home / NAME).symlink_to(folder)
    log = tmp_path / "log"
    service = Service({NAME: folder}, tmp_path / "states")
    env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled"}
    try:
        with BackgroundServer(make_app(service, None)) as url:
            done = subprocess.run([sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", f"base_url={url}",
                                   f"model_name={NAME}", "env=arithmetic", "group_size=4", "groups_per_batch=8",
                                   f"max_tokens={MAX_TOKENS}", "max_steps=2", "lora_rank=4", "eval_every=0",
                                   "save_every=0", f"log_path={log}", "behavior_if_log_dir_exists=delete"],
                                  cwd=home, env=env, capture_output=True, text=True, timeout=300)
    finally:
        service.close()
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "env/all/reward/total" in r]
    assert len(rows) == 2
    assert sum(r["env/all/reward/total"] for r in rows) > 0, rows
    assert min(r["env/all/format"] for r in rows) > 0.9, rows  # it stops at the renderer's "\n\nUser:"
