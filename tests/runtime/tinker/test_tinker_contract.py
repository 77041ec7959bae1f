"""Contract items of ``rldsl serve-tinker`` (issue 59) that the other tinker tests leave implicit:
``optim_step`` applies each call's ``AdamParams`` (every field, not only the learning rate),
``create_model``'s LoRA config decides which layers train, requests of one training model run in
their ``seq_id`` order, and bad input leaves a saved state whole (docs/tinker.md)."""
from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from rldsl.runtime.tinker.service import Service
from rldsl.runtime.tinker.trainer import ATTN, MLP, LoraSpec, TrainedModel

from tinker_helpers import KEY, NAME

pytest.importorskip("peft")


def _adamw_reference(params, grads, state, lr, beta1, beta2, eps, weight_decay, clip):
    """AdamW written out (Loshchilov & Hutter, torch's order: decay, moments, bias correction),
    after clipping the global gradient norm to ``clip`` when ``clip`` > 0; float64."""
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    state["t"] = state.get("t", 0) + 1
    t, out = state["t"], []
    for i, (p, g) in enumerate(zip(params, grads)):
        g = g.double() * scale
        m = beta1 * state.get(("m", i), torch.zeros_like(g)) + (1 - beta1) * g
        v = beta2 * state.get(("v", i), torch.zeros_like(g)) + (1 - beta2) * g * g
        state["m", i], state["v", i] = m, v
        p = p.double() * (1 - lr * weight_decay)
        out.append(p - lr * (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + eps))
    return out, norm


def test_optim_step_applies_every_field_of_each_calls_adam_params(tinker_home):
    model = TrainedModel("m", NAME, tinker_home / NAME, LoraSpec(rank=2, seed=0, train_mlp=False,
                                                                 train_unembed=False))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.params:  # B != 0, so weight decay acts on every adapter
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    calls = [  # clipped, decayed, unusual betas and eps; then other values, no clip, no decay
        dict(learning_rate=1e-2, beta1=0.5, beta2=0.8, eps=1e-3, weight_decay=0.1, grad_clip_norm=0.05),
        dict(learning_rate=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0),
    ]
    state: dict = {}
    default_state: dict = {}
    ref = [p.detach().double().clone() for p in model.params]
    default_ref = [p.detach().double().clone() for p in model.params]
    for adam in calls:
        grads = [torch.randn(p.shape, generator=gen) for p in model.params]
        for p, g in zip(model.params, grads):
            p.grad = g.clone()
        metrics = model.optim_step(adam)
        ref, norm = _adamw_reference(ref, grads, state, adam["learning_rate"], adam["beta1"], adam["beta2"],
                                     adam["eps"], adam["weight_decay"], adam["grad_clip_norm"])
        assert metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)  # before clipping
        assert norm > 10 * calls[0]["grad_clip_norm"]  # the first call's clip acts
        for p, r in zip(model.params, ref):
            torch.testing.assert_close(p.detach().double(), r, atol=1e-6, rtol=1e-5)
        assert all(p.grad is None for p in model.params)  # zeroed after the step
        default_ref, _ = _adamw_reference(default_ref, grads, default_state, adam["learning_rate"],
                                          0.9, 0.95, 1e-12, 0.0, 0.0)
    # the fields matter on this batch: the client's defaults would have given other weights
    assert max(float((p.detach().double() - d).abs().max()) for p, d in zip(model.params, default_ref)) > 1e-4


def _adapted(model: TrainedModel) -> set[str]:
    """The layer names that carry a trained adapter."""
    return {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.policy.named_parameters()
            if p.requires_grad}


def test_create_models_lora_config_decides_the_trained_layers_rank_and_init(tinker_home):
    path = tinker_home / NAME
    attn_only = TrainedModel("a", NAME, path, LoraSpec(rank=3, train_mlp=False, train_unembed=False, seed=5))
    assert _adapted(attn_only) == set(ATTN)
    assert {p.shape[0] for n, p in attn_only.policy.named_parameters() if "lora_A" in n and p.requires_grad} == {3}
    mlp_head = TrainedModel("b", NAME, path, LoraSpec(rank=2, train_attn=False, seed=5))
    assert _adapted(mlp_head) == set(MLP) | {"lm_head"}
    same = TrainedModel("c", NAME, path, LoraSpec(rank=3, train_mlp=False, train_unembed=False, seed=5))
    other = TrainedModel("d", NAME, path, LoraSpec(rank=3, train_mlp=False, train_unembed=False, seed=6))
    assert all(torch.equal(x, y) for x, y in zip(attn_only.params, same.params))  # the seed decides the init
    assert not all(torch.equal(x, y) for x, y in zip(attn_only.params, other.params))


