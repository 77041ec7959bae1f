"""vLLM <-> rldsl: sampling parameters in, ``RequestOutput``s to a ``RolloutBatch`` out.

Pure functions on duck-typed objects (vLLM's attribute names), so they run and are tested
without vLLM. The batch has the layout every engine returns (engines/base.py), so the
trainer cannot tell vLLM from the transformers engine:

- prompts are the engine's token ids, left padded; ``response_mask`` is 1 up to and
  including the first stop token (the EOS, plus the extra EOS ids of the model's
  ``generation_config.json``, which vLLM also stops on); ``response_ids`` hold the pad id
  wherever the mask is 0; completions are decoded from the masked ids;
- ``finish_reason`` is "stop" when the completion holds a stop token, else vLLM's reason
  ("stop" for a stop string, "length"); any other reason ("abort", "error") raises;
- ``logprobs``: with ``logprobs_mode="processed_logprobs"`` and ``logprobs=0`` vLLM returns
  ``log_softmax(top_p(z / tau))[y]``; with ``top_p = 1`` that is the transformers engine's
  quantity, with ``top_p < 1`` it is renormalized over the nucleus (docs/runtime.md);
- ``routed_experts`` (a mixture-of-experts model, ``rollout.routing_replay``): the experts of
  every fed token, captured in the workers (routing.py) or returned by vLLM, laid out as the
  transformers engine records them (runtime/models/moe.py): the prompt right-aligned in the Tp
  columns, the response from column Tp, -1 on padding and on each response's last token.
"""
from __future__ import annotations

from typing import Any, Collection, Sequence

import torch

from ....batch import RolloutBatch, TokenRow, repeat_each
from ....data.images import images_of
from ..base import SamplingParams, cut_at_first_stop
from .weights import unpack_bucket


