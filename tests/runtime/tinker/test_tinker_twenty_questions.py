"""tinker-cookbook's twenty-questions recipe (multiplayer: the trained player asks, a second model,
``Qwen/Qwen3.5-9B`` as the recipe names it, answers through its own sampling client), unchanged,
against ``rldsl serve-tinker`` serving both names from local folders (docs/tinker.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rldsl.runtime.rewards.server import BackgroundServer
from rldsl.runtime.tinker.server import make_app
from rldsl.runtime.tinker.service import Service

from tinker_helpers import KEY, NAME

pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")

pytestmark = pytest.mark.slow
ANSWERER = "Qwen/Qwen3.5-9B"  # the recipe's answerer_base_model, not an option of its command line


def _answerer(home) -> None:
    """The fixture's model with ``<think>`` and ``</think>`` as single tokens: the answerer's
    renderer (``qwen3_5_disable_thinking``) asserts that its tokenizer has them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(home / NAME)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    model = AutoModelForCausalLM.from_pretrained(home / NAME)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(home / ANSWERER)
    tok.save_pretrained(home / ANSWERER)


def test_the_multiplayer_twenty_questions_recipe_runs(tinker_home, tmp_path):
    if not (tinker_home / ANSWERER).exists():
        _answerer(tinker_home)
    log = tmp_path / "twenty"
    service = Service({NAME: tinker_home / NAME, ANSWERER: tinker_home / ANSWERER}, tmp_path / "states")
    try:
        with BackgroundServer(make_app(service, None)) as url:
            env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_BASE_URL": url, "HF_HUB_OFFLINE": "1",
                   "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
            done = subprocess.run([sys.executable, "-m", "tinker_cookbook.recipes.multiplayer_rl.twenty_questions.train",
                                   f"model_name={NAME}", "renderer_name=role_colon", "group_size=2", "batch_size=2",
                                   "max_tokens=8", "max_steps=1", "eval_every=0", "save_every=0", f"log_path={log}"],
                                  cwd=tinker_home, env=env, capture_output=True, text=True, timeout=600)
        # the answerer is the second served name, sampled as the base model (no adapters)
        assert any(s.base == ANSWERER and s.model_id is None for s in service.samplers.values())
    finally:
        service.close()
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "optim/kl_sample_train_v1" in r]
    assert len(rows) == 1 and abs(rows[0]["optim/kl_sample_train_v1"]) < 1e-6