def test_requests_of_one_model_run_in_their_seq_id_order(tinker_home, tmp_path):
    """The worker is held by a first job while three more arrive out of order: they run by seq_id."""
    service = Service({NAME: tinker_home / NAME}, tmp_path / "states")
    ran: list[int] = []
    started, release = threading.Event(), threading.Event()

    def hold():
        started.set()
        assert release.wait(30)
        return {}
    try:
        first = service.submit("m", hold, seq_id=0)
        assert started.wait(30)
        ids = [service.submit("m", lambda s=s: ran.append(s) or {}, seq_id=s) for s in (3, 1, 2)]
        release.set()
        for rid in [first, *ids]:
            assert service.futures[rid].done.wait(30)
        assert ran == [1, 2, 3]
    finally:
        release.set()
        service.close()


def test_bad_input_leaves_a_saved_state_whole(client, tinker_home, tmp_path):
    """A state saved before a run of bad requests loads afterwards and gives the same logprobs."""
    import httpx
    tinker = pytest.importorskip("tinker")
    types = tinker.types
    sc, url = client
    tc = sc.create_lora_training_client(base_model=NAME, rank=4, seed=1).result()
    tokens = tc.get_tokenizer().encode("the saved state stays whole")
    good = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                       "weights": np.ones(len(tokens) - 1, dtype=np.float32)})
    tc.forward_backward([good], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("kept").result().path
    before = tc.forward([good], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    bad = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                      loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                      "weights": np.ones(len(tokens) + 3, dtype=np.float32)})
    with pytest.raises(tinker.BadRequestError):
        tc.forward_backward([bad], "cross_entropy").result()
    r = httpx.post(f"{url}/api/v1/forward_backward", content=b"\x00\xffnot protobuf", headers={"X-API-Key": KEY})
    assert r.status_code == 400
    r = httpx.post(f"{url}/api/v1/load_weights", json={"model_id": "nope", "path": path, "seq_id": 1},
                   headers={"X-API-Key": KEY})
    assert r.status_code in (400, 404)
    from rldsl.runtime.records.checkpoint import list_checkpoints, verify_checkpoint
    saved = [c for folder in (tmp_path / "states").glob("*/weights/kept") for c in list_checkpoints(folder)]
    assert len(saved) == 1 and verify_checkpoint(saved[0]) is None
    loaded = sc.create_training_client_from_state_with_optimizer(path).result()
    after = loaded.forward([good], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(after, before, atol=1e-6)


def _rl_data(tok, texts):
    """Datums as a recipe sends them: the sampler's logprobs and advantages on the answer half, 0
    on the prompt half; and their cross-entropy twins (to read the weights back)."""
    import tinker
    types = tinker.types
    rng = np.random.default_rng(3)
    data, plain, answered = [], [], 0
    for text in texts:
        tokens = tok.encode(text)
        n = len(tokens) - 1
        sampled = np.zeros(n, dtype=np.float32)
        sampled[n // 2:] = -rng.random(n - n // 2).astype(np.float32) * 3
        adv = np.zeros(n, dtype=np.float32)
        adv[n // 2:] = rng.normal()
        answered += n - n // 2
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "logprobs": sampled,
                                                "advantages": adv}))
        plain.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                 loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                                 "weights": np.ones(n, dtype=np.float32)}))
    return data, plain, answered


TEXTS = ("What is 2 plus 3? 5", "What is 7 plus 1? 8", "Say hi: hi there", "Name a colour: blue sky")


def _weights_after(tc, plain):
    return [o["logprobs"].to_numpy() for o in tc.forward(plain, "cross_entropy").result().loss_fn_outputs]


@pytest.mark.parametrize("loss,config", [("importance_sampling", {}), ("importance_sampling", {"rldsl_spec": "dapo"})],
                         ids=["sum", "mean spec"])
