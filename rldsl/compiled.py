"""CompiledAlgorithm: the generated ``advantages()`` (eager) and ``loss()`` (torch.compile'd).

``rldsl.compile(algo)`` is the only way the runtime gets a formula. Compiled loss functions
are cached per generated source within a process, so many CompiledAlgorithm objects of the
same spec share one compilation.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from . import codegen, inputs, lazy_torch, ops
from .components import entropy as entropy_components
from .components.data import informative as _informative
from .components.filter import pass_rates as _pass_rates, retired as _retired
from .formula import hooks as formula_hooks
from .generated import load_function
from .priority import ReplayPolicy
from .registry import get as registry_get
from .spec import Algorithm

lazy_torch.load()  # the components hold torch itself (not the stand-in) before torch.compile traces them
_COMPILED: dict[str, Callable[..., Any]] = {}


def compile_enabled(default: bool = True) -> bool:
    """``RLDSL_COMPILE=0`` turns torch.compile off everywhere (eager functions)."""
    v = os.environ.get("RLDSL_COMPILE")
    if v is None:
        return default
    return v.strip().lower() not in ("0", "false", "no", "off", "")


@dataclass
class Estimate:
    """What ``CompiledAlgorithm.estimate`` returns (see docs/api.md)."""

    advantages: Tensor  # [B, T]
    returns: Tensor     # [B, T]
    mask: Tensor        # [B, T] loss mask (filters applied)
    rewards: Tensor     # [B] after shaping and KL-in-reward
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class LossOutput:
    loss: Tensor
    value_loss: Tensor | None
    metrics: dict[str, float]
    metric_tensors: dict[str, Tensor] = field(default_factory=dict, repr=False)


@dataclass
class DataPlan:
    """What the runtime carries out: each field is set by a component's ``plan`` fact
    (registry.PLAN lists them), e.g. ``sampling dynamic(max_rounds=10)`` -> dynamic_rounds = 10.
    Rewards are the raw [P, G] verifier rewards, NaN where a reward failed: a failed reward is
    left out, never counted as 0."""

    dynamic_rounds: int = 1
    replay_policy: ReplayPolicy | None = None  # sampling replay(...): the whole policy (rldsl/priority.py)
    pass_rate_cap: float | None = None
    teacher_topk: int | None = None
    jsd_beta: float | None = None
    jsd_temperature: float = 1.0
    policy_topk: int | None = None  # a formula's K (a float parameter there): a whole number here
    tree_shape: "TreePlan | None" = None  # sampling tree(M, N, L, T): the sampler's shape

    def __post_init__(self) -> None:
        if self.policy_topk is not None:
            self.policy_topk = int(self.policy_topk)

    @staticmethod
    def informative(rewards: Tensor) -> Tensor:
        """[P, G] -> [P] bool: the group's scorable rewards are not all equal."""
        return _informative(rewards)

    @staticmethod
    def pass_rates(rewards: Tensor) -> Tensor:
        """[P, G] -> [P] float64: mean scorable reward of each group (NaN: none scorable)."""
        return _pass_rates(rewards)

    def retire(self, rewards: Tensor) -> Tensor:
        """[P, G] -> [P] bool: prompts to leave later epochs (pass rate >= cap); none without a cap."""
        if self.pass_rate_cap is None:
            return torch.zeros(rewards.shape[0], dtype=torch.bool, device=rewards.device)
        return _retired(rewards, self.pass_rate_cap)


@dataclass(frozen=True)
class TreePlan:
    """``sampling tree(M, N, L, T)``: M answers per prompt, L forking iterations of N fork points
    per tree and T continuations per fork point (runtime/rollout/tree.py samples it)."""

    M: int
    N: int
    L: int
    T: int

    @property
    def rows(self) -> int:
        """The leaves (rows) of a prompt's trees: every generation ends in one."""
        return self.M * (1 + self.L * self.N * self.T)


def _plan_value(field_name: str, params: dict[str, Any], param: str) -> Any:
    """A DataPlan field's value from its component's parameters (most are one parameter)."""
    if field_name == "replay_policy":
        return ReplayPolicy.of(params)
    if field_name == "tree_shape":
        return TreePlan(*(int(params[k]) for k in "MNLT"))
    return params[param]


