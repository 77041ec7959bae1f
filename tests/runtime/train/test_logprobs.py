"""token_logprobs / selective_log_softmax against full-logits references (values and gradients)."""
from __future__ import annotations

import math

import pytest
import torch

from rldsl.runtime.batch import position_ids_from_mask
from rldsl.runtime.rollout.engines.base import SamplingParams
from rldsl.runtime.rollout.engines.hf import HFEngine
from rldsl.runtime.train.logprobs import Forward, LogprobOptions, selective_log_softmax, token_logprobs, token_topk


PROMPTS = ["1+2=", "33+44=", "(5)*6-7=", "9="]


def test_selective_log_softmax_hand_values() -> None:
    # softmax([0, ln 3]) = [1/4, 3/4]; softmax([0, 0, 0]) = 1/3 each
    logits = torch.tensor([[0.0, math.log(3.0), -1e4], [0.0, 0.0, 0.0]])
    out = selective_log_softmax(logits, torch.tensor([1, 2]))
    torch.testing.assert_close(out, torch.tensor([math.log(0.75), math.log(1 / 3)]))
    # bf16 input is upcast before the softmax; rows split over chunks of 1
    half = selective_log_softmax(logits.bfloat16()[None], torch.tensor([[0, 0]]), chunk_size=1)
    assert half.dtype == torch.float32 and half.shape == (1, 2)
    torch.testing.assert_close(half[0], torch.tensor([math.log(0.25), math.log(1 / 3)]), atol=1e-2, rtol=0)


def test_position_ids_from_mask() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def _sampled(model, tokenizer, seed: int = 0):
    """A left-padded batch with right-padded responses (some rows end early)."""
    batch = HFEngine(model, tokenizer).generate(
        PROMPTS, SamplingParams(n=2, temperature=1.5, max_new_tokens=7, seed=seed)
    )
    input_ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)  # [B, T]
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)  # [B, T]
    return batch, input_ids, mask


def _reference(model, input_ids, mask, Tr):
    """Full [B, T, V] fp32 logits, positions from the mask; log_softmax + gather."""
    logits = model(
        input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
    ).logits.float()[:, -Tr - 1 : -1]  # [B, Tr, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, -Tr:, None])[..., 0]  # [B, Tr]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [B, Tr]
    return logp, entropy


@pytest.mark.parametrize("chunk_size", [5, 1024])
def test_values_and_gradients_match_full_logits(tiny_model, tokenizer, chunk_size) -> None:
    batch, input_ids, mask = _sampled(tiny_model, tokenizer)
    Tr = batch.response_ids.shape[1]
    m = batch.response_mask.float()
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(0)) * m

    tiny_model.zero_grad()
    ref_logp, ref_ent = _reference(tiny_model, input_ids, mask, Tr)
    (ref_logp * weights).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}

    tiny_model.zero_grad()
    out = token_logprobs(tiny_model, Forward(input_ids, mask, Tr), LogprobOptions(chunk_size=chunk_size))
    logp, ent = out.logprobs, out.entropy
    assert logp.shape == ent.shape == (len(batch), Tr) and logp.dtype == torch.float32
    assert logp.requires_grad and not ent.requires_grad
    (logp * weights).sum().backward()

    torch.testing.assert_close(logp * m, ref_logp.detach() * m, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent * m, ref_ent.detach() * m, atol=1e-5, rtol=0)
    for name, p in tiny_model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_entropy_gradient_when_asked(tiny_model, tokenizer) -> None:
    batch, input_ids, mask = _sampled(tiny_model, tokenizer, seed=1)
    Tr = batch.response_ids.shape[1]
    m = batch.response_mask.float()
    tiny_model.zero_grad()
    _, ref_ent = _reference(tiny_model, input_ids, mask, Tr)
    (ref_ent * m).sum().backward()
    ref = tiny_model.lm_head.weight.grad.clone()
    tiny_model.zero_grad()
    ent = token_logprobs(tiny_model, Forward(input_ids, mask, Tr),
                         LogprobOptions(entropy_grad=True, chunk_size=3)).entropy
    (ent * m).sum().backward()
    torch.testing.assert_close(tiny_model.lm_head.weight.grad, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [5, 1024])
