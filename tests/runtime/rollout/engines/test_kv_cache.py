"""The sampler's preallocated KV cache against transformers' ``DynamicCache``: the same keys,
values and logits through a prefill, the group repeat, dropped rows and decode steps."""
from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from rldsl.runtime.batch import position_ids_from_mask
from rldsl.runtime.rollout.engines.base import left_pad
from rldsl.runtime.rollout.engines.kv_cache import preallocated_cache
from rldsl.runtime.models.loading import cache_keyword


def _drive(model, cache, ids, mask, G, steps, drop_after):
    """Prefill, repeat G times, decode ``steps`` fixed tokens, dropping rows after step
    ``drop_after``; returns the logits of every step and the cache's final keys / values."""
    pos = position_ids_from_mask(mask)
    out = [model(input_ids=ids, attention_mask=mask, position_ids=pos, **{cache_keyword(model): cache},
                 use_cache=True).logits[:, -1]]
    cache.batch_repeat_interleave(G)
    attn = mask.repeat_interleave(G, dim=0)
    next_pos = pos[:, -1:].repeat_interleave(G, dim=0) + 1
    gen = torch.Generator().manual_seed(0)
    for t in range(steps):
        b = attn.shape[0]
        token = torch.randint(3, model.config.vocab_size, (b, 1), generator=gen)
        if t == drop_after:
            keep = torch.arange(0, b, 2)  # every other row leaves
            cache.batch_select_indices(keep)
            attn, next_pos, token = attn[keep], next_pos[keep], token[keep]
        attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
        out.append(model(input_ids=token, attention_mask=attn, position_ids=next_pos, **{cache_keyword(model): cache},
                         use_cache=True).logits[:, -1])
        next_pos = next_pos + 1
    return out, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@torch.no_grad()
def test_preallocated_cache_equals_dynamic_cache(tiny_model, tokenizer) -> None:
    prompts = [tokenizer("1+2=")["input_ids"], tokenizer("(5)*6-7=")["input_ids"]]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    G, steps = 3, 6
    Tp = ids.shape[1]
    got, got_kv = _drive(tiny_model, preallocated_cache(tiny_model, Tp + steps), ids, mask, G, steps, 2)
    want, want_kv = _drive(tiny_model, DynamicCache(config=tiny_model.config), ids, mask, G, steps, 2)
    assert len(got) == steps + 1
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv):
        assert gk.shape == wk.shape == (3, wk.shape[1], Tp + steps, wk.shape[3])  # 6 rows, then 3
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


@torch.no_grad()
def test_preallocated_cache_refuses_to_overflow(tiny_model, tokenizer) -> None:
    ids, mask = left_pad([tokenizer("1+2=")["input_ids"]], tokenizer.pad_token_id)
    cache = preallocated_cache(tiny_model, ids.shape[1])  # room for the prompt only
    kw = cache_keyword(tiny_model)
    tiny_model(input_ids=ids, attention_mask=mask, **{kw: cache}, use_cache=True)
    assert cache.get_seq_length() == ids.shape[1]
    with pytest.raises(RuntimeError, match="capacity"):
        tiny_model(input_ids=ids[:, :1], attention_mask=torch.ones(1, ids.shape[1] + 1, dtype=mask.dtype),
                   **{kw: cache}, use_cache=True)


@torch.no_grad()
@pytest.mark.parametrize("room", [2, 40])  # the filled prefix more / less than half the buffers
@pytest.mark.parametrize("keep", [[0, 1, 2, 4], [1, 3, 5], [5, 0, 3], [0, 1, 2, 3, 4, 5]])
def test_dropping_rows_keeps_the_same_keys(tiny_model, tokenizer, keep, room) -> None:
    """Rows dropped (late rows, every other one, any order, none), the buffers' filled prefix
    short or long against their capacity: the same keys / values as transformers' cache, and
    decoding into the buffers afterwards gives the same logits."""
    ids, mask = left_pad([tokenizer("1+2=")["input_ids"], tokenizer("(5)*6-7=")["input_ids"]],
                         tokenizer.pad_token_id)
    kw = cache_keyword(tiny_model)
    pos = position_ids_from_mask(mask)
    caches = [preallocated_cache(tiny_model, ids.shape[1] + room), DynamicCache(config=tiny_model.config)]
    logits = []
    for cache in caches:
        tiny_model(input_ids=ids, attention_mask=mask, position_ids=pos, **{kw: cache}, use_cache=True)
        cache.batch_repeat_interleave(3)
        cache.batch_select_indices(torch.tensor(keep))
        rows = torch.tensor(keep)
        attn = torch.cat([mask.repeat_interleave(3, dim=0)[rows], torch.ones(len(keep), 1, dtype=mask.dtype)], 1)
        token = torch.arange(3, 3 + len(keep))[:, None]
        next_pos = pos[:, -1:].repeat_interleave(3, dim=0)[rows] + 1
        logits.append(tiny_model(input_ids=token, attention_mask=attn, position_ids=next_pos, **{kw: cache},
                                 use_cache=True).logits[:, -1])
    for got, want in zip(caches[0].layers, caches[1].layers):
        assert got.keys.shape == want.keys.shape == (len(keep), *want.keys.shape[1:])
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        assert got._k.shape[2] == ids.shape[1] + room  # still the whole capacity
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-6)
