"""``HFEngine``: the CPU rollout engine, a KV-cached sampling loop over a transformers model.

The loop (``HFEngine._sample``) is ``generate``'s sampling without its per-token overhead:
it prefills each prompt once for its G samples and drops finished rows from the batch
(bench/README.md has its speed). Models whose cache it cannot drive (no plain
``DynamicCache``: sliding windows, recurrent state, transformers 4.x) go through
``model.generate``. Either way ``logprobs[b, t] = log_softmax(z_bt / tau)[y_bt]`` with z the
*raw* logits (``generate``'s ``scores`` are processed: never used) and tau the temperature
(1 for greedy); top-p is not folded in, so it is the quantity a trainer recomputes.
Sampling is reproducible given ``SamplingParams.seed`` and leaves the global RNG untouched. The
sampler draws from a generator of its own: an asynchronous run generates in a thread beside the
trainer's, and a draw from torch's process-wide RNG in either thread while the other's sampling
was seeded there changed that batch's samples (a resumed run then differed from the
uninterrupted one). The ``model.generate`` fallback can only seed the process-wide RNG (forked
and restored around the call): there, no other thread may draw from it during a generation.

Shapes: P prompts, G = ``params.n``, B = P*G, Tp / Tr prompt / response length, V vocabulary.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Iterable

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from ...batch import RolloutBatch, TokenRow, position_ids_from_mask, repeat_each
from ...models import moe
from ...models.kinds import model_kind
from ...models.loading import backbone, cache_keyword, plain_kv_cache, tensors_by_name
from ...models.lora import load_adapter
from ...data.images import images_of
from .hf_vision import generate_ids_with_images, generate_with_images
from .kv_cache import preallocated_cache
from .base import (SamplingParams, check_request, cut_at_first_stop, left_pad, special_token_ids,
                   stop_token_ids)


class HFEngine:
    """A ``RolloutEngine`` that samples all P*G rows of a call in one batched KV-cached loop.

    The engine uses ``model`` as given (no copy): pass a ``copy.deepcopy`` if the
    trainer must keep its own weights apart; ``update_weights`` then syncs them.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        device: str | torch.device = "cpu",
        compile: bool = False,
    ) -> None:
        self.pad_id, self.eos_id = special_token_ids(tokenizer, "HFEngine")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        # the tokenizer's EOS and every EOS id of the model's generation_config (as TRL, vLLM)
        self.stop_ids = stop_token_ids(tokenizer, model)
        self._stops = torch.tensor(sorted(self.stop_ids), device=self.device)
        self.tokenizer = tokenizer
        # the policy's family (models/kinds/), chosen once from its config: a vision-language
        # policy's processor; what multi-turn episodes and agents read their messages' images with
        self.kind = model_kind(self.model, tokenizer)
        self._sampler_ok: bool | None = None  # decided on first use (_cached_sampling_ok)
        self._cache_kw: str | None = None  # the forward's cache keyword, found with it
        self._keep_last = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        # model.compile: the KV-cached sampler runs the model's body through torch.compile (dynamic
        # shapes: the batch shrinks as rows finish, the cache grows), installed on first use of
        # the sampler on this engine's own model (never a trainer's module): _cached_sampling_ok
        self._compile = compile
        # a mixture-of-experts model: each token's experts are recorded (routed_experts), for the
        # trainer's routing replay and the moe/* metrics (runtime/models/moe.py)
        self.record_routing = moe.is_moe(self.model)
        self._trace: moe.RoutingTrace | None = None

    # ------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, prompts: list[str], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` completions per prompt (groups contiguous); prompts with images
        (a vision-language policy: models/vision.py ``VisionPrompt``) go through hf_vision.py."""
        check_request(prompts, params)
        if any(images_of(p) for p in prompts):
            return generate_with_images(self, prompts, params)
        enc = self.tokenizer(
            prompts, return_tensors="pt", padding=True, padding_side="left"
        )
        return self._generate_padded(enc["input_ids"].to(self.device),  # [P, Tp]
                                     enc["attention_mask"].to(self.device), prompts, params)

    @torch.no_grad()
    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams,
                     prompts: list[str] | None = None) -> RolloutBatch:
        """Token in, token out: sample from the given prompt token ids exactly as they are
        (no re-tokenization; a multi-turn episode or a resumed partial rollout continues from
        the ids it holds). ``prompts``: their text for the batch (default: decoded)."""
        if prompts is None:
            prompts = self.tokenizer.batch_decode(prompt_ids, skip_special_tokens=False)
        check_request(prompts, params)
        if any(images_of(p) for p in prompts):  # ids with their images' tokens (hf_vision.py)
            return generate_ids_with_images(self, prompt_ids, prompts, params)
        ids, mask = left_pad(prompt_ids, self.pad_id)
        return self._generate_padded(ids.to(self.device), mask.to(self.device), prompts, params)

    def _generate_padded(self, unique_ids: torch.Tensor, unique_mask: torch.Tensor, prompts: list[str],
                         params: SamplingParams, **vision: torch.Tensor) -> RolloutBatch:
        """Sample for P left-padded prompts ids / mask [P, Tp]; ``vision``: the B rows' image
        inputs (pixel_values, image_grid_thw, mm_token_type_ids [B, Tp]), through ``generate``."""
        G = params.n
        prompt_ids = unique_ids.repeat_interleave(G, dim=0)  # [B, Tp]
        prompt_mask = unique_mask.repeat_interleave(G, dim=0)  # [B, Tp]

        self.model.eval()
        if not vision and self._cached_sampling_ok():
            generator = torch.Generator(device=self.device)  # the stream torch.manual_seed(seed) gives
            if params.seed is not None:
                generator.manual_seed(params.seed)
            else:
                generator.seed()
            trace = moe.RoutingTrace(self.model, prompt_ids.shape[0], unique_ids.shape[1] + params.max_new_tokens) \
                if self.record_routing else None
            with trace if trace is not None else contextlib.nullcontext():
                self._trace = trace
                try:
                    response_ids, logprobs = self._sample(unique_ids, unique_mask, params, generator)
                finally:
                    self._trace = None
        else:
            trace = None  # model.generate's forwards: not recorded
            with torch.random.fork_rng(devices=[]):
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                response_ids, logprobs = self._generate_hf(prompt_ids, prompt_mask, params, **vision)

        response_ids, response_mask, finished = cut_at_first_stop(response_ids, self.stop_ids, self.pad_id)
        logprobs = logprobs.masked_fill(response_mask == 0, 0.0)  # [B, Tr]

        completions = self.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        routed = None if trace is None else trace.result(prompt_ids.shape[1] + response_ids.shape[1])
        return RolloutBatch.from_rows(
            _rows(prompt_ids.cpu(), prompt_mask.cpu(), response_ids.cpu(), response_mask.cpu(), logprobs.cpu(),
                  finished.tolist(), repeat_each(prompts, G), completions, routed),
            G, self.pad_id, width=response_ids.shape[1])

    # ------------------------------------------------------------ the sampler
    def _cached_sampling_ok(self) -> bool:
        """Whether :meth:`_sample` can drive the model: a plain full-attention KV cache."""
        if self._sampler_ok is None:
            params = inspect.signature(self.model.forward).parameters
            try:
                default_cache = bool(self.model._supports_default_dynamic_cache())
            except (AttributeError, TypeError, ValueError):  # transformers 4.x, odd models
                default_cache = False
            self._cache_kw = cache_keyword(self.model)
            self._sampler_ok = default_cache and plain_kv_cache(self.model) \
                and "position_ids" in params and self._cache_kw is not None
            if self._sampler_ok and self._compile:
                body = backbone(self.model)
                body.forward = torch.compile(body.forward, dynamic=True)  # the weights stay the module's
            if not self._sampler_ok:
                warnings.warn(
                    f"HFEngine: {type(self.model).__name__} does not take a plain KV cache through "
                    "`cache` / `past_key_values` with `position_ids`; sampling falls back to "
                    "model.generate (same distribution, slower)", stacklevel=3)
        return self._sampler_ok

    def _logits(self, **inputs: torch.Tensor) -> torch.Tensor:
        """fp32 raw logits [N, V] of the last position."""
        if self._keep_last:
            return self.model(**inputs, use_cache=True, logits_to_keep=1).logits[:, -1].float()
        return self.model(**inputs, use_cache=True).logits[:, -1].float()

    def _sample(self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(response_ids [B, Tr], logprobs [B, Tr]) for P prompts ids/mask [P, Tp].

        The sampling loop of ``generate`` without its per-token overhead, and with two
        savings (bench/README.md):

        - each prompt is prefilled once, not G times: its KV cache and its last logits are
          then repeated G times (the rows of a group see exactly the same keys);
        - a row that has produced a stop token leaves the batch (its cache rows are dropped), so
          the last tokens of the longest answers do not drag every finished row along;
        - the KV cache is preallocated for the whole answer and written in place
          (``kv_cache.preallocated_cache``), not concatenated at every token.

        Per token, as ``generate`` with ``do_sample`` (temperature, then top-p with at least
        one token kept, top-k off): z = logits / tau, sample from softmax(top_p(z)); greedy
        = argmax of the raw logits. The logprob kept is log_softmax(z)[token] over the full
        tempered distribution. Finished rows are padded with the pad id.
        """
        G = params.n
        greedy = params.temperature == 0
        tau = 1.0 if greedy else float(params.temperature)
        P, Tp = ids.shape
        B = P * G
        T = params.max_new_tokens
        out_ids = torch.full((B, T), self.pad_id, dtype=ids.dtype, device=self.device)  # [B, T]
        out_lp = torch.zeros((B, T), dtype=torch.float32, device=self.device)  # [B, T]
        cache = preallocated_cache(self.model, Tp + T)  # grows in place (kv_cache.py)
        pos = position_ids_from_mask(mask)  # [P, Tp] as generate
        kw = self._cache_kw  # "cache" or "past_key_values", as the model's forward names it
        logits = self._logits(input_ids=ids, attention_mask=mask, position_ids=pos,
                              **{kw: cache})  # [P, V]
        if self._trace is not None:
            self._trace.prefill(mask, G)
        logits = logits.repeat_interleave(G, dim=0)  # [B, V]
        cache.batch_repeat_interleave(G)
        attn = mask.repeat_interleave(G, dim=0)  # [B, Tp + t] of the rows still running
        next_pos = pos[:, -1:].repeat_interleave(G, dim=0) + 1  # [b, 1]
        alive = torch.arange(B, device=self.device)  # [b] row of each running sequence
        steps = 0
        for t in range(T):
            z = logits / tau if not greedy else logits  # [b, V]
            # min_new_tokens: no stop token is drawn yet (the logprob kept is still the plain one)
            pick = z.index_fill(-1, self._stops, -float("inf")) if t < params.min_new_tokens else z
            if greedy:
                token = pick.argmax(dim=-1)  # [b]
            else:
                probs = torch.softmax(_top_p(pick, params.top_p) if params.top_p < 1 else pick, dim=-1)
                token = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)  # [b]
            out_ids[alive, t] = token
            out_lp[alive, t] = torch.log_softmax(z, dim=-1).gather(-1, token[:, None]).squeeze(1)
            steps = t + 1
            running = ~torch.isin(token, self._stops)  # [b]
            if t == T - 1 or not bool(running.any()):
                break
            if not bool(running.all()):
                keep = running.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                alive, token, attn, next_pos = alive[keep], token[keep], attn[keep], next_pos[keep]
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
            logits = self._logits(input_ids=token[:, None], attention_mask=attn, position_ids=next_pos,
                                  **{kw: cache})
            if self._trace is not None:
                self._trace.decode(alive, Tp + t)  # the token sampled at t, fed now
            next_pos = next_pos + 1
        return out_ids[:, :steps], out_lp[:, :steps]

    def _generate_hf(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                     params: SamplingParams, **vision: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same with ``model.generate`` (models whose cache the sampler cannot drive)."""
        greedy = params.temperature == 0
        tau = 1.0 if greedy else float(params.temperature)
        Tp = prompt_ids.shape[1]
        config = GenerationConfig(
            do_sample=not greedy,
            temperature=tau if not greedy else None,
            top_p=params.top_p if not greedy else None,
            top_k=0 if not greedy else None,  # transformers 5 would apply top_k=50 when unset
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.min_new_tokens or None,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.stop_ids),
            bos_token_id=self.tokenizer.bos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        # generate() fills every unset field from model.generation_config (a checkpoint's
        # generation_config.json may set repetition_penalty, top_k, ...): hide it, so the
        # sampling distribution is exactly the one described by `params`.
        checkpoint_defaults = self.model.generation_config
        self.model.generation_config = GenerationConfig()
        try:
            out = self.model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, **vision
            )
        finally:
            self.model.generation_config = checkpoint_defaults
        response_ids = out.sequences[:, Tp:]  # [B, Tr]
        logits = torch.stack(out.logits, dim=1).float()  # [B, Tr, V] raw logits
        logprobs = torch.log_softmax(logits / tau, dim=-1)  # [B, Tr, V]
        return response_ids, logprobs.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)  # [B, Tr]

    # -------------------------------------------------------------- weight sync
    def load_adapter(self, adapter: Any, version: int) -> None:
        """``model.lora.sync = "adapter"``: the engine's own copy of the policy gets LoRA layers
        (peft, at the first call) and ``adapter``'s tensors (a ``models.lora.LoraAdapter``) are
        copied into them, so it samples base + (alpha / r) B A as the trainer computes it, with no
        merge. ``version``: the policy version (one adapter at a time: requests run one call at a
        time here)."""
        load_adapter(self.model, adapter)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the engine's model by HF parameter (or buffer) name.

        Tied weights may arrive under either name (``lm_head.weight`` or the embedding).
        An unknown name or a shape mismatch raises; nothing is skipped silently.
        """
        targets = tensors_by_name(self.model)
        for name, tensor in named_tensors:
            if name not in targets:
                raise KeyError(
                    f"update_weights: the engine's model has no parameter {name!r} "
                    f"(it has {len(targets)}, e.g. {sorted(targets)[:3]})"
                )
            target = targets[name]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"the engine expects {tuple(target.shape)}"
                )
            target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))