def test_gradients_accumulate_across_the_calls_a_client_splits_a_batch_into(client, loss, config):
    """Two ``forward_backward`` calls then one ``optim_step`` equal one call over the whole batch: a
    sum loss as it is; a mean-aggregated spec when each part passes the whole batch's count as
    ``loss_fn_config.rldsl_denominator`` (docs/tinker.md) -- without it each part is its own mean."""
    import tinker
    types = tinker.types
    sc, _ = client
    whole, split = (sc.create_lora_training_client(base_model=NAME, rank=4, seed=4).result() for _ in range(2))
    data, plain, answered = _rl_data(whole.get_tokenizer(), TEXTS)
    one = whole.forward_backward(data, loss, loss_fn_config=config or None).result().metrics["loss:sum"]
    part = dict(config, rldsl_denominator=float(answered)) if config else {}
    two = sum(split.forward_backward(d, loss, loss_fn_config=part or None).result().metrics["loss:sum"]
              for d in (data[:1], data[1:]))
    assert two == pytest.approx(one, abs=1e-6)
    if config:  # the parts' own means would not add up to the whole call's
        own = sum(whole.forward(d, loss, loss_fn_config=config).result().metrics["loss:sum"]
                  for d in (data[:1], data[1:]))
        assert abs(own - one) > 1e-3
    for tc in (whole, split):
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    for a, b in zip(_weights_after(whole, plain), _weights_after(split, plain)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_without_a_model_option_the_embedded_tiny_model_is_served_as_rldsl_toy(tmp_path):
    """``rldsl serve-tinker`` with no ``--model``: the embedded toy (its cached warm start) under the
    name ``rldsl/toy``, listed, trained and sampled by the client."""
    import tinker
    from rldsl.runtime.rewards.server import BackgroundServer
    from rldsl.runtime.tinker.models import served_models
    from rldsl.runtime.tinker.server import make_app
    from rldsl.runtime.toy import build_tokenizer
    from rldsl.runtime.toy.warmup import warm_start
    types = tinker.types
    models = served_models([])
    assert models == {"rldsl/toy": Path(warm_start())}
    service = Service(models, tmp_path / "states")
    try:
        with BackgroundServer(make_app(service, None)) as url:
            sc = tinker.ServiceClient(base_url=url, api_key=KEY)
            assert [m.model_name for m in sc.get_server_capabilities().supported_models] == ["rldsl/toy"]
            tc = sc.create_lora_training_client(base_model="rldsl/toy", rank=2, seed=0).result()
            assert tc.get_info().model_data.tokenizer_id == "rldsl/toy"
            prompt = build_tokenizer().encode("12+34=")
            seq = tc.save_weights_and_get_sampling_client().sample(
                types.ModelInput.from_ints(prompt), num_samples=1,
                sampling_params=types.SamplingParams(max_tokens=3, stop=[], seed=0)).result().sequences[0]
            tokens = prompt + seq.tokens
            datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                                "weights": np.ones(len(tokens) - 1, dtype=np.float32)})
            out = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
            np.testing.assert_allclose(out[len(prompt) - 1:], seq.logprobs, atol=1e-4)
    finally:
        service.close()


def test_top_k_and_top_p_filter_the_draw_and_logprobs_stay_the_full_distributions(client):
    """top_k=1 and a tiny top_p both leave only the most likely token: every sample and every seed
    the same sequence, where the unfiltered draw at temperature 2 differs; the logprobs returned are
    the full distribution's (docs/tinker.md, "Sampling"), equal to ``forward``'s."""
    import tinker
    types = tinker.types
    sc, _ = client
    tc = sc.create_lora_training_client(base_model=NAME, rank=4, seed=0).result()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = tc.get_tokenizer().encode("Count: 1 2")

    def draw(seed, **params):
        return sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=types.SamplingParams(
            max_tokens=5, stop=[], temperature=2.0, seed=seed, **params)).result().sequences
    free = [s.tokens for seed in (1, 2) for s in draw(seed)]
    assert len({tuple(t) for t in free}) > 1
    top1 = [s for seed in (1, 2) for s in draw(seed, top_k=1)]
    assert len({tuple(s.tokens) for s in top1}) == 1
    assert [s.tokens for s in draw(3, top_p=1e-6)] == [top1[0].tokens] * 3
    full = prompt + top1[0].tokens
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(full[1:]),
                                        "weights": np.ones(len(full) - 1, dtype=np.float32)})
    ref = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(top1[0].logprobs, ref[len(prompt) - 1:], atol=1e-4)
    assert max(top1[0].logprobs) < -1e-3  # not the filtered distribution's log 1 = 0