def test_gathered_top_k_logprobs_and_their_gradients_match_full_logits(tiny_model, tokenizer, chunk_size) -> None:
    """``gather_ids`` (a teacher's top-k ids): the logprobs of those tokens and the gradient of a
    loss on them and on the sampled tokens' logprobs together, against full logits; token_topk's
    top-k equals the full log_softmax's."""
    batch, input_ids, mask = _sampled(tiny_model, tokenizer, seed=3)
    Tr = batch.response_ids.shape[1]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tiny_model.config.vocab_size, (len(batch), Tr, 4), generator=g)
    w_ids = torch.randn(ids.shape, generator=g)
    w = torch.randn(len(batch), Tr, generator=g)

    tiny_model.zero_grad()
    logits = tiny_model(input_ids=input_ids, attention_mask=mask,
                        position_ids=position_ids_from_mask(mask)).logits.float()[:, -Tr - 1:-1]
    full = torch.log_softmax(logits, -1)
    ref_ids = full.gather(-1, ids)
    ((full.gather(-1, input_ids[:, -Tr:, None])[..., 0] * w).sum() + (ref_ids * w_ids).sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}

    tiny_model.zero_grad()
    out = token_logprobs(tiny_model, Forward(input_ids, mask, Tr, gather_ids=ids),
                         LogprobOptions(chunk_size=chunk_size))
    logp, got = out.logprobs, out.gathered
    assert got.shape == ids.shape and got.requires_grad
    ((logp * w).sum() + (got * w_ids).sum()).backward()
    torch.testing.assert_close(got, ref_ids.detach(), atol=1e-5, rtol=0)
    for name, p in tiny_model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)

    lp, top, top_ids = token_topk(tiny_model, input_ids, mask, Tr, 5, chunk_size=chunk_size)
    want, want_ids = full.detach().topk(5, dim=-1)
    torch.testing.assert_close(top, want, atol=1e-5, rtol=0)
    assert torch.equal(top_ids, want_ids)
    torch.testing.assert_close(lp, logp.detach(), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="top-k of 99 tokens from a vocabulary of 23"):
        token_topk(tiny_model, input_ids, mask, Tr, 99)


def test_left_padding_does_not_change_values(tiny_model, tokenizer, unpadded_logits) -> None:
    """Each padded row equals the same row computed alone without any padding."""
    batch, input_ids, mask = _sampled(tiny_model, tokenizer, seed=2)
    with torch.no_grad():
        logp = token_logprobs(tiny_model, Forward(input_ids, mask, batch.response_ids.shape[1]),
                              LogprobOptions(entropy=False)).logprobs
        refs = unpadded_logits(tiny_model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    assert not logp.requires_grad
    for b, logits in enumerate(refs):
        L = logits.shape[0]
        expected = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[b, :L, None])[:, 0]
        torch.testing.assert_close(logp[b, :L], expected, atol=1e-5, rtol=0)


def test_matches_engine_logprobs_at_temperature_one(tiny_model, tokenizer) -> None:
    batch = HFEngine(tiny_model, tokenizer).generate(
        PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=4)
    )
    input_ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], dim=1)
    with torch.no_grad():
        logp = token_logprobs(tiny_model, Forward(input_ids, mask, batch.response_ids.shape[1])).logprobs
    m = batch.response_mask.float()
    torch.testing.assert_close(logp * m, batch.logprobs, atol=1e-5, rtol=0)


def test_never_saves_full_logits_for_backward(tiny_model) -> None:
    """With chunks checkpointed, autograd keeps no logits for backward (the reference keeps [B, Tr, V])."""
    model = tiny_model
    B, Tp, Tr = 8, 4, 12
    V, H = model.config.vocab_size, model.config.hidden_size
    input_ids = torch.randint(4, V, (B, Tp + Tr), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(input_ids)

    def saved_vocab_numel(fn) -> int:
        """Total size of the tensors autograd saves that have a vocabulary axis (not the weight)."""
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            if V in t.shape and t.shape not in ((V, H), (H, V)):
                total += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return total

    assert saved_vocab_numel(lambda: _reference(model, input_ids, mask, Tr)) >= B * Tr * V
    assert saved_vocab_numel(lambda: token_logprobs(model, Forward(input_ids, mask, Tr),
                                                    LogprobOptions(chunk_size=16))) == 0


def test_bad_arguments(tiny_model) -> None:
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="num_response_tokens"):
        token_logprobs(tiny_model, Forward(ids, torch.ones_like(ids), 5))
    with pytest.raises(ValueError, match="attention_mask"):
        token_logprobs(tiny_model, Forward(ids, torch.ones(2, 4, dtype=torch.long), 2))