def to_vllm_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` that sample like ``params``.

    - temperature 0 is greedy in vLLM too, but vLLM then refuses n > 1, so greedy asks for
      ``n=1`` (``VLLMEngine.generate`` sends each prompt G times instead) and top_p=1;
    - ``logprobs=0``: only the sampled token's logprob (the module docstring says what it
      means under ``logprobs_mode="processed_logprobs"``);
    - ``detokenize=False``: completions are decoded here, as in HFEngine;
    - no top-k, penalties or stop strings: vLLM's defaults leave them off.
    """
    params.check()
    greedy = params.temperature == 0
    return {
        "n": 1 if greedy else params.n,
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": 1.0 if greedy else float(params.top_p),
        "max_tokens": int(params.max_new_tokens),
        "min_tokens": int(params.min_new_tokens),
        "logprobs": 0,
        "seed": params.seed,
        "detokenize": False,
    }


# ------------------------------------------------------------------- result conversion
def outputs_to_rollout_batch(
    request_outputs: Sequence[Any],
    tokenizer: Any,
    prompts: Sequence[str],
    group_size: int,
    pad_id: int,
    eos_id: int,
    stop_ids: Collection[int] = (),
) -> RolloutBatch:
    """Turn vLLM ``RequestOutput``s into a ``RolloutBatch`` (HFEngine's layout).

    Works on any objects with vLLM's attribute names: ``ro.prompt_token_ids``,
    ``ro.outputs[i].index / token_ids / logprobs / finish_reason``, with ``logprobs[t]`` a
    mapping ``token_id -> obj with .logprob`` (a list of dicts or vLLM's ``FlatLogprobs``).

    ``request_outputs`` are in prompt order and hold, together, P*G completions: either one
    output per prompt with G completions each (sampling), or G outputs per prompt with one
    completion each (greedy, where vLLM refuses n > 1). ``stop_ids`` are extra ids that end a
    completion like ``eos_id`` (vLLM adds the generation_config EOS ids).
    """
    P, G = len(prompts), group_size
    if G < 1:
        raise ValueError(f"group_size must be >= 1, got {G}")
    rows: list[tuple[list[int], Any]] = []  # (prompt ids, completion) per row b
    for ro in request_outputs:
        prompt_ids = list(ro.prompt_token_ids)
        for completion in sorted(ro.outputs, key=lambda c: c.index):
            rows.append((prompt_ids, completion))
    B = P * G
    if len(rows) != B:
        raise ValueError(
            f"expected {P} prompts x {G} samples = {B} completions, vLLM returned "
            f"{len(rows)} in {len(request_outputs)} request outputs"
        )
    for b in range(B):  # every row of a group must answer the same prompt
        if rows[b][0] != rows[(b // G) * G][0]:
            raise ValueError(f"row {b}: prompt ids differ within group {b // G}")

    terminators = {int(eos_id), *(int(s) for s in stop_ids)}
    Tr = max(1, max(len(c.token_ids) for _, c in rows))  # HFEngine always has >= 1 column
    sampled = torch.full((B, Tr), pad_id, dtype=torch.long)  # [B, Tr] every generated id
    for b, (_, c) in enumerate(rows):
        if len(c.token_ids):
            sampled[b, : len(c.token_ids)] = torch.tensor([int(t) for t in c.token_ids], dtype=torch.long)
    lengths = torch.tensor([len(c.token_ids) for _, c in rows], dtype=torch.long)  # [B]
    response_ids, response_mask, stopped = cut_at_first_stop(sampled, terminators, pad_id, lengths)
    reasons = [_finish_reason(c.finish_reason, stopped=bool(stopped[b]), row=b)
               for b, (_, c) in enumerate(rows)]
    valid_ids = [response_ids[b, :int(response_mask[b].sum())].tolist() for b in range(B)]  # up to the stop
    logprobs = [_sampled_logprobs(c.logprobs, ids, row=b) if ids else [] for b, ((_, c), ids) in
                enumerate(zip(rows, valid_ids))]
    completions = tokenizer.batch_decode(valid_ids, skip_special_tokens=True)
    return RolloutBatch.from_rows(
        [TokenRow(p_ids, ids, lps, reason, prompt, completion, images=images_of(prompt))
         for (p_ids, _), ids, lps, reason, prompt, completion
         in zip(rows, valid_ids, logprobs, reasons, repeat_each(prompts, G), completions)],
        G, pad_id, width=Tr)


def _finish_reason(vllm_reason: Any, *, stopped: bool, row: int) -> str:
    reason = None if vllm_reason is None else str(vllm_reason)
    if reason not in ("stop", "length"):
        raise RuntimeError(
            f"vLLM finished row {row} with finish_reason={reason!r} (expected 'stop' or "
            "'length'): the request was aborted or failed inside vLLM"
        )
    return "stop" if stopped else reason


def _sampled_logprobs(position_logprobs: Any, ids: list[int], *, row: int) -> list[float]:
    """Logprob of each sampled token: ``position_logprobs[t][ids[t]].logprob``."""
    if position_logprobs is None:
        raise ValueError(
            f"row {row}: vLLM returned no logprobs; sample with logprobs=0 "
            "(to_vllm_sampling_kwargs does)"
        )
    if len(position_logprobs) < len(ids):
        raise ValueError(
            f"row {row}: {len(position_logprobs)} logprob entries for {len(ids)} tokens"
        )
    out = []
    for t, tok in enumerate(ids):
        entry = position_logprobs[t]
        if tok not in entry:
            raise ValueError(f"row {row}, position {t}: no logprob for sampled token {tok}")
        out.append(float(entry[tok].logprob))
    return out


# --------------------------------------------------------------- routed experts (routing.py)
#: One request's record from the workers: (token ids [n] int64, experts [n, Y, K] int16), both in
#: position order 0..n-1 (every fed token of the request).
Record = tuple[torch.Tensor, torch.Tensor]

#: The parts of a request's captured rows in routing.py's ``pack_captured``.
CAPTURED_PARTS = ("positions", "tokens", "experts")


def unpack_captured(payload: bytes) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Inverse of routing.py's ``pack_captured``."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in unpack_bucket(payload):
        rid, _, part = name.rpartition("/")
        parts.setdefault(rid, {})[part] = t
    return [(rid, *(p[part] for part in CAPTURED_PARTS)) for rid, p in parts.items()]  # type: ignore[misc]


def by_position(captured: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[Record]:
    """Each request's rows (routing.py's ``RoutingCapture.take``) in position order 0..n-1, the last
    computation of a position kept; raises if a position is missing (a prefix-cached block)."""
    out: list[Record] = []
    for rid, positions, tokens, experts in captured:
        n = int(positions.max()) + 1
        last = torch.full((n,), -1, dtype=torch.int64)  # the last row that computed each position
        last.scatter_reduce_(0, positions, torch.arange(len(positions)), reduce="amax")
        if bool((last < 0).any()):
            raise RuntimeError(f"routing capture: request {rid} has positions never computed "
                               f"({int((last < 0).sum())} of {n}); prefix caching must be off while routing is recorded")
        out.append((tokens[last], experts[last]))
    return out


def _place(batch: RolloutBatch, row: int, experts: torch.Tensor, out: torch.Tensor) -> None:
    """Lay one row's experts of its fed tokens (prompt then response, [n, Y, K]) into
    ``out`` [B, Tp + Tr, Y, K]: the prompt right-aligned in the Tp columns, the response from
    column Tp, only the response tokens before the last valid one (the HF engine's records)."""
    Tp = batch.prompt_ids.shape[1]
    n_prompt = int(batch.prompt_mask[row].sum())
    fed_response = max(int(batch.response_mask[row].sum()) - 1, 0)
    out[row, Tp - n_prompt:Tp] = experts[:n_prompt]
    out[row, Tp:Tp + fed_response] = experts[n_prompt:n_prompt + fed_response]


def fed_tokens(request_output: Any, completion: Any) -> tuple[int, ...]:
    """The tokens vLLM fed through the model for one completion: its prompt and all its
    tokens but the last (which no forward sees)."""
    return tuple(int(t) for t in request_output.prompt_token_ids) + \
        tuple(int(t) for t in completion.token_ids)[:-1]


def _rows(request_outputs: Sequence[Any]) -> list[tuple[Any, Any]]:
    """(request output, completion) per batch row, in convert.py's order."""
    return [(ro, c) for ro in request_outputs for c in sorted(ro.outputs, key=lambda c: c.index)]


def layout_captured(request_outputs: Sequence[Any], records: Sequence[Record], batch: RolloutBatch) -> torch.Tensor:
    """``routed_experts`` [B, Tp + Tr, Y, K] (int16, -1 where nothing was fed or recorded) of a
    batch made from ``request_outputs`` (convert.py), from the workers' per-request records:
    each row takes the record whose fed tokens are its own (equal rows -- a greedy group -- take
    one each)."""
    if not records:
        raise RuntimeError("routing capture: vLLM recorded no routing for this call")
    Y, K = records[0][1].shape[1:]
    pool: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for tokens, experts in records:
        pool.setdefault(tuple(tokens.tolist()), []).append(experts)
    out = torch.full((len(batch), batch.prompt_ids.shape[1] + batch.response_ids.shape[1], Y, K), -1,
                     dtype=torch.int16)
    for b, (ro, c) in enumerate(_rows(request_outputs)):
        found = pool.get(fed_tokens(ro, c))
        if not found:
            raise RuntimeError(f"routing capture: no recorded request fed the tokens of row {b} "
                               f"({len(fed_tokens(ro, c))} tokens); {len(records)} requests recorded")
        _place(batch, b, found.pop(), out)
    return out


def layout_returned(request_outputs: Sequence[Any], batch: RolloutBatch, layer_ids: Sequence[int]) -> torch.Tensor:
    """``routed_experts`` [B, Tp + Tr, Y, K] from vLLM's ``CompletionOutput.routed_experts``
    [fed tokens, all layers, K] (the MoE layers ``layer_ids`` kept). Unrun: no GPU here."""
    rows = _rows(request_outputs)
    firsts = [torch.as_tensor(c.routed_experts) for _, c in rows]
    K = int(firsts[0].shape[-1])
    out = torch.full((len(batch), batch.prompt_ids.shape[1] + batch.response_ids.shape[1], len(layer_ids), K), -1,
                     dtype=torch.int16)
    for b, ((ro, c), got) in enumerate(zip(rows, firsts)):
        n = len(fed_tokens(ro, c))
        if got.shape[0] < n:
            raise RuntimeError(f"vLLM returned routed_experts for {got.shape[0]} tokens of row {b}, which fed {n}")
        _place(batch, b, got[:n][:, list(layer_ids)].to(torch.int16), out)
    return out