class CompiledAlgorithm:
    """Callable pieces of one algorithm. Build it with :func:`rldsl.compile`."""

    def __init__(self, algo: Algorithm, compile: bool = True, **compile_kwargs: Any):
        self.algorithm = algo
        gen = codegen.generate(algo)
        self.advantages_source = gen.advantages_source
        self.loss_source = gen.loss_source
        self._advantages = load_function(gen.advantages_source, "advantages")
        # the optional inputs each generated function takes beyond its fixed arguments, in order
        self._extra_inputs = {stage: codegen.extra_inputs(algo, stage) for stage in inputs.STAGES}
        self.eager_loss = load_function(gen.loss_source, "loss")
        self.compiled = compile and compile_enabled()
        self._compile_kwargs = compile_kwargs
        self._loss = self._build(gen.loss_source, self.eager_loss)
        self._loss_no_metrics_source = gen.loss_source_no_metrics
        self._loss_no_metrics: Callable[..., Any] | None = None  # built at first use
        self.state: dict[str, Tensor] = {}
        self.data = DataPlan(**{f: _plan_value(f, v.params, p)
                                for v in algo.active() for f, p in v.spec.facts.plan.items()})

    def _build(self, source: str, eager: Callable[..., Any]) -> Callable[..., Any]:
        """torch.compile ``eager`` once per process per source (or keep it eager)."""
        if not self.compiled:
            return eager
        key = source + repr(sorted(self._compile_kwargs.items()))
        if key not in _COMPILED:
            _COMPILED[key] = torch.compile(eager, **{"dynamic": True, **self._compile_kwargs})
        return _COMPILED[key]

    @property
    def source(self) -> str:
        """The generated Python source (what ``rldsl explain --code`` prints)."""
        return self.advantages_source + "\n\n" + self.loss_source

    def _check_inputs(self, call: str, stage: str, given: dict[str, Any]) -> None:
        """Every active component of ``stage`` gets the optional inputs it needs (its ``needs``
        fact); an input without a default that a component reads and the call left out fails,
        naming every input of the call the component reads. ``given``: the call's keywords that
        are inputs of the table."""
        for v in self.algorithm.active(stage):
            if inputs.missing(v.spec.facts.needs, given):
                reads = [x for x in v.spec.facts.needs if x in given and not inputs.INPUTS[x].default]
                raise ValueError(f"{self.algorithm.name}: {call}() needs " + " and ".join(f"{x}=" for x in reads)
                                 + f" for {v.slot} {v.component}")

    @staticmethod
    def _more(call: str, stage: str, more: dict[str, Any]) -> dict[str, Any]:
        """Keywords beyond the named ones: inputs of the table for this call (an input added to the
        table is a keyword at once); anything else is refused, naming the inputs."""
        names = {i.name for i in inputs.of_stage(stage)}
        unknown = [k for k in more if k not in names]
        if unknown:
            raise TypeError(f"{call}() got an unexpected keyword argument {unknown[0]!r}; its optional "
                            f"inputs (rldsl/inputs.py): {', '.join(sorted(names))}")
        return more

    @staticmethod
    def _given(stage: str, keywords: dict[str, Any], every: bool = True) -> dict[str, Any]:
        """The inputs of the table a call of ``stage`` received, from its keywords: every input of
        the stage (None where not given), or with ``every=False`` only those it has a keyword for
        (``denominator()`` takes group_size only)."""
        return {i.name: keywords.get(i.name) for i in inputs.of_stage(stage) if every or i.name in keywords}

    def _extras(self, stage: str, given: dict[str, Any], sizes: dict[str, int],
                like: Tensor) -> tuple[Any, ...]:
        """The extra arguments of the generated function of ``stage``: each input it takes,
        shape-checked against ``sizes`` (B, T, then K bound by the first input that has it),
        detached unless the update's own forward makes it (source ``update``: its gradient
        reaches the loss); an absent one with default ``ones`` is ones of its shape. A number
        ([]) takes ``like``'s dtype and device (a new value does not recompile);
        advantage-stage float tensors are float32 (an int one keeps its dtype)."""
        out: list[Any] = []
        for i in self._extra_inputs[stage]:
            x = given.get(i.name)
            if x is None and i.default == "ones":
                x = torch.ones([sizes[d] for d in i.dims], device=like.device)
            if x is None:
                out.append(None)  # a slot passes it to every component; none of them reads it
                continue
            x = x if isinstance(x, Tensor) else torch.as_tensor(x)
            if i.rank == 0:
                out.append(torch.as_tensor(x, dtype=like.dtype, device=like.device).detach())
                continue
            problem = inputs.check_shape(i, x, sizes)
            if problem is not None:
                raise ValueError(f"{self.algorithm.name}: {problem}")
            if i.finite and not bool(torch.isfinite(x).all()):
                raise ValueError(f"{self.algorithm.name}: {i.name} must be finite numbers; got {x.tolist()}")
            if stage == "advantage":  # an int input (group_keys: hashes) keeps its integers
                x = x.detach().to(device=like.device, dtype=torch.float32 if i.dtype == "float32" else x.dtype)
            # the update's own forward (source "update") carries the gradient into the loss
            out.append(x if i.source == "update" else x.detach())
        return tuple(out)

    # ---------------------------------------------------------------- advantages

    def estimate(self, rewards: Tensor, group_size: int, mask: Tensor, values: Tensor | None = None,
                 truncated: Tensor | None = None, old_logprobs: Tensor | None = None,
                 ref_logprobs: Tensor | None = None,
                 rollout_logprobs: Tensor | None = None,
                 reward_baselines: Tensor | None = None,
                 sum_pi_squared: Tensor | None = None,
                 self_certainty: Tensor | None = None,
                 reward_components: Tensor | None = None,
                 reward_weights: Tensor | None = None,
                 dense_rewards: Tensor | None = None,
                 group_keys: Tensor | None = None,
                 prompt_mean: Tensor | None = None, prompt_var: Tensor | None = None,
                 prompt_count: Tensor | None = None, prompt_steps: Tensor | None = None,
                 prompt_step_var: Tensor | None = None, ref_reward: Tensor | None = None,
                 answer_prob: Tensor | None = None, bare_answer_prob: Tensor | None = None,
                 node_value: Tensor | None = None, parent_value: Tensor | None = None,
                 root_value: Tensor | None = None, node_leaves: Tensor | None = None,
                 parent_leaves: Tensor | None = None,
                 **more: Tensor) -> Estimate:
        """Rewards [B] -> advantages, returns, loss mask [B, T] (see docs/api.md).

        ``reward_baselines`` [B]: the reward of a greedy rollout of each row's prompt
        (repeated over its group), read by ``baseline greedy_reward`` (ReMax) only.
        ``sum_pi_squared`` [B, T]: sum_v pi_v^2 of the old policy at each response token,
        read by ``baseline optimal_token`` (with ``old_logprobs``) only.
        ``self_certainty`` [B, T]: logsumexp(z) - mean(z) of the old policy's tempered logits at
        each response token, read by formulas that name it (Intuitor's reward).
        ``reward_components`` [B, K]: each reward function's unweighted reward and
        ``reward_weights`` [K] (default all 1; ``rewards`` stays their weighted sum), read by
        ``baseline per_reward_group`` (GDPO) only.
        ``dense_rewards`` [B, T]: each turn's (or step's) reward on the response token that ends
        it, read by ``rewards dense`` (the token rewards become them, the rest of each row's
        reward on its last token) and by formulas that read ``r_dense``.

        ``group_keys`` [B] int: each row's key of the data field a component's ``group_by=FIELD``
        names (equal values, equal keys), read by the components that group by it.

        ``prompt_mean`` / ``prompt_var`` / ``prompt_count`` [B]: the running statistics of each
        row's prompt's finite rewards over every step it was seen in, this one included (the
        caller keeps them across steps), read by formulas that name them; so are
        ``prompt_steps`` / ``prompt_step_var`` [B]: how many groups of the prompt those rewards
        came in, and the mean of the groups' Bessel variances.

        ``ref_reward`` [B]: the reward of a reference model's answers to each row's prompt (its
        prompt's mean, repeated over the group), read by formulas that name it; a non-finite
        value takes its row out of the loss (below).

        ``answer_prob`` / ``bare_answer_prob`` [B]: the mean per-token probability the policy gives
        the data's reference answer after the row's own reasoning / right after the prompt (RLPR's
        reward), read by formulas that name them.
        ``node_value`` / ``parent_value`` / ``node_leaves`` / ``parent_leaves`` [B, T] and
        ``root_value`` [B]: a tree's rows (``sampling tree``): the mean reward and the number of the
        leaves below each token's tree node and below its parent, and every leaf's mean (the
        runtime's rollout/tree.py makes them), read by formulas that name them.

        With ``rollout_logprobs`` (the engine's logprobs, [B, T]) and a ``correction`` slot,
        its rejections leave ``est.mask`` (denominator included) and its metrics join
        ``est.metrics``; the correction then compares them with ``old_logprobs``.

        Non-finite rewards (e.g. a reward function that failed with on_error=skip) are
        replaced by their group's mean finite reward -- so they do not move the group's
        baseline -- and their rows are removed from the loss mask. So is a row with a non-finite
        value of an input that fails a row (``ref_reward``: every reference answer's reward
        failed), that input's value replaced likewise.
        """
        if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
            raise ValueError(f"rewards must be [B] and mask [B, T]; got {tuple(rewards.shape)} "
                             f"and {tuple(mask.shape)}")
        if group_size < 1 or rewards.shape[0] % group_size:
            raise ValueError(f"{rewards.shape[0]} rows are not a whole number of groups of {group_size}")
        given = self._given("advantage", {**locals(), **self._more("estimate", "advantage", more)})
        self._check_inputs("estimate", "advantage", given)
        sizes = {"B": rewards.shape[0], "T": mask.shape[1]}
        for x in self.algorithm.needs("advantage"):  # what the components read has the table's shape
            i = inputs.INPUTS[x]
            problem = None if given.get(x) is None else inputs.check_shape(i, given[x], sizes)
            if problem is not None:
                raise ValueError(f"{self.algorithm.name}: {problem}")
        rewards = rewards.detach().to(torch.float32)
        finite = torch.isfinite(rewards)
        ok = finite  # rows with a reward, and a finite value of every input that fails a row (ref_reward)
        for i in inputs.failing_rows(given):
            ok = ok & torch.isfinite(given[i.name].detach()).to(ok.device)
        for i in inputs.failing_rows(given):  # a failed row reads its group's mean finite value
            given[i.name] = _group_filled(given[i.name].detach().float(), ok.to(given[i.name].device), group_size)
        extra = self._extras("advantage", given, sizes, mask)
        clean = rewards if bool(ok.all()) else _group_filled(rewards, ok, group_size)
        B = rewards.shape[0]
        if B == 0:
            z = torch.zeros(mask.shape, dtype=torch.float32)
            return Estimate(z, z, z, rewards, {"rows": 0.0})
        row_mask = mask.float() * ok.unsqueeze(-1).float()  # failed rows: no tokens
        adv, returns, loss_mask, shaped = self._advantages(
            clean, row_mask, group_size, values, truncated, old_logprobs, ref_logprobs, self.state,
            ok, *extra)
        metrics = self._estimate_metrics(rewards, finite, shaped, adv, mask, loss_mask, group_size)
        if rollout_logprobs is not None:
            loss_mask = self._correct_mask(loss_mask, old_logprobs, rollout_logprobs, metrics)
        return Estimate(adv, returns, loss_mask, shaped, metrics)

    def _correct_mask(self, loss_mask: Tensor, old_logprobs: Tensor | None, rollout_logprobs: Tensor,
                      metrics: dict[str, float]) -> Tensor:
        """The correction slot's rejections applied to the loss mask (its metrics into ``metrics``)."""
        active = [v for v in self.algorithm.slots["correction"] if not v.spec.off]
        if not active:
            return loss_mask
        if self.algorithm.old_from_rollout:
            return loss_mask  # bypass: the corrections compare pi_theta with the engine, in loss() only
        if old_logprobs is None:
            raise ValueError(f"{self.algorithm.name}: estimate() with rollout_logprobs= needs "
                             f"old_logprobs= for correction {active[0].component}")
        if rollout_logprobs.shape != loss_mask.shape or old_logprobs.shape != loss_mask.shape:
            raise ValueError(f"rollout_logprobs {tuple(rollout_logprobs.shape)} and old_logprobs "
                             f"{tuple(old_logprobs.shape)} must have the mask's shape {tuple(loss_mask.shape)}")
        m = loss_mask.float()
        old, roll = old_logprobs.detach().float(), rollout_logprobs.detach().float()
        keep = torch.ones_like(m)
        out: dict[str, Tensor] = {}
        with torch.no_grad():
            for v in active:
                _, k, mt = v.spec.fn(old, roll, m, **v.spec.fn_params(v.params))
                keep = keep * k
                out.update(mt)
            out.update(ops.rejection_metrics(keep, m))
        metrics.update({k: float(t) for k, t in out.items()})
        return (m * keep).to(loss_mask.dtype)

    def advantages(self, rewards: Tensor, group_size: int, mask: Tensor,
                   values: Tensor | None = None, **kw: Any) -> Tensor:
        """Rewards [B] -> advantages [B, T] (``estimate(...).advantages``)."""
        return self.estimate(rewards, group_size, mask, values, **kw).advantages

    @staticmethod
    def _estimate_metrics(raw: Tensor, finite: Tensor, shaped: Tensor, adv: Tensor, mask: Tensor,
                          loss_mask: Tensor, G: int) -> dict[str, float]:
        with torch.no_grad():
            r = raw[finite]
            zero_var = (~DataPlan.informative(ops.group_view(raw, G))).float().mean()
            kept_rows = (loss_mask.sum(-1) > 0) | (mask.sum(-1) == 0)
            lm = loss_mask
            n = lm.sum().clamp_min(1)
            a_mean = (adv * lm).sum() / n
            vals = torch.stack([
                r.mean() if r.numel() else torch.tensor(float("nan")),
                r.std() if r.numel() > 1 else torch.tensor(0.0),
                shaped.mean(), zero_var, (~kept_rows).float().sum(), (~finite).float().sum(),
                a_mean, (((adv - a_mean) ** 2 * lm).sum() / n).sqrt(),
                torch.where(lm > 0, adv, torch.full_like(adv, -float("inf"))).max(),
                torch.where(lm > 0, adv, torch.full_like(adv, float("inf"))).min(),
            ]).tolist()
        keys = ["reward_mean", "reward_std", "reward_shaped_mean", "zero_variance_groups",
                "filtered_rows", "nonfinite_rewards", "adv_mean", "adv_std", "adv_max", "adv_min"]
        return dict(zip(keys, vals))

    # ---------------------------------------------------------------- loss

    def denominator(self, mask: Tensor, group_size: int | None = None) -> Tensor:
        """The local aggregation count (0-dim); sum it over micro-batches/ranks for ``denominator=``."""
        agg = self.algorithm["aggregation"]
        self._check_inputs("denominator", "loss", self._given("loss", locals(), every=False))
        if agg.formula is not None:  # written in the spec: the count of its generated lines
            return self._with_term_counts(formula_hooks.denominator(agg, mask, group_size or 1), mask, group_size)
        comp = agg.spec
        _, count = comp.fn(mask.float(), group_size or 1, **comp.fn_params(agg.params))
        return self._with_term_counts(count, mask, group_size)

    def _with_term_counts(self, count: Tensor, mask: Tensor, group_size: int | None) -> Tensor:
        """``count``, or [count, the KL term's count] when the KL term has its own aggregation
        (kl ``aggregation=NAME``): the sum over micro-batches / ranks is elementwise, and each
        term divides by its own entry."""
        kl = self.algorithm["kl"]
        name = kl.params.get("aggregation") if kl.stage == "loss" and not kl.spec.off else None
        if name is None:
            return count
        comp = registry_get("aggregation", name)
        defaults = {k: p.default for k, p in comp.params.items()}
        _, own = comp.fn(mask.float(), group_size or 1, **comp.fn_params(defaults))
        return torch.stack([torch.as_tensor(count, dtype=torch.float32), torch.as_tensor(own, dtype=torch.float32)])

    def value_denominator(self, mask: Tensor, group_size: int | None = None) -> Tensor:
        """The critic's local aggregation count (0-dim), for ``value_denominator=`` (summed the same way)."""
        if not self.algorithm.uses_critic:
            raise ValueError(f"{self.algorithm.name} has no critic")
        comp = self._critic_aggregation()
        if inputs.missing(comp.facts.needs, self._given("loss", locals(), every=False)):
            raise ValueError(f"{self.algorithm.name}: value_denominator() needs group_size= for the "
                             f"critic's aggregation {comp.name}")
        defaults = {k: p.default for k, p in comp.params.items()}
        _, count = comp.fn(mask.float(), group_size or 1, **comp.fn_params(defaults))
        return count

    def _critic_aggregation(self) -> Any:
        return registry_get("aggregation", self.algorithm["critic"].params["aggregation"])

    def loss(self, logprobs: Tensor, old_logprobs: Tensor, adv: Tensor, mask: Tensor,
             ref_logprobs: Tensor | None = None, values: Tensor | None = None,
             returns: Tensor | None = None, old_values: Tensor | None = None,
             entropy: Tensor | None = None, group_size: int | None = None,
             denominator: Tensor | float | None = None, metrics: bool = True,
             value_denominator: Tensor | float | None = None,
             rollout_logprobs: Tensor | None = None,
             entropy_coef: Tensor | float | None = None,
             teacher_logprobs: Tensor | None = None, teacher_topk_logprobs: Tensor | None = None,
             topk_logprobs: Tensor | None = None, divergence: Tensor | None = None,
             old_entropy: Tensor | None = None, sequence_rewards: Tensor | None = None,
             router_aux: Tensor | None = None, ref_reward: Tensor | None = None,
             policy_topk_logprobs: Tensor | None = None, old_topk_logprobs: Tensor | None = None,
             is_top1: Tensor | None = None,
             **more: Tensor) -> LossOutput:
        """Per-token tensors [B, T] -> the scalar loss to minimise, value loss and metrics.

        ``entropy_coef``: the coefficient of ``entropy adaptive`` for this optimizer step
        (``entropy_coef()``); after the step, ``update_entropy_coef(measured)`` moves it.

        ``value_denominator``: the critic's global count (``value_denominator()`` summed over
        micro-batches / ranks), as ``denominator`` is the policy's; without it the value loss
        uses its local count, or ``denominator`` when the critic aggregates like the policy.

        ``metrics=False`` runs the same loss compiled without its diagnostics (faster on
        steps whose metrics are not logged); ``out.metrics`` is then empty.

        ``rollout_logprobs``: the engine's logprobs [B, T], needed by a ``correction`` slot
        (importance weights on the policy loss, rejections off the mask; docs/api.md).

        ``teacher_logprobs`` [B, T], ``teacher_topk_logprobs`` [B, T, J] and ``topk_logprobs``
        [B, T, J] (the policy's logprobs of the teacher's top-k tokens, with gradient) and
        ``divergence`` [B, T] (the generalized JSD from the teacher over the vocabulary, with
        gradient): what a ``distill`` component reads (docs/distillation.md).

        ``old_entropy``: the old policy's per-token entropy [B, T] (from the forward that made
        ``old_logprobs``), read by a formula as ``old_ent`` (Entropy-Ratio Clipping).

        ``sequence_rewards``: each row's reward [B] as ``estimate()`` received it, read by a
        formula as ``reward`` (an NLL on the correct answers, docs/new_algorithms.md).

        ``router_aux``: a mixture-of-experts policy's per-token router load-balancing loss [B, T]
        (with gradient), what ``router balance`` reads (docs/moe.md).

        ``ref_reward``: the reference model's reward [B] of each row's prompt, read by a formula
        as ``ref_reward``; pass a finite value (``rldsl run`` passes 0 on a row ``estimate()``
        left out for a non-finite one: it has no loss tokens).
        ``policy_topk_logprobs`` [B, T, K] (with gradient), ``old_topk_logprobs`` [B, T, K] and
        ``is_top1`` [B, T]: the policy's top-K, read by a formula as ``topk_logp``, ``old_topk_logp``
        and ``is_top1`` (K: the formula's parameter K, ``data.policy_topk``; docs/formulas.md).
        """
        algo = self.algorithm
        given = self._given("loss", {**locals(), **self._more("loss", "loss", more)})
        self._check_inputs("loss", "loss", given)
        if denominator is not None and not isinstance(denominator, Tensor):
            denominator = torch.tensor(float(denominator))
        if value_denominator is not None and not isinstance(value_denominator, Tensor):
            value_denominator = torch.tensor(float(value_denominator))
        fn = self._loss
        if not metrics:
            if self._loss_no_metrics is None:
                eager = load_function(self._loss_no_metrics_source, "loss")
                self._loss_no_metrics = self._build(self._loss_no_metrics_source, eager)
            fn = self._loss_no_metrics
        if logprobs.numel() == 0:  # no rows: nothing to learn, and no reduction to take
            zero = (logprobs * 0).sum()
            return LossOutput(zero, None if not algo.uses_critic else zero, {})
        extra: tuple[Any, ...] = (value_denominator,) if algo.uses_critic else ()
        extra += self._extras("loss", given, {"B": logprobs.shape[0], "T": logprobs.shape[1]}, logprobs)
        total, value_loss, mt = fn(
            logprobs, old_logprobs.detach(), adv.detach(), mask, ref_logprobs, values, returns,
            old_values, entropy, group_size or 1, denominator, *extra)
        names = list(mt)
        vals = torch.stack([mt[k].detach().float().reshape(()) for k in names]).tolist() if names else []
        return LossOutput(total, value_loss, dict(zip(names, vals)), mt)

    # ---------------------------------------------------------------- state

    def _adaptive_entropy(self) -> Any:
        """The entropy slot's value when its component reads the algorithm's own state (a
        coefficient moved after each optimizer step: `entropy adaptive`), else None."""
        v = self.algorithm["entropy"]
        return v if any(inputs.INPUTS[x].source == "algorithm" for x in v.spec.facts.needs) else None

    def entropy_coef(self) -> Tensor | None:
        """The coefficient ``entropy adaptive`` applies at the coming optimizer step (0-dim),
        for ``loss(entropy_coef=...)``; None when the spec has no adaptive entropy."""
        v = self._adaptive_entropy()
        return None if v is None else entropy_components.adaptive_coef(self.state, v.params)

    def update_entropy_coef(self, measured: float) -> dict[str, float]:
        """After an optimizer step whose mean per-token entropy (loss-mask tokens, every
        micro-batch and rank) was ``measured``: move the coefficient (TRL's rule, in the
        component's docstring); returns ``{"entropy_coef": new}`` ({} without one)."""
        v = self._adaptive_entropy()
        if v is None:
            return {}
        return {"entropy_coef": entropy_components.adaptive_update(self.state, v.params, float(measured))}

    def state_dict(self) -> dict[str, Tensor]:
        """Persistent state of stateful components (e.g. the ema baseline), for checkpoints."""
        return {k: v.clone() for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.state.clear()
        self.state.update({k: v.clone() for k, v in state.items()})


def _group_filled(x: Tensor, ok: Tensor, group_size: int) -> Tensor:
    """``x`` [B] with each row outside ``ok`` replaced by the mean of its group's rows in ``ok``
    (0 for a group with none): a failed row then moves no group statistic."""
    g = ops.group_view(torch.where(ok, x, torch.zeros_like(x)), group_size)
    cnt = ops.group_view(ok.float(), group_size).sum(-1, keepdim=True)
    fill = (g.sum(-1, keepdim=True) / cnt.clamp_min(1)).expand_as(g).reshape(-1)
    return torch.where(ok, x, fill)


def compile(algo: Algorithm, compile: bool = True, **compile_kwargs: Any) -> CompiledAlgorithm:  # noqa: A001
    """Compile a resolved algorithm. ``compile=False`` (or ``RLDSL_COMPILE=0``) keeps it eager."""
    return CompiledAlgorithm(algo, compile=compile, **compile_kwargs)
