"""``rldsl serve-tinker`` driven by the unchanged ``tinker`` client: training, sampling, states,
and every bad input a clear 4xx after which the server keeps serving (docs/tinker.md)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tinker_helpers import KEY, NAME

tinker = pytest.importorskip("tinker")
types = tinker.types


def _datum(tokens: list[int], **inputs: np.ndarray):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]), **inputs})


def _ce(tokens: list[int]):
    return _datum(tokens, weights=np.ones(len(tokens) - 1, dtype=np.float32))


def _sample(sampler, prompt: list[int], **params):
    return sampler.sample(types.ModelInput.from_ints(prompt), num_samples=params.pop("n", 1),
                          sampling_params=types.SamplingParams(**params)).result()


def test_capabilities_info_and_tokenizer_name(client):
    sc, _ = client
    caps = sc.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [NAME]
    tc = sc.create_lora_training_client(base_model=NAME, rank=4, train_unembed=False, seed=3).result()
    info = tc.get_info()
    assert (info.model_data.tokenizer_id, info.model_data.model_name, info.lora_rank) == (NAME, NAME, 4)
    assert tc.get_tokenizer().encode("hello") == sc.create_lora_training_client(
        base_model=NAME, rank=2).result().get_tokenizer().encode("hello")  # two models in one session


def test_training_logprobs_are_the_samplers_and_a_step_moves_the_sampler(client):
    sc, _ = client
    tc = sc.create_lora_training_client(base_model=NAME, rank=4, seed=0).result()
    prompt = tc.get_tokenizer().encode("What is 2 plus 3?")
    sampler = tc.save_weights_and_get_sampling_client()
    seq = _sample(sampler, prompt, max_tokens=6, temperature=1.0, seed=1).sequences[0]
    assert len(seq.tokens) == 6 and seq.stop_reason == "length" and len(seq.logprobs) == 6
    full = prompt + seq.tokens
    out = tc.forward([_ce(full)], "cross_entropy").result()
    trained = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert trained.shape == (len(full) - 1,)  # one value per target token
    np.testing.assert_allclose(trained[len(prompt) - 1:], seq.logprobs, atol=1e-4)
    assert out.metrics["loss:sum"] == pytest.approx(-trained.sum(), rel=1e-5)

    tc.forward_backward([_ce(full)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.save_weights_and_get_sampling_client()
    new = tc.forward([_ce(full)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert new.sum() > trained.sum() + 1e-3  # the step raised the data's likelihood
    # the new sampler serves the new weights, the old one still the old
    again = _sample(after, prompt, max_tokens=6, seed=1, n=2)
    for s in again.sequences:
        ref = tc.forward([_ce(prompt + s.tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        np.testing.assert_allclose(ref.to_numpy()[len(prompt) - 1:], s.logprobs, atol=1e-4)
    old = _sample(sampler, prompt, max_tokens=6, seed=1).sequences[0]
    assert old.tokens == seq.tokens
    np.testing.assert_allclose(old.logprobs, seq.logprobs, atol=1e-6)


def test_stop_strings_tokens_and_prompt_logprobs(client):
    sc, _ = client
    tc = sc.create_lora_training_client(base_model=NAME, rank=4).result()
    tok = tc.get_tokenizer()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = tok.encode("Count: 1 2 3")
    free = _sample(sampler, prompt, max_tokens=12, temperature=1.0, seed=5, stop=[]).sequences[0]
    assert len(free.tokens) == 12 and free.stop_reason == "length"
    # a stop token: generation ends at it, the token kept
    stop_id = free.tokens[4]
    cut = _sample(sampler, prompt, max_tokens=12, temperature=1.0, seed=5, stop=[stop_id]).sequences[0]
    first = free.tokens.index(stop_id)
    assert cut.tokens == free.tokens[:first + 1] and cut.stop_reason == "stop"
    # a stop string: the first token whose decoded text completes it ends the completion
    text = tok.decode(free.tokens[5:7])
    if text.strip():
        by_text = _sample(sampler, prompt, max_tokens=12, temperature=1.0, seed=5, stop=[text]).sequences[0]
        assert text in tok.decode(by_text.tokens) and text not in tok.decode(by_text.tokens[:-1])
        assert by_text.stop_reason == "stop"
    full = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, include_prompt_logprobs=True,
                          sampling_params=types.SamplingParams(max_tokens=1)).result()
    lp = full.prompt_logprobs
    assert lp[0] is None and len(lp) == len(prompt)
    ref = tc.forward([_ce(prompt)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(lp[1:], ref, atol=1e-4)


def test_zero_advantages_give_a_finite_loss_and_gradient(client):
    sc, _ = client
    tc = sc.create_lora_training_client(base_model=NAME, rank=4).result()
    tokens = tc.get_tokenizer().encode("one two three four")
    n = len(tokens) - 1
    for loss in ("importance_sampling", "ppo", "cispo", "dro", "gspo"):
        d = _datum(tokens, logprobs=np.full(n, -2.0, dtype=np.float32), advantages=np.zeros(n, dtype=np.float32))
        out = tc.forward_backward([d], loss).result()
        assert math.isfinite(out.metrics["loss:sum"]), loss
    step = tc.optim_step(types.AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)).result()
    assert math.isfinite(step.metrics["grad_norm:mean"])


def test_bad_inputs_are_4xx_and_the_server_keeps_serving(client):
    import httpx
    sc, url = client
    tc = sc.create_lora_training_client(base_model=NAME, rank=4).result()
    tokens = tc.get_tokenizer().encode("a small sentence")
    good = _ce(tokens)

    def still_serving() -> None:
        assert tc.forward([good], "cross_entropy").result().metrics["loss:sum"] > 0

    r = httpx.post(f"{url}/api/v1/no_such_route", json={}, headers={"X-API-Key": KEY})
    assert r.status_code == 404 and "does not serve POST /api/v1/no_such_route" in r.json()["error"]
    with pytest.raises(tinker.BadRequestError, match="unknown loss 'nope'"):
        tc.forward_backward([good], "nope").result()
    tc = sc.create_lora_training_client(base_model=NAME, rank=4).result()  # a failed call poisons a client
    with pytest.raises(tinker.BadRequestError, match="stable_reinforce.*not served"):
        tc.forward_backward([good], "stable_reinforce").result()
    tc = sc.create_lora_training_client(base_model=NAME, rank=4).result()
    r = httpx.post(f"{url}/api/v1/forward_backward", content=b"\xff\x01garbage", headers={"X-API-Key": KEY})
    assert r.status_code == 400 and "not a ForwardBackwardRequest" in r.json()["error"]
    bad = _datum(tokens, weights=np.ones(len(tokens) + 2, dtype=np.float32))
    with pytest.raises(tinker.BadRequestError, match="has .* values for .* input tokens"):
        tc.forward_backward([bad], "cross_entropy").result()
    tc = sc.create_lora_training_client(base_model=NAME, rank=4).result()
    sampler = tc.save_weights_and_get_sampling_client()
    with pytest.raises(tinker.BadRequestError, match="past the model's context of 2048"):
        _sample(sampler, tokens, max_tokens=4000)
    still_serving()


def test_a_wrong_key_is_refused_when_a_key_is_set(start_server):
    import httpx
    with start_server(api_key="tml-right") as url:
        r = httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-wrong"})
        assert r.status_code == 401 and "wrong API key" in r.json()["error"]
        r = httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-right"})
        assert r.status_code == 200 and r.json()["supported_models"][0]["model_name"] == NAME


def _step(tc, data, lr=1e-2):
    out = tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=lr)).result()
    return out.metrics["loss:sum"]


def test_save_then_load_on_a_new_server_continues_as_uninterrupted(start_server, tinker_home, tmp_path, monkeypatch):
    monkeypatch.chdir(tinker_home)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = tmp_path / "states"
    with start_server(root=root) as url:
        sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=NAME, rank=4, seed=7).result()
        data = [_ce(tc.get_tokenizer().encode("the cat sat on the mat")), _ce(tc.get_tokenizer().encode("two dogs"))]
        _step(tc, data)
        path = tc.save_state("mid").result().path
        assert path.startswith("tinker://") and path.endswith("/weights/mid")
        loss_next = _step(tc, data)
        after = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    from rldsl.runtime.records.checkpoint import list_checkpoints, verify_checkpoint
    saved = list_checkpoints(next(root.glob("*/weights/mid")))
    assert [p.name for p in saved] == ["step-1"] and verify_checkpoint(saved[0]) is None  # whole, checksummed
    with start_server(root=root) as url:
        sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        resumed = sc.create_training_client_from_state_with_optimizer(path)
        assert _step(resumed, data) == pytest.approx(loss_next, abs=1e-6)
        again = resumed.forward(data, "cross_entropy").result().loss_fn_outputs
        for a, b in zip(after, again):
            np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-6)
        # without the optimizer state the step differs (Adam's moments start again)
        fresh = sc.create_training_client_from_state(path)
        _step(fresh, data)
        other = fresh.forward(data, "cross_entropy").result().loss_fn_outputs
        assert not np.allclose(other[0]["logprobs"].to_numpy(), after[0]["logprobs"].to_numpy(), atol=1e-6)


def test_a_spec_as_a_custom_loss_equals_the_spec_served_by_name(client):
    import rldsl.tinker
    sc, _ = client
    a = sc.create_lora_training_client(base_model=NAME, rank=4, seed=11).result()
    b = sc.create_lora_training_client(base_model=NAME, rank=4, seed=11).result()
    tok = a.get_tokenizer()
    rng = np.random.default_rng(0)
    data, plain = [], []
    for text in ("What is 2 plus 3? 5", "What is 7 plus 1? 8", "Say hi: hi there"):
        tokens = tok.encode(text)
        n = len(tokens) - 1
        sampled = np.zeros(n, dtype=np.float32)
        sampled[n // 2:] = -rng.random(n - n // 2).astype(np.float32) * 3
        adv = np.zeros(n, dtype=np.float32)
        adv[n // 2:] = rng.normal()
        data.append(_datum(tokens, logprobs=sampled, advantages=adv))
        plain.append(_ce(tokens))
    by_name = a.forward_backward(data, "importance_sampling", loss_fn_config={"rldsl_spec": "dapo"}).result()
    custom = b.forward_backward_custom(data, rldsl.tinker.custom_loss("dapo")).result()
    assert custom.metrics["loss:sum"] == pytest.approx(by_name.metrics["loss:sum"], abs=1e-6)
    assert custom.metrics["clip_fraction:mean"] == pytest.approx(by_name.metrics["clip_fraction:mean"], abs=1e-6)
    for tc in (a, b):
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after_a = a.forward(plain, "cross_entropy").result().loss_fn_outputs
    after_b = b.forward(plain, "cross_entropy").result().loss_fn_outputs
    for x, y in zip(after_a, after_b):
        np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=1e-6)
    before = by_name.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert not np.allclose(before, after_a[0]["logprobs"].to_numpy(), atol=1e-4)  # the step moved them


def test_a_spec_named_in_the_config_trains_and_its_clip_fraction_reaches_the_step(client):
    sc, _ = client
    tc = sc.create_lora_training_client(base_model=NAME, rank=4).result()
    tokens = tc.get_tokenizer().encode("What is 4 plus 4? 8")
    n = len(tokens) - 1
    d = _datum(tokens, logprobs=np.full(n, -1.0, dtype=np.float32), advantages=np.ones(n, dtype=np.float32))
    out = tc.forward_backward([d], "importance_sampling", loss_fn_config={"rldsl_spec": "dapo"}).result()
    assert 0 <= out.metrics["clip_fraction:mean"] <= 1
    step = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert step.metrics["clip_fraction:mean"] == pytest.approx(out.metrics["clip_fraction:mean"])
    with pytest.raises(tinker.BadRequestError, match="unknown argument 'hihg'"):
        tc.forward_backward([d], "importance_sampling",
                            loss_fn_config={"rldsl_spec": "dapo", "trust_region.hihg": 0.3}).result()


def test_a_spec_with_a_kl_term_reads_the_policy_with_its_adapters_off(client):
    sc, _ = client
    tc = sc.create_lora_training_client(base_model=NAME, rank=4, seed=2).result()
    tokens = tc.get_tokenizer().encode("What is 1 plus 6? 7")
    n = len(tokens) - 1
    d = _datum(tokens, logprobs=np.full(n, -1.0, dtype=np.float32), advantages=np.ones(n, dtype=np.float32))
    grpo = {"rldsl_spec": "grpo"}  # k3 KL in the loss
    first = tc.forward_backward([d], "importance_sampling", loss_fn_config=grpo).result()
    assert first.metrics["kl:mean"] == pytest.approx(0.0, abs=1e-7)  # LoRA starts at B = 0: policy = reference
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    later = tc.forward_backward([d], "importance_sampling", loss_fn_config=grpo).result()
    assert later.metrics["kl:mean"] > 1e-6


def test_concurrent_one_sample_requests_are_sampled_together(client, monkeypatch):
    from rldsl.runtime.tinker import service as service_module
    batches: list[list] = []
    real = service_module.sample

    def counted(model, tokenizer, jobs, join=None, done=None):  # each loop's requests, those joining it included
        batch = list(jobs)
        batches.append(batch)

        def joined(group):
            arrived = join(group)
            batch.extend(arrived)
            return arrived
        return real(model, tokenizer, jobs, joined if join is not None else None, done)
    monkeypatch.setattr(service_module, "sample", counted)
    sc, _ = client
    tc = sc.create_lora_training_client(base_model=NAME, rank=4).result()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = tc.get_tokenizer().encode("Count: 1 2")
    futures = [sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                              sampling_params=types.SamplingParams(max_tokens=4, stop=[])) for _ in range(12)]
    assert all(len(f.result().sequences[0].tokens) == 4 for f in futures)
    sizes = [len(b) for b in batches]
    assert sum(sizes) == 12 and len(sizes) < 12 and max(sizes) >= 2, sizes
    # a seeded request's samples depend on its seed alone, not on what it was batched with
    params = types.SamplingParams(max_tokens=6, seed=3, stop=[])
    alone = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params).result()
    crowd = [sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params if i == 5 else
                            types.SamplingParams(max_tokens=6, stop=[])) for i in range(8)]
    assert [s.tokens for s in crowd[5].result().sequences] == [s.tokens for s in alone.sequences]
