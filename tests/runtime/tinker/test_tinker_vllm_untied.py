"""``serve-tinker --engine vllm`` serves a model that ties its output embedding from an untied copy
of its folder (runtime/tinker/vllm_sampler.py ``untied``): a LoRA on ``lm_head`` changes the output
embedding alone, which a tied vLLM model cannot hold. Checked without vLLM: the copy is the same
model (same logits), its head a parameter of its own, the original folder untouched."""
from __future__ import annotations

import json

import torch

from rldsl.runtime.tinker.vllm_sampler import HEAD, untied


def test_a_tied_model_is_served_from_an_untied_copy_with_the_same_logits(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    assert json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"] is True
    copy = untied(model_dir, tmp_path / "untied")
    assert copy != model_dir and json.loads((copy / "config.json").read_text())["tie_word_embeddings"] is False
    assert json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"] is True  # untouched
    tied, loose = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (model_dir, copy))
    assert loose.lm_head.weight.data_ptr() != loose.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(loose.lm_head.weight, tied.lm_head.weight, rtol=0, atol=0)
    ids = torch.tensor([[1, 5, 6, 14, 7, 17]])
    torch.testing.assert_close(loose(ids).logits, tied(ids).logits, rtol=0, atol=0)
    assert HEAD in dict(loose.named_parameters())


def test_an_untied_model_is_served_from_its_own_folder(model_dir, tmp_path):
    folder = tmp_path / "own"
    folder.mkdir()
    for f in model_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    assert untied(folder, tmp_path / "unused") == folder and not (tmp_path / "unused").exists()