def test_the_client_shows_a_wrong_key_at_once(start_server, tinker_home, monkeypatch):
    """With ``--api-key`` set, the unchanged client given another key raises the server's 401 at
    once (not retried), and the server goes on serving the right key."""
    import time

    import tinker
    monkeypatch.chdir(tinker_home)
    with start_server(api_key="tml-right") as url:
        start = time.monotonic()
        with pytest.raises(tinker.AuthenticationError, match="wrong API key"):
            tinker.ServiceClient(base_url=url, api_key="tml-wrong").get_server_capabilities()
        assert time.monotonic() - start < 20
        caps = tinker.ServiceClient(base_url=url, api_key="tml-right").get_server_capabilities()
        assert [m.model_name for m in caps.supported_models] == [NAME]


def test_a_spec_file_by_path_is_the_same_loss_as_its_name_with_the_same_parameters(tmp_path):
    """``loss_fn_config.rldsl_spec`` takes a path as well as a name: a file that extends dapo with a
    narrower clip equals dapo named with that clip set as ``--set`` sets it; a spec file with an
    error is a 400 naming its file:line:col."""
    from rldsl.runtime.errors import TinkerRefused
    from rldsl.runtime.tinker.losses import compute, resolve_loss
    gen = torch.Generator().manual_seed(0)
    target = [(-torch.rand(n, generator=gen) * 3).requires_grad_(True) for n in (4, 6)]
    inputs = [{"target_tokens": np.zeros(len(t), dtype=np.int64),
               "logprobs": (t.detach() + 0.3 * torch.randn(len(t), generator=gen)).numpy(),
               "advantages": torch.randn(len(t), generator=gen).numpy()} for t in target]
    spec = tmp_path / "narrow.rl"
    spec.write_text("algorithm narrow extends dapo\n  trust_region  clip(low=0.05, high=0.07)\n", encoding="utf-8")
    by_path = float(compute(resolve_loss("importance_sampling", {"rldsl_spec": str(spec)}), target, inputs, None)[0])
    named = resolve_loss("importance_sampling", {"rldsl_spec": "dapo", "trust_region.low": 0.05,
                                                 "trust_region.high": 0.07})
    assert by_path == pytest.approx(float(compute(named, target, inputs, None)[0]), abs=1e-7)
    dapo = float(compute(resolve_loss("x", {"rldsl_spec": "dapo"}), target, inputs, None)[0])
    assert abs(by_path - dapo) > 1e-4  # the file's clip acts on this batch
    bad = tmp_path / "bad.rl"
    bad.write_text("algorithm bad extends dapo\n  trust_region  clip(lwo=0.05)\n", encoding="utf-8")
    with pytest.raises(TinkerRefused, match=r"bad\.rl:2:\d+"):
        resolve_loss("importance_sampling", {"rldsl_spec": str(bad)})


def test_a_stop_string_across_two_tokens_ends_at_the_token_that_completes_it(client):
    """A stop string made of the last character of one sampled token and the first of the next is
    matched on the decoded text: the completion ends at the second token, kept, stop reason "stop"
    (the service test's stop string is whole tokens, and only when they decode to visible text)."""
    import tinker
    types = tinker.types
    sc, _ = client
    tc = sc.create_lora_training_client(base_model=NAME, rank=4).result()
    tok = tc.get_tokenizer()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = tok.encode("Count: 1 2 3")

    def sample(stop):
        return sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=types.SamplingParams(
            max_tokens=16, temperature=1.0, seed=7, stop=stop)).result().sequences[0]
    free = sample([]).tokens
    found = None
    for i in range(len(free) - 1):
        head, both = tok.decode(free[:i + 1]), tok.decode(free[:i + 2])
        if not both.startswith(head) or len(both) == len(head) or not head:
            continue
        stop = head[-1] + both[len(head)]
        if stop.strip() and all(stop not in tok.decode(free[:k]) for k in range(1, i + 2)):
            found = (i, stop)
            break
    assert found is not None, tok.decode(free)
    i, stop = found
    cut = sample([stop])
    assert cut.tokens == free[:i + 2] and cut.stop_reason == "stop"