def test_absolute_positions_model_left_padded(tokenizer, unpadded_logits) -> None:
    """GPT-2 has learned absolute positions: a wrong position id would change every value."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    batch, input_ids, mask = _sampled(model, tokenizer, seed=5)
    with torch.no_grad():
        logp = token_logprobs(model, Forward(input_ids, mask, batch.response_ids.shape[1])).logprobs
        refs = unpadded_logits(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    for b, logits in enumerate(refs):
        L = logits.shape[0]
        expected = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[b, :L, None])[:, 0]
        torch.testing.assert_close(logp[b, :L], expected, atol=1e-5, rtol=0)
        # the engine sampled this batch at temperature 1.5
        tempered = torch.log_softmax(logits / 1.5, -1).gather(-1, batch.response_ids[b, :L, None])[:, 0]
        torch.testing.assert_close(batch.logprobs[b, :L], tempered, atol=1e-5, rtol=0)


def test_a_lora_adapter_on_the_head_is_in_the_logprobs_and_trains(tiny_model):
    """A LoRA adapter on lm_head (model.lora.target_modules naming it; serve-tinker's
    train_unembed): token_logprobs and token_topk apply W + scaling * B @ A as the model's own forward
    does, and the adapter's A and B get gradients (reading head.weight gave the base's: the head's
    adapter never trained); with the adapters off (the reference forward) the base's logprobs."""
    import copy

    from rldsl.runtime.models.lora import apply_lora

    policy, peft = apply_lora(copy.deepcopy(tiny_model), rank=4, alpha=8, dropout=0.0,
                              target_modules=["q_proj", "lm_head"])
    for name, p in policy.named_parameters():
        if ".lora_B." in name:  # B starts at 0: adapters that change the outputs
            torch.nn.init.normal_(p, std=0.5, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[1, 5, 6, 14, 7, 8, 17, 9], [1, 9, 4, 4, 12, 6, 3, 15]])
    mask, Tr = torch.ones_like(ids), 4
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=mask).logits.double()
    want = torch.log_softmax(logits[:, -Tr - 1:-1], -1).gather(-1, ids[:, -Tr:, None]).squeeze(-1)
    out = token_logprobs(policy, Forward(ids, mask, Tr))
    torch.testing.assert_close(out.logprobs.double(), want, atol=1e-5, rtol=0)
    lp, top, _ = token_topk(policy, ids, mask, Tr, k=2)
    torch.testing.assert_close(lp.double(), want, atol=1e-5, rtol=0)
    out.logprobs.sum().backward()
    head = {n: p.grad for n, p in policy.named_parameters() if "lm_head.lora_" in n}
    assert len(head) == 2 and all(g is not None and g.abs().sum() > 0 for g in head.values()), head
    with peft.disable_adapter(), torch.no_grad():
        base = token_logprobs(policy, Forward(ids, mask, Tr)).logprobs
        plain = token_logprobs(tiny_model, Forward(ids, mask, Tr)).logprobs
    torch.testing.assert_close(base, plain, atol=1e-6, rtol=0)
    assert not torch.allclose(base.double(), want, atol=1e-3)


def test_prompt_logprobs_come_from_the_shared_prompt_forward_and_equal_full_logits(tiny_model, tokenizer) -> None:
    """``prompt_logprobs``: each group's prompt tokens scored on the shared-prompt forward's own
    prompt pass (no forward of their own), equal to the full forward's; None when not asked."""
    batch, input_ids, mask = _sampled(tiny_model, tokenizer)  # groups of 2 samples per prompt
    Tr = batch.response_ids.shape[1]
    Tp = input_ids.shape[1] - Tr
    logits = tiny_model(input_ids=input_ids, attention_mask=mask,
                        position_ids=position_ids_from_mask(mask)).logits.float()
    ref = torch.log_softmax(logits[::2, :Tp - 1], -1).gather(-1, input_ids[::2, 1:Tp, None])[..., 0]  # [P, Tp-1]
    real = (mask[::2, :Tp - 1] * mask[::2, 1:Tp]).bool()  # both the token and its context real
    calls: list[int] = []
    hook = tiny_model.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        out = token_logprobs(tiny_model, Forward(input_ids, mask, Tr, group_size=2),
                             LogprobOptions(prompt_logprobs=True))
    finally:
        hook.remove()
    assert len(calls) == 2  # the prompt pass and the responses on its cache: nothing else
    assert out.prompt_logprobs is not None and out.prompt_logprobs.shape == (len(batch) // 2, Tp - 1)
    torch.testing.assert_close(out.prompt_logprobs[real], ref[real], atol=1e-5, rtol=0)
    # with gradient, through the same prompt pass: the full forward's gradient of the same sum
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)) * real
    tiny_model.zero_grad()
    (ref * weights).sum().backward()
    want = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad()
    (out.prompt_logprobs * weights).sum().backward()
    for name, p in tiny_model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], atol=1e-5, rtol=1e-4, msg=name)
    plain = token_logprobs(tiny_model, Forward(input_ids, mask, Tr, group_size=2))
    assert plain.prompt_logprobs is None
    torch.testing.assert_close(plain.logprobs, out.logprobs, atol=0, rtol=0)
