"""The step's own overhead cut at its causes (bench/overhead.py measures it): each cut computes
the same numbers as the work it replaces."""
from __future__ import annotations

import torch

from rldsl.runtime.models.loading import backbone
from rldsl.runtime.train import logprobs as lp
from rldsl.runtime.train.packing import least_packed_tokens, packed_layout, packed_rows, shared_packed_rows


def _rows(seed: int, P: int = 6, G: int = 4, pad: int = 0):
    """P groups of G rows: a left-padded prompt shared by the group, right-padded responses of
    random lengths (some empty, some at the limit)."""
    g = torch.Generator().manual_seed(seed)
    Tp, Tr = 9, int(torch.randint(2, 14, (1,), generator=g))
    plen = torch.randint(1, Tp + 1, (P,), generator=g).repeat_interleave(G)  # [B]
    rlen = torch.randint(0, Tr + 1, (P * G,), generator=g)
    B = P * G
    prompt = torch.randint(4, 30, (P, Tp), generator=g).repeat_interleave(G, 0)
    pmask = (torch.arange(Tp)[None] >= Tp - plen[:, None]).long()
    rmask = (torch.arange(Tr)[None] < rlen[:, None]).long()
    ids = torch.cat([prompt.masked_fill(pmask == 0, pad),
                     torch.randint(4, 30, (B, Tr), generator=g).masked_fill(rmask == 0, pad)], 1)
    return ids, torch.cat([pmask, rmask], 1), Tr, G


def test_least_packed_tokens_is_a_bound_on_every_layout() -> None:
    for seed in range(60):
        ids, mask, Tr, G = _rows(seed)
        for row_tokens in (None, 8, 13, 40):
            bound = least_packed_tokens(ids, mask, Tr, row_tokens, G)
            plain = packed_rows(ids, mask, Tr, row_tokens)
            shared = shared_packed_rows(ids, mask, Tr, G, row_tokens)
            assert plain is not None
            assert bound <= plain.computed_tokens
            if shared is not None:
                assert bound <= shared.computed_tokens
            assert least_packed_tokens(ids, mask, Tr, row_tokens, None) <= plain.computed_tokens


def test_layout_not_built_when_shared_prompt_forward_pushes_fewer(tiny_model, monkeypatch) -> None:
    """_packed_layout decides as before (the same layout, or None), and builds no layout when its
    bound already loses to the padded shared-prompt forward."""
    built = []
    real_rows = lp.packed_layout.__globals__["packed_rows"]

    def counting(*a, **k):
        built.append(1)
        return real_rows(*a, **k)
    skipped = 0
    for seed in range(40):
        ids, mask, Tr, G = _rows(seed, pad=tiny_model.config.pad_token_id or 0)
        for row_tokens in (None, 12):
            with torch.no_grad():
                old = packed_layout(backbone(tiny_model), ids, mask, Tr, row_tokens, G)
                if old is not None and lp._shared_prompt_applies(tiny_model, ids, mask, Tr, G) and \
                        lp._shared_prompt_tokens(*ids.shape, Tr, G) <= old.computed_tokens:
                    old = None
                built.clear()
                monkeypatch.setitem(lp.packed_layout.__globals__, "packed_rows", counting)
                new = lp._packed_layout(tiny_model, ids, mask, Tr, row_tokens, G)
                monkeypatch.setitem(lp.packed_layout.__globals__, "packed_rows", real_rows)
            assert (old is None) == (new is None)
            if new is not None:
                for f in ("input_ids", "position_ids", "predictor", "target", "out"):
                    assert torch.equal(getattr(old, f), getattr(new, f))
                assert (old.allowed is None) == (new.allowed is None)
            elif not built:
                skipped += 1
    assert skipped > 0  # the bound did decide some of these without building a layout


def test_dropout_read_once_per_policy(tiny_model, monkeypatch) -> None:
    """_old_is_current reads the policy's dropout once (not at every step) and gives the same
    answer; a trainer handed another policy reads that one's."""
    import copy

    from rldsl.runtime.train import trainer as trainer_mod
    from test_shared_prefix import _trainer
    calls = []
    real = trainer_mod._has_dropout
    monkeypatch.setattr(trainer_mod, "_has_dropout", lambda m: calls.append(m) or real(m))
    tr = _trainer(copy.deepcopy(tiny_model))
    assert all(tr._old_is_current() for _ in range(5)) and len(calls) == 1
    dropped = copy.deepcopy(tiny_model)
    dropped.config.attention_dropout = 0.1
    tr.policy = dropped
    assert not tr._old_is_current() and len(calls) == 2


def test_plain_cache_read_once_per_model(tiny_model, tokenizer, monkeypatch) -> None:
    """_shared_prompt_applies reads whether the model takes a plain KV cache once per model (it
    ran at every forward, twice), with the same answer, per model: a sliding-window model's own."""
    import copy

    from rldsl.runtime.models.loading import plain_kv_cache
    from tiny_archs import build
    calls = []
    monkeypatch.setattr(lp, "plain_kv_cache", lambda m: calls.append(m) or plain_kv_cache(m))
    ids, mask, Tr, G = _rows(0, pad=tiny_model.config.pad_token_id or 0)
    model = copy.deepcopy(tiny_model)
    assert all(lp._shared_prompt_applies(model, ids, mask, Tr, G) for _ in range(4)) and len(calls) == 1
    windowed = build("gemma2", tokenizer)  # sliding-window layers: no plain cache
    assert not plain_kv_cache(windowed)
    assert not lp._shared_prompt_applies(windowed, ids, mask, Tr, G) and not lp._shared_prompt_applies(windowed, ids, mask, Tr, G)
    assert len(calls) == 2


def test_checkpointing_flags_found_once_per_model(tiny_model, monkeypatch) -> None:
    """_shared_prompt_applies walks the model's modules once per model (it walked them at every
    training forward) for the ones with a ``gradient_checkpointing`` flag, and reads those flags
    each time: checkpointing turned on, then off, after the first forward is seen."""
    import copy

    from rldsl.runtime.models.loading import enable_gradient_checkpointing
    model = copy.deepcopy(tiny_model).train()
    walks = []
    modules = type(model).modules
    monkeypatch.setattr(type(model), "modules", lambda self: walks.append(self) or modules(self))
    ids, mask, Tr, G = _rows(0, pad=tiny_model.config.pad_token_id or 0)
    with torch.enable_grad():
        assert all(lp._shared_prompt_applies(model, ids, mask, Tr, G) for _ in range(4))
        assert walks.count(model) == 1
        enable_gradient_checkpointing(model)
        n = walks.count(model)  # transformers' own enable walks the modules too
        assert not lp._shared_prompt_applies(model, ids, mask, Tr, G)
        model.gradient_checkpointing_disable()
        n2 = walks.count(model)
        assert lp._shared_prompt_applies(model, ids, mask, Tr, G)
        assert walks.count(model) == n2 and n2 >= n