def _rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
          response_mask: torch.Tensor, logprobs: torch.Tensor, finished: list[bool], prompts: list[str],
          completions: list[str], routed: torch.Tensor | None) -> list[TokenRow]:
    """The :class:`TokenRow` of each of the B sampled rows: prompt ids / mask [B, Tp] (left padded),
    response ids / mask / logprobs [B, Tr] (cut at the first stop), ``routed`` [B, Tp + Tr, Y, K]
    (the trace's columns, None: not recorded). Each tensor becomes lists once, not a row at a time."""
    Tp = prompt_ids.shape[1]
    p_len, n_len = prompt_mask.sum(1).tolist(), response_mask.sum(1).tolist()  # [B] each
    ids, resp, lps = prompt_ids.tolist(), response_ids.tolist(), logprobs.tolist()
    return [TokenRow(ids[b][Tp - p:], resp[b][:n], lps[b][:n], "stop" if finished[b] else "length",
                     prompts[b], completions[b], routed_experts=None if routed is None else routed[b, Tp - p:Tp + n],
                     images=images_of(prompts[b]))
            for b, (p, n) in enumerate(zip(p_len, n_len))]


def _top_p(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' ``TopPLogitsWarper``: -inf outside the smallest set of mass >= top_p."""
    sorted_z, order = torch.sort(z, descending=False)  # [b, V]
    cum = sorted_z.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - top_p)
    remove[..., -1:] = False  # keep at least one token
    return z.masked_fill(remove.scatter(1, order, remove), -float("inf"))
