"""One Tinker training model: the served base model with LoRA adapters (``create_model``'s rank,
``train_attn`` / ``train_mlp`` / ``train_unembed``, seed), the gradients its ``forward_backward``
calls accumulate, AdamW (``optim_step`` with each call's ``AdamParams``), sampler snapshots of its
adapters, and its states saved as rldsl checkpoints.

Target logprobs come from the trainer's own ``token_logprobs`` (train/logprobs.py) through
:func:`target_logprobs`, the one place that calls it; the sampler scores its tokens with the
same function on the same weights, so a sampler's logprobs are the trainer's (the cookbook's
``optim/kl_sample_train`` is 0).
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..config import TrainConfig
from ..errors import TinkerRefused
from ..models.loading import load_policy
from ..models.lora import adapters_disabled, apply_lora, merged_weights
from ..records.checkpoint import load_checkpoint, read_weights, save_checkpoint
from ..train.logprobs import Forward, LogprobOptions, token_logprobs
from ..train.optim import build_optimizer

#: LoRA alpha, the same at every rank (the update is (alpha / r) B A): Tinker does not publish its
#: scale; 32 is this server's choice (docs/tinker.md).
LORA_ALPHA = 32.0
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 32
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int | None = None

    def targets(self, model: torch.nn.Module) -> list[str]:
        present = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        names = (ATTN if self.train_attn else ()) + (MLP if self.train_mlp else ())
        names += ("lm_head",) if self.train_unembed else ()
        return [n for n in names if n in present]


def target_logprobs(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]],
                    grad: bool, deferred: list[PrefixGrad] | None = None) -> list[torch.Tensor]:
    """Per row (input tokens, target tokens of the same length) the logprob of each target at its
    position (position i predicts target i), float32, with gradient when ``grad``.

    The adapter over ``train.logprobs.token_logprobs``, in the layouts ``rldsl run``'s trainer
    uses, whenever the targets are the inputs shifted by one (a recipe's data): rows padding-free
    (packed), and rows that come in groups sharing a prefix (one prompt's samples) through the
    shared-prompt forward, each group's prefix once, with the prefix's own targets scored by that
    forward's prompt pass (:func:`_grouped_logprobs`). Other targets (the client may give any): every row padded,
    ``gather_ids`` the targets. Equal up to float rounding whichever the layout.

    ``deferred`` (a list, with ``grad``): when the prefixes' own targets need a forward of their
    own (a layout other than the shared-prompt one), it runs without a graph and its backward is
    left to :func:`backward_prefixes` (appended to ``deferred``), which runs it only when the loss
    gave them a gradient -- a recipe's loss gives none on the prompt (its advantages and weights
    are 0 there)."""
    with contextlib.nullcontext() if grad else torch.no_grad():
        if all(t[:-1] == x[1:] for x, t in rows):
            groups = _prefix_groups([x for x, _ in rows])
            if groups is not None:
                return _grouped_logprobs(model, rows, *groups, deferred=deferred if grad else None)
            return _packed_logprobs(model, rows)
        return _gathered_logprobs(model, rows)


def _sequences(rows: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    return [x + t[-1:] for x, t in rows]


def _packed_logprobs(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]],
                     packing: bool = True) -> list[torch.Tensor]:
    """Shifted targets: each sequence ``inputs + [last target]`` with one prompt token, packed;
    ``packing`` False: padded, for rows of about one length (a batch's prompts), where packing
    saves nothing and its layout takes time to plan."""
    seqs = _sequences(rows)
    ids, mask = _right_padded(seqs)
    Tr = ids.shape[1] - 1
    out = token_logprobs(model, Forward(ids, mask, Tr), LogprobOptions(entropy=False, packing=packing)).logprobs
    return [out[i, :len(x)] for i, (x, _) in enumerate(rows)]


def _gathered_logprobs(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Any targets: padded rows, ``gather_ids`` the targets (which need not be the shifted inputs)."""
    Tr = max(len(t) for t, _ in rows)
    ids = torch.zeros(len(rows), Tr + 1, dtype=torch.long)
    mask = torch.zeros_like(ids)
    gather = torch.zeros(len(rows), Tr, 1, dtype=torch.long)
    for i, (tokens, targets) in enumerate(rows):
        n = len(tokens)
        ids[i, :n + 1] = torch.tensor(tokens + [targets[-1]])
        mask[i, :n + 1] = 1
        gather[i, :n, 0] = torch.tensor(targets)
    out = token_logprobs(model, Forward(ids, mask, Tr, gather_ids=gather), LogprobOptions(entropy=False))
    picked = out.gathered[..., 0]  # [B, Tr]
    return [picked[i, :len(t)] for i, (t, _) in enumerate(rows)]


def _right_padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def _prefix_groups(inputs: list[list[int]]) -> tuple[int, list[int]] | None:
    """(G, each group's shared prefix length) for rows in contiguous groups of G sharing a prefix
    of their inputs (a recipe's groups: one prompt's samples), the G that saves the most tokens;
    None when no grouping saves any. With the prefix's own targets scored once per group besides,
    a group of G rows with a prefix of c tokens pushes (G - 2) c tokens fewer than G full rows."""
    B = len(inputs)
    best: tuple[int, tuple[int, list[int]] | None] = (0, None)
    for G in range(3, B + 1):
        if B % G:
            continue
        prefixes = [len(os.path.commonprefix(inputs[g:g + G])) for g in range(0, B, G)]
        if min(prefixes) < 2:
            continue
        saved = sum((G - 2) * c for c in prefixes)
        if saved > best[0]:
            best = (saved, (G, prefixes))
    return best[1]


def _grouped_logprobs(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]], G: int,
                      prefixes: list[int], deferred: list[PrefixGrad] | None = None) -> list[torch.Tensor]:
    """Shifted targets of rows in groups of G sharing a prefix of c_g tokens: the forward
    ``rldsl run``'s trainer runs for a group's samples (the prefix as the shared prompt, left
    padded; the rest of each sequence as its response; packed), which scores positions
    c_g - 1 .. n - 1. The prefix's own positions 0 .. c_g - 2 come from that forward's prompt
    pass (``LogprobOptions.prompt_logprobs``, in its graph: a gradient on them -- a group's
    samples that share their first tokens put sampled tokens in the prefix -- costs no forward
    of its own) when it ran the shared-prompt layout; else from the group's prefix alone
    (padded), a second forward (its backward ``deferred`` when given)."""
    seqs = _sequences(rows)
    Tp = max(prefixes)
    Tr = max(len(s) - prefixes[i // G] for i, s in enumerate(seqs))
    ids = torch.zeros(len(seqs), Tp + Tr, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        c = prefixes[i // G]
        ids[i, Tp - c:Tp + len(s) - c] = torch.tensor(s)
        mask[i, Tp - c:Tp + len(s) - c] = 1
    out = token_logprobs(model, Forward(ids, mask, Tr, group_size=G),
                         LogprobOptions(entropy=False, packing=True, prompt_logprobs=True))
    rest = out.logprobs  # [B, Tr]
    heads = [s[:c] for s, c in zip(seqs[::G], prefixes)]
    head_rows = [(h[:-1], h[1:]) for h in heads]
    if out.prompt_logprobs is not None:  # [P, Tp - 1]: the prefix's targets, from the same forward
        head = [out.prompt_logprobs[g, Tp - c:Tp - 1] for g, c in enumerate(prefixes)]
    elif deferred is None:
        head = _packed_logprobs(model, head_rows, packing=False)  # each prefix's targets
    else:
        with torch.no_grad():
            head = [h.clone().requires_grad_() for h in _packed_logprobs(model, head_rows, packing=False)]
        deferred.append(PrefixGrad(model, head_rows, head))
    return _joined(head, rest, [len(x) for x, _ in rows], G, prefixes)


def _joined(head: list[torch.Tensor], rest: torch.Tensor, lengths: list[int], G: int,
            prefixes: list[int]) -> list[torch.Tensor]:
    """Row i's logprobs: its group's prefix targets (``head[i // G]``), then its first
    ``lengths[i] - c + 1`` of ``rest`` [B, Tr]; gathered from both in one index and split into
    views (two autograd nodes for the call, not one concatenation per row)."""
    Tr = rest.shape[1]
    base = sum(h.shape[0] for h in head)  # rest's values follow the heads' in the flat tensor
    starts = [0]
    for h in head:
        starts.append(starts[-1] + h.shape[0])
    index: list[int] = []
    for i, n in enumerate(lengths):
        g, c = i // G, prefixes[i // G]
        index.extend(range(starts[g], starts[g] + c - 1))
        index.extend(range(base + i * Tr, base + i * Tr + n - c + 1))
    flat = torch.cat([*(h.reshape(-1) for h in head), rest.reshape(-1)])
    return list(flat[torch.tensor(index, dtype=torch.long)].split(lengths))


@dataclass
class PrefixGrad:
    """The prefixes' own targets of one grouped forward, scored without a graph: ``head`` (one
    leaf per group, in every row of its group) collects the loss's gradient;
    :func:`backward_prefixes` carries it into the weights when it is not 0."""

    model: torch.nn.Module
    rows: list[tuple[list[int], list[int]]]
    head: list[torch.Tensor]


def backward_prefixes(deferred: list[PrefixGrad]) -> None:
    """After the loss's backward: for each deferred prefix forward whose targets received a
    gradient, that forward again with a graph, and its backward with that gradient (the same
    gradients as a graph kept from the start, without a prefix backward a recipe does not need)."""
    for d in deferred:
        grads = [h.grad if h.grad is not None else torch.zeros_like(h) for h in d.head]
        if any(bool(g.any()) for g in grads):
            torch.autograd.backward(_packed_logprobs(d.model, d.rows, packing=False), grads)


class TrainedModel:
    """A ``create_model``: the policy with its adapters, gradients, optimizer and snapshots."""

    def __init__(self, model_id: str, base_name: str, path: Path, lora: LoraSpec) -> None:
        self.model_id, self.base_name, self.path, self.lora = model_id, base_name, path, lora
        model = load_policy(path, "float32")
        for p in model.parameters():
            p.requires_grad_(False)
        targets = lora.targets(model)
        if not targets:
            raise TinkerRefused(400, "create_model: the LoRA config trains nothing (train_attn, train_mlp "
                                     "and train_unembed all false, or the model has none of those layers)")
        with _seeded(lora.seed):
            self.policy, self.peft = apply_lora(model, rank=lora.rank, alpha=LORA_ALPHA, dropout=0.0,
                                                target_modules=targets)
        self.policy.eval()  # no dropout: a sampler's logprobs must be the trainer's
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps = 0
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._engine: torch.nn.Module | None = None  # the plain model the samplers run (sampling_model)
        self._engine_version: int | None = None
        self.loss_metrics: list[dict[str, float]] = []  # the forward_backward calls since the last step
        self._deferred: list[PrefixGrad] = []  # the last logprobs' prefix forwards (backward_prefixes)

    # ------------------------------------------------------------------ training
    def logprobs(self, rows: list[tuple[list[int], list[int]]], grad: bool) -> list[torch.Tensor]:
        """Target logprobs; with ``grad``, a loss of them goes back through :meth:`backward`."""
        self._deferred = []
        return target_logprobs(self.policy, rows, grad, self._deferred)

    def backward(self, loss: torch.Tensor) -> None:
        """The gradients of ``loss`` (of the last :meth:`logprobs`), accumulated into the adapters'."""
        loss.backward()
        deferred, self._deferred = self._deferred, []
        backward_prefixes(deferred)

    def reference_logprobs(self, rows: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """The reference policy's target logprobs (a spec's KL term): the base, adapters off."""
        with adapters_disabled(self.peft):
            return target_logprobs(self.policy, rows, grad=False)

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = build_optimizer(self.params, TrainConfig(lr=1e-4))
        return self.optimizer

    def optim_step(self, adam: dict[str, Any]) -> dict[str, float]:
        """One AdamW step with the request's ``AdamParams`` (its defaults as the client's), the
        gradients then zeroed."""
        lr, eps = float(adam.get("learning_rate", 1e-4)), float(adam.get("eps", 1e-12))
        betas = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
        wd, clip = float(adam.get("weight_decay", 0.0)), float(adam.get("grad_clip_norm", 0.0))
        if lr < 0 or eps <= 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or wd < 0:
            raise TinkerRefused(400, f"optim_step: AdamParams out of range: {adam}")
        opt = self._optimizer()
        for group in opt.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=wd)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
            if grads else 0.0
        if clip > 0 and grads:
            torch.nn.utils.clip_grad_norm_(self.params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.steps += 1
        # the losses' own metrics (a spec's clip_fraction, ...) averaged over the step's calls: a
        # recipe logs optim_step's metrics, not forward_backward's
        keys = {k for m in self.loss_metrics for k in m}
        out = {k: sum(m[k] for m in self.loss_metrics if k in m) / sum(k in m for m in self.loss_metrics)
               for k in sorted(keys)}
        self.loss_metrics = []
        return {**out, "grad_norm:mean": norm if math.isfinite(norm) else float("nan")}

    # ------------------------------------------------------------------ snapshots
    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.policy.named_parameters() if p.requires_grad}

    def snapshot(self, version: int) -> None:
        self.snapshots[version] = self.adapter_state()

    def sampling_model(self, version: int | None) -> torch.nn.Module:
        """The plain model with snapshot ``version``'s adapters merged into its weights (W + (alpha/r)
        B A), what the samplers of that version run: one plain matmul per layer instead of a LoRA
        layer's three, as ``rldsl run``'s engine samples with the merged weights its sync sends.
        One copy of the base per training model, rewritten when another version is sampled; its
        embeddings untied, so that a merged ``lm_head`` leaves the input embeddings the base's."""
        if self._engine is None:
            engine = load_policy(self.path, "float32").eval()
            engine.requires_grad_(False)
            head = engine.get_output_embeddings()
            head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
            self._engine = engine
        if self._engine_version != version or version is None:
            state = self.merged_state(version)
            with torch.no_grad():
                named = dict(self._engine.named_parameters())
                for name, tensor in state.items():
                    if name in named:
                        named[name].copy_(tensor)
            self._engine_version = version
        return self._engine

    def merged_state(self, version: int | None) -> dict[str, torch.Tensor]:
        """The plain model's weights with snapshot ``version``'s adapters merged (None: the
        current adapters): what a sampler of that version samples with, here or on vLLM."""
        with self.weights(self.snapshots.get(version) if version is not None else None):
            return merged_weights(self.policy)

    @contextlib.contextmanager
    def weights(self, state: dict[str, torch.Tensor] | None) -> Iterator[torch.nn.Module]:
        """The policy with ``state``'s adapters (a snapshot) for the block, the trained ones after."""
        if state is None:
            yield self.policy
            return
        current = self.adapter_state()
        named = dict(self.policy.named_parameters())
        with torch.no_grad():
            for n, t in state.items():
                named[n].copy_(t)
        try:
            yield self.policy
        finally:
            with torch.no_grad():
                for n, t in current.items():
                    named[n].copy_(t)

    # ------------------------------------------------------------------ states
    def save(self, folder: Path, tokenizer: Any) -> Path:
        """An rldsl checkpoint (atomic, checksummed) of the adapters (the base stays the served
        folder's, as Tinker's LoRA states) and the optimizer state."""
        return save_checkpoint(folder, self.steps, policy=_Adapters(self.adapter_state()), tokenizer=tokenizer,
                               optimizer=self._optimizer(), scheduler=None,
                               extra_state={"base_model": self.base_name, "rank": self.lora.rank,
                                            "train_attn": self.lora.train_attn, "train_mlp": self.lora.train_mlp,
                                            "train_unembed": self.lora.train_unembed})

    def load(self, folder: Path, with_optimizer: bool) -> None:
        ckpt = load_checkpoint(folder)
        saved = _Adapters.names(read_weights(ckpt.policy_path))
        named = dict(self.policy.named_parameters())
        if set(saved) != {n for n, p in named.items() if p.requires_grad}:
            raise TinkerRefused(400, f"load_weights: {folder} holds adapters of another shape than this model's "
                                     "(another base model or LoRA config)")
        with torch.no_grad():
            for n, t in saved.items():
                named[n].copy_(t)
        self.steps = ckpt.step
        if with_optimizer:
            ckpt.restore(optimizer=self._optimizer(), rng=False)
        else:
            self.optimizer = None


class _Adapters(torch.nn.Module):
    """The adapters as a module of their own, what a checkpoint saves as its policy (safetensors):
    parameter names with their dots written as ``::``."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in state.items():
            self.register_buffer(name.replace(".", "::"), tensor.contiguous())

    @staticmethod
    def names(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k.replace("::", "."): v for k, v in saved.items()}


def saved_lora(folder: Path) -> tuple[str, LoraSpec]:
    """(base model name, LoRA config) of a saved state: what create-via-load builds."""
    extra = load_checkpoint(folder).extra
    return extra["base_model"], LoraSpec(int(extra["rank"]), bool(extra["train_attn"]), bool(extra["train_mlp"]),
                                         bool(extra["train_unembed"]))


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """The LoRA initialisation drawn from ``seed`` (the process RNG restored after)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield
