"""``rldsl translate CONFIG``: a TRL ``GRPOConfig`` / ``DistillationConfig`` or a verl trainer YAML
(its ``distillation:`` section included) as a spec plus run-config keys.

The format is detected from the keys: a verl config nests ``algorithm:`` / ``actor_rollout_ref:``;
a TRL config is flat (``loss_type``, ``epsilon``, ...). A field that is absent takes the
peer's default (TRL 1.16, verl 0.9.1). The categorical options (TRL ``loss_type``,
``scale_rewards``; verl ``loss_mode``, ``adv_estimator``, ``loss_agg_mode``, ``kl_loss_type`` and, with
``rollout_correction.bypass_mode``, its ``loss_type``)
map through the tables below, whose rows are the ones docs/peers.md prints (a test checks
that the two agree); ``{name}`` in a row is a value of the config, named in the doc by
:data:`DOC_NAMES`.

An option that cannot be mapped exactly is a :class:`Problem` naming the option and why; the
command then exits 1, unless ``--lenient``, which prints the closest spec with each problem
as a ``# WARNING`` comment.
"""
from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from . import registry
from .config_files import read_config_file, to_toml, toml_value
from .errors import TranslateError
from .peer_keys import TRL_RUN, TRL_RUN_IF_GIVEN  # TRL field -> run key (the run config's hints read them too)
from .suggest import did_you_mean
from .registry import format_value
from .spec import library, load, loads

# ---------------------------------------------------------------------------------------
# The tables (docs/peers.md shows the same rows; tests/test_translate.py checks it)

TRL_LOSS_TYPES: dict[str, tuple[str, ...]] = {
    "grpo": ("aggregation seq_mean_token_mean(count_empty=true)",),
    "bnpo": ("aggregation token_mean",),
    "dr_grpo": ("aggregation token_sum_norm(max_tokens={max_completion_length})",),
    "dapo": ("aggregation token_mean",),
    "cispo": ("objective is_weighted", "trust_region truncate(high={cispo_high})", "aggregation token_mean"),
    "sapo": ("trust_region soft_gate(tau_pos={sapo_temperature_pos}, tau_neg={sapo_temperature_neg})",
             "aggregation seq_mean_token_mean(count_empty=true)"),
    "luspo": ("ratio sequence(clamp=80.0)", "aggregation seq_mean_token_sum(count_empty=true)"),
    "vespo": ("ratio product(clamp=20.0)", "objective is_weighted",
              "trust_region gamma_weight(k_pos={vespo_k_pos}, lambda_pos={vespo_lambda_pos}, "
              "k_neg={vespo_k_neg}, lambda_neg={vespo_lambda_neg})", "aggregation token_mean"),
}
TRL_IS_LEVELS: dict[str, tuple[str, ...]] = {  # importance_sampling_level (TRL never clamps log rho)
    "token": ("ratio token(clamp=80.0)",),
    "sequence": ("ratio sequence(clamp=80.0)",),
}
#: vllm_importance_sampling_mode -> the correction (with use_vllm); TRL does not clamp: 80 is out of reach
TRL_VLLM_IS_MODES: dict[str, str] = {
    "token_truncate": "importance(level=token{low}, high={high}, clamp=80.0)",
    "token_mask": "importance(level=token, mode=mask{low}, high={high}, clamp=80.0)",
    "sequence_truncate": "importance(level=sequence{low}, high={high}, clamp=80.0)",
    "sequence_mask": "importance(level=sequence, mode=mask{low}, high={high}, clamp=80.0)",
}
#: TRL's importance_sampling_level for one weight per sequence (a TRL option value)
TRL_SEQUENCE_LEVEL = "sequence"
VERL_IS_LEVELS = ("token", "sequence")  # algorithm.rollout_correction.rollout_is
TRL_SCALE_REWARDS: dict[str, tuple[str, ...]] = {
    "group": ("baseline group_mean", "normalizer group_std(eps=0.0001)"),
    "batch": ("baseline group_mean", "normalizer batch_std(eps=0.0001)"),
    "none": ("baseline group_mean",),
}
#: multi_objective_aggregation="normalize_then_sum" (GDPO): replaces the scale_rewards rows (TRL ignores
#: scale_rewards there); the runtime gives the spec one reward column per reward function
TRL_MULTI_OBJECTIVE: dict[str, tuple[str, ...]] = {
    "normalize_then_sum": ("baseline per_reward_group(eps=0.0001, singleton=zero, whiten=samples, whiten_eps=0.0001)", "normalizer none"),
}
VERL_LOSS_MODES: dict[str, tuple[str, ...]] = {
    "vanilla": ("trust_region dual_clip(low={clip_ratio_low}, high={clip_ratio_high}, c={clip_ratio_c})",),
    "gspo": ("ratio sequence(clamp=10.0)", "trust_region clip(low={clip_ratio_low}, high={clip_ratio_high})"),
    "sapo": ("trust_region soft_gate(tau_pos={tau_pos}, tau_neg={tau_neg})",
             "aggregation seq_mean_token_mean(count_empty=true)"),
    "gpg": ("objective reinforce",),
    "cispo": ("objective is_weighted", "trust_region truncate({cispo_low}high={clip_ratio_high})"),
    "dro": ("ratio token(clamp=80.0)", "objective dro(beta={dro_beta})", "trust_region none"),
    "dppo_tv": ("objective is_weighted",
                "trust_region tv(low={clip_ratio_low}, high={clip_ratio_high}, cap={clip_ratio_c})"),
    "dppo_kl": ("objective is_weighted",
                "trust_region kl_div(low={clip_ratio_low}, high={clip_ratio_high}, cap={clip_ratio_c})"),
    # GMPO: verl reads clip_ratio_low/high as log-space bounds; its +-20 clamp is commented out
    "geo_mean": ("ratio geo_mean(low={clip_ratio_low}, high={clip_ratio_high})", "trust_region none",
                 "aggregation seq_mean_token_mean(count_empty=true)"),
    # verl draws the dropped tokens from the global torch generator, which no config field seeds
    "clip_cov": ("ratio token(clamp=80.0)", "trust_region clip(low={clip_ratio_low}, high={clip_ratio_high})",
                 "selection clip_cov(ratio={clip_cov_ratio}, lb={clip_cov_lb}, ub={clip_cov_ub}, seed=0)"),
    "kl_cov": ("ratio token(clamp=80.0)", "objective kl_cov(ratio={kl_cov_ratio}, coef={ppo_kl_coef})"),
}
#: a choice the translation makes where verl leaves one open (printed as a ``# note:``)
VERL_LOSS_MODE_NOTES: dict[str, str] = {
    "clip_cov": "verl draws clip_cov's dropped tokens from the global torch generator (no config field seeds it); "
                "seed=0 gives the choice verl makes after torch.manual_seed(0)",
}
#: algorithm.rollout_correction.loss_type with bypass_mode: true; verl then replaces policy_loss.loss_mode
#: by its bypass loss (ppo_clip: the vanilla loss with pi_old = pi_rollout; reinforce: -sg(w) A log pi)
VERL_BYPASS_LOSS_TYPES: dict[str, tuple[str, ...]] = {
    "ppo_clip": ("trust_region dual_clip(low={clip_ratio_low}, high={clip_ratio_high}, c={clip_ratio_c})",
                 "correction bypass"),
    "reinforce": ("objective reinforce", "correction bypass"),
}
VERL_ADV_ESTIMATORS: dict[str, tuple[str, ...]] = {
    "gae": ("baseline gae(gamma={gamma}, lam={lam})", "normalizer whiten", "critic value(clip={cliprange_value})"),
    "grpo": ("baseline group_mean(singleton=reward)", "normalizer group_std(eps=1e-06)"),
    "grpo_vectorized": ("baseline group_mean(singleton=reward)", "normalizer group_std(eps=1e-06)"),
    "rloo": ("baseline leave_one_out(singleton=reward)",),
    "rloo_vectorized": ("baseline leave_one_out(singleton=zero)",),
    "reinforce_plus_plus": ("baseline return_to_go(gamma={gamma})", "normalizer whiten"),
    "reinforce_plus_plus_baseline": ("baseline group_mean(singleton=reward)", "normalizer whiten"),
    "opo": ("baseline length_weighted_mean",),
    "grpo_passk": ("baseline leave_one_out_max", "normalizer group_std(eps=1e-06)"),
    "gpg": ("baseline group_mean(singleton=reward)", "normalizer nonzero_rate(f_norm=1.0)"),
    "remax": ("baseline greedy_reward",),
    "optimal_token_baseline": ("baseline optimal_token",),
    "tir_optimal_token_baseline": ("baseline optimal_token(align=response_token)",),
    "gdpo": ("baseline per_reward_group", "normalizer none"),
}
#: the rows of estimators whose std division ``norm_adv_by_std_in_grpo: false`` turns off by a parameter
VERL_NO_STD: dict[str, tuple[str, ...]] = {
    "gdpo": ("baseline per_reward_group(std=false)", "normalizer none"),
}
GDPO_REWARDS_NOTE = ("one reward column per reward function: give the functions and their weights as the run's "
                     "reward, `--reward fn_a=W_A,fn_b=W_B` (config reward.name)")
#: estimators whose std division ``algorithm.norm_adv_by_std_in_grpo: false`` removes
VERL_STD_OPTIONAL = ("grpo", "grpo_vectorized", "grpo_passk")
VERL_AGG_MODES: dict[str, tuple[str, ...]] = {
    "token-mean": ("aggregation token_mean",),
    "token-sum": ("aggregation token_sum",),
    "seq-mean-token-sum": ("aggregation seq_mean_token_sum(count_empty=true)",),
    "seq-mean-token-mean": ("aggregation seq_mean_token_mean(count_empty=true)",),
    "seq-mean-token-sum-norm": ("aggregation token_sum_norm(max_tokens={loss_scale_factor})",),
}
_KL = "beta={kl_coef}, where={kl_where}"
VERL_KL_TYPES: dict[str, tuple[str, ...]] = {
    "kl": (f"kl k1({_KL})",), "k1": (f"kl k1({_KL})",),
    "abs": (f"kl abs({_KL})",),
    "mse": (f"kl k2({_KL})",), "k2": (f"kl k2({_KL})",),
    "low_var_kl": (f"kl k3({_KL}, clamp=true)",), "k3": (f"kl k3({_KL}, clamp=true)",),
    "k1+": (f"kl k1({_KL}, straight_through=true)",),
    "abs+": (f"kl abs({_KL}, straight_through=true)",),
    "k2+": (f"kl k2({_KL})",), "mse+": (f"kl k2({_KL})",),
    "k3+": (f"kl k3({_KL}, clamp=true, straight_through=true)",),
    "low_var_kl+": (f"kl k3({_KL}, clamp=true, straight_through=true)",),
}
#: verl distillation.distillation_loss.loss_mode -> the distill component (with its estimator)
VERL_DISTILL_MODES: dict[str, str] = {
    "kl": "reverse_kl(estimator=k1", "k1": "reverse_kl(estimator=k1",
    "abs": "reverse_kl(estimator=abs",
    "mse": "reverse_kl(estimator=k2", "k2": "reverse_kl(estimator=k2",
    "low_var_kl": "reverse_kl(estimator=k3", "k3": "reverse_kl(estimator=k3",
    "forward_kl_topk": "forward_kl_topk(k={topk}",
}
_K1_DIRECT = ("k1 minimised directly has a gradient that does not depend on the teacher (verl raises); use "
              "use_policy_gradient=true or k3")
#: loss modes verl refuses without use_policy_gradient, and why
VERL_DISTILL_PG_ONLY: dict[str, str] = {"kl": _K1_DIRECT, "k1": _K1_DIRECT}
#: verl 0.9.1's distillation.yaml (what a Hydra run gets; the dataclass defaults differ: topk 128,
#: loss_max_clamp 10, log_prob_min_clamp -10, use_policy_gradient true)
VERL_DISTILL_DEFAULTS: dict[str, Any] = {
    "loss_mode": "k3", "topk": 32, "use_task_rewards": True, "distillation_loss_coef": 1.0,
    "loss_max_clamp": None, "log_prob_min_clamp": None, "use_policy_gradient": False,
    "policy_loss_mode": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
}
#: options no spec expresses yet, and why (the doc's "not expressible" rows)
UNSUPPORTED: dict[tuple[str, str], str] = {
    ("verl", "kl_loss_type=full"): "not implemented in verl either",
}
#: how docs/peers.md names each ``{value}`` of a row
DOC_NAMES: dict[str, str] = {
    "cispo_high": "EPSILON_HIGH - 1",
    "cispo_low": "low=CLIP_RATIO_LOW, ",
    "kl_where": "loss",
}

# Defaults of the peers' own configs where a field is absent.
TRL_DEFAULTS: dict[str, Any] = {
    "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": None, "delta": None, "beta": 0.0,
    "use_bias_correction_kl": True, "importance_sampling_level": "token", "scale_rewards": "group",
    "mask_truncated_completions": False, "entropy_coef": 0.0, "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None, "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0,
    "use_vllm": False, "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_clip_max": 3.0, "use_adaptive_entropy": False,
    "entropy_coef_min": 0.0, "entropy_coef_max": 1.0, "entropy_coef_delta": 0.005, "entropy_target": 0.2,
    "multi_objective_aggregation": "sum_then_normalize",
    "num_generations": 8, "max_completion_length": 512, "temperature": 1.0, "top_p": 1.0,
    "learning_rate": 1e-6, "num_iterations": 1, "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1, "steps_per_generation": None, "generation_batch_size": None,
}
#: Fields of a TRL config (GRPOConfig, its TrainingArguments, and the ModelConfig / ScriptArguments that
#: ``trl grpo --config`` reads from the same YAML) that change neither the algorithm nor a run key: the
#: reason each group is ignored, then its fields (a name ending in ``_`` is a prefix). Never a failure.
TRL_IGNORED: dict[str, tuple[str, ...]] = {
    "checkpoints and the hub: the run folder is --out, checkpoints follow checkpoint.every": (
        "output_dir", "overwrite_output_dir", "save_", "push_to_hub", "hub_", "resume_from_checkpoint",
        "restore_callback_states_from_checkpoint"),
    "logging: rldsl writes metrics.jsonl and samples.jsonl (log.*, --tensorboard)": (
        "logging_", "log_", "run_name", "trackio_", "disable_tqdm", "wandb_",
        "num_completions_to_print", "skip_memory_metrics", "include_num_input_tokens_seen"),
    "evaluation: rldsl scores held-out prompts every eval.every steps": (
        "eval_", "do_eval", "do_predict", "do_train", "per_device_eval_batch_size", "num_generations_eval",
        "batch_eval_metrics", "prediction_loss_only", "metric_for_best_model", "greater_is_better",
        "load_best_model_at_end", "include_for_metrics", "bf16_full_eval", "fp16_full_eval",
        "dataset_test_split"),
    "data loading: the prompts come from --data (data.path), dealt in a seeded order": (
        "dataset_", "dataloader_", "remove_unused_columns", "shuffle_dataset", "length_column_name",
        "label_names", "train_sampling_strategy", "ignore_data_skip", "data_seed", "ignore_bias_buffers",
        "max_prompt_length"),
    "devices and distribution: rldsl scales with --trainers / --rollout-workers": (
        "ddp_", "fsdp", "deepspeed", "local_rank", "accelerator_config", "parallelism_config", "use_cpu",
        "average_tokens_across_devices", "ds3_gather_for_generation", "save_on_each_node", "log_on_each_node",
        "vllm_mode", "vllm_server_", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
        "vllm_enable_sleep_mode", "vllm_model_impl", "vllm_max_model_length", "vllm_group_port"),
    "speed and memory only (the same numbers): rldsl has its own switches (train.gradient_checkpointing, "
    "train.max_tokens_per_microbatch)": (
        "gradient_checkpointing_kwargs", "activation_checkpointing", "enable_jit_checkpoint", "tf32",
        "torch_compile", "use_liger_kernel", "liger_kernel_config", "use_cache", "cache_implementation",
        "torch_empty_cache_steps", "pad_to_multiple_of", "use_transformers_", "transformers_continuous_batching_",
        "auto_find_batch_size", "full_determinism", "debug", "cast_lm_head_to_fp32", "use_liger_"),
    "model loading: rldsl loads --model (model.path) with model.dtype": (
        "model_init_kwargs", "model_revision", "trust_remote_code", "attn_implementation", "load_in_",
        "bnb_", "use_bnb_nested_quant", "torch_dtype", "lora_task_type", "lora_modules_to_save",
        "lora_target_parameters", "use_rslora", "use_dora"),
    "training length in epochs: rldsl counts steps (train.steps, from max_steps)": ("num_train_epochs",),
    "an optimizer's or a schedule's extra arguments: rldsl's AdamW takes train.betas, train.eps, "
    "train.weight_decay": ("optim_args", "optim_target_modules", "lr_scheduler_kwargs"),
    "sampling options beyond temperature and top_p: the rollout samples with those two only (the completions "
    "differ, the algorithm does not)": (
        "top_k", "min_p", "repetition_penalty", "generation_kwargs", "vllm_structured_outputs_regex"),
    "not for a single-turn text task: tools, images, MoE router losses": (
        "max_tool_calling_iterations", "log_multimodal", "router_aux_loss_coef", "neftune_noise_alpha",
        "label_smoothing_factor"),
}
#: The trackers ``log.report_to`` takes (the runtime's ``records.trackers.TRACKERS``; a test checks they agree)
RUN_TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
#: Run keys whose values are text: every other run value that a YAML file gave as text and that reads
#: as a number (PyYAML reads ``1e-6``, without a dot, as a string) is written as that number
TEXT_RUN_KEYS = frozenset({"model.path", "data.path", "data.prompt_key", "model.dtype", "rollout.engine",
                           "train.lr_schedule", "log.project", "log.report_to", "eval.data",
                           "model.lora.target_modules", "data.chat_template_kwargs"})
#: TRL ``optim`` values that are the AdamW rldsl trains with (another optimizer is noted and ignored)
TRL_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_xla", "adamw_apex_fused")
#: TRL ``lr_scheduler_type`` -> ``train.lr_schedule`` (linear is TRL's default)
TRL_LR_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant",
                    "constant_with_warmup": "constant"}


# ---------------------------------------------------------------------------------------
# The result


@dataclass(frozen=True)
class Problem:
    """An option the spec does not reproduce exactly: the option and why."""

    option: str
    why: str


@dataclass
class Translation:
    peer: str                                         # "TRL" or "verl"
    lines: dict[str, list[str]] = field(default_factory=dict)  # slot -> its spec line(s)
    run: dict[str, Any] = field(default_factory=dict)  # dotted run-config key -> value
    notes: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    ignored: dict[str, list[str]] = field(default_factory=dict)  # reason -> the config's fields ignored for it

    def ignore(self, option: str, why: str) -> None:
        """An option that changes neither the algorithm nor a run key: listed, never a failure."""
        self.ignored.setdefault(why, []).append(option)

    def put(self, rows: Iterable[str], values: dict[str, Any] | None = None) -> None:
        """Set the slots of table rows (a later row replaces a slot an earlier one set)."""
        for row in rows:
            line = row.format(**{k: format_value(v) for k, v in (values or {}).items()})
            slot = line.split(" ", 1)[0]
            self.lines[slot] = [line]

    def add(self, slot: str, component: str) -> None:
        """Append to a multi-component slot (selection, correction, filter, shaping)."""
        self.lines.setdefault(slot, []).append(component)

    def problem(self, option: str, why: str) -> None:
        self.problems.append(Problem(option, why))

    def spec_text(self, name: str, source: str) -> str:
        out = [f"# translated by `rldsl translate` from {source} ({self.peer})",
               f"algorithm {name}",
               f'  "{self.peer} config {Path(source).name}, translated."']
        width = max(len(s) for s in registry.SLOTS)
        for slot in registry.SLOTS:
            entries = self.lines.get(slot)
            if not entries:
                continue
            comps = [e.split(" ", 1)[1] if e.startswith(slot + " ") else e for e in entries]
            out.append(f"  {slot:<{width}}  {', '.join(comps)}")
        return "\n".join(out) + "\n"


def _float(x: Any) -> float:
    return float(x)


# ---------------------------------------------------------------------------------------
# Reading and detecting


def read_config(path: str | Path) -> dict[str, Any]:
    """A JSON, YAML or TOML file as a dict (TranslateError otherwise); YAML unless the suffix says."""
    return read_config_file(path, error=TranslateError, default="yaml", what="config file")


def detect(cfg: dict[str, Any]) -> str:
    """"verl" when the config nests ``algorithm`` / ``actor_rollout_ref``, "TRL" when its fields are
    TRL's (dict-valued ones such as ``gradient_checkpointing_kwargs`` included) or it is flat."""
    if isinstance(cfg.get("algorithm"), dict) or isinstance(cfg.get("actor_rollout_ref"), dict):
        return "verl"
    nested = [k for k, v in cfg.items() if isinstance(v, dict)]
    if nested and not any(_trl_field_known(k) for k in cfg):
        raise TranslateError("neither a TRL GRPOConfig (its fields) nor a verl trainer config (with "
                             "`algorithm:` or `actor_rollout_ref:`): nested keys " + ", ".join(nested))
    return "TRL"


def vllm_usable() -> tuple[bool, str]:
    """(whether rldsl's vLLM engine can run where this command runs, why not)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False, "vLLM is not installed here"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA GPU here (rldsl's vLLM engine needs one)"
    return True, ""


def _engine(t: Translation, option: str) -> None:
    """The peer rolls out with vLLM: rollout.engine=vllm where it runs, else hf with a note."""
    ok, why = vllm_usable()
    t.run["rollout.engine"] = "vllm" if ok else "hf"
    if not ok:
        t.notes.append(f"{option}: {why}, so the run config says rollout.engine=hf (the same algorithm, "
                       f"slower rollouts); on a GPU machine with vLLM use --set rollout.engine=vllm")


def translate(cfg: dict[str, Any]) -> Translation:
    """The spec lines and run keys of a TRL or verl config (problems collected, never raised); a
    TRL config with ``teacher_model_name_or_path`` is a DistillationConfig."""
    if detect(cfg) == "verl":
        return _numbers(_verl(cfg))
    return _numbers(_trl_distillation(cfg) if "teacher_model_name_or_path" in cfg else _trl(cfg))


#: TRL's ``report_to`` words for no tracker and every installed one (tracker names, not components)
REPORT_TO_NONE, REPORT_TO_ALL = "none", "all"


def _report_to(t: Translation, option: str, value: Any) -> None:
    """TRL ``report_to`` / verl ``trainer.logger`` -> ``log.report_to`` (the trackers rldsl has); the
    others are listed as ignored."""
    if value is None:
        return
    names = [value] if isinstance(value, str) else list(value)
    if names in ([REPORT_TO_NONE], []):
        t.run["log.report_to"] = []
        return
    if names == [REPORT_TO_ALL]:
        names = list(RUN_TRACKERS)
    keep = [n for n in names if n in RUN_TRACKERS]
    for n in names:
        if n == "console":
            t.ignore(f"{option}={n}", "rldsl prints its own progress and writes metrics.jsonl")
        elif n not in RUN_TRACKERS:
            t.ignore(f"{option}={n}", f"log.report_to takes {', '.join(RUN_TRACKERS)}")
    t.run["log.report_to"] = keep


def _number_text(value: Any) -> Any:
    """``"1e-6"`` -> ``1e-06``, ``"8"`` -> ``8``, a list elementwise; anything else as it is."""
    if isinstance(value, list):
        return [_number_text(v) for v in value]
    if not isinstance(value, str) or not re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", value.strip()):
        return value
    text = value.strip()
    return int(text) if re.fullmatch(r"[+-]?\d+", text) else float(text)


def _numbers(t: Translation) -> Translation:
    """Every numeric run value written as a number (YAML gives ``1e-6`` as text)."""
    t.run = {k: v if k in TEXT_RUN_KEYS else _number_text(v) for k, v in t.run.items()}
    return t


# ---------------------------------------------------------------------------------------
# TRL GRPOConfig

_TRL_LOSS_KEYS = set(TRL_DEFAULTS) | {"sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
                                     "reward_weights"}
#: fields carried into run keys by _trl_run (not the algorithm)
_TRL_CARRIED = {"adam_beta1", "adam_beta2", "lr_scheduler_type", "bf16", "fp16", "dtype", "seed", "optim",
                "model_name_or_path", "warmup_ratio", "chat_template_kwargs", "use_peft", "lora_r", "lora_alpha",
                "lora_dropout", "lora_target_modules", "dataset_name", "report_to", "project"}


def _trl_ignored_reason(name: str) -> str | None:
    """The reason a TRL field is ignored (TRL_IGNORED), or None (a field carried into a run key)."""
    if name in _TRL_CARRIED:
        return None
    for why, names in TRL_IGNORED.items():
        if any(name == n or name.startswith(n if n.endswith("_") else n + "_") for n in names):
            return why
    return None


def _trl_field_known(name: str) -> bool:
    return (name in _TRL_LOSS_KEYS or name in TRL_RUN_IF_GIVEN or name in _TRL_CARRIED or name in TRL_RUN
            or _trl_ignored_reason(name) is not None)


def _shown(value: Any) -> str:
    """A config value as a note shows it (dicts and long values cut)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _trl(cfg: dict[str, Any]) -> Translation:
    t = Translation("TRL")
    c = {**TRL_DEFAULTS, **cfg}
    for k in cfg:
        why = _trl_ignored_reason(k)
        if why is not None:
            t.ignore(f"{k}={_shown(cfg[k])}", why)
        elif not _trl_field_known(k):
            hint = did_you_mean(k, _TRL_LOSS_KEYS)
            if hint:  # perhaps a misspelt algorithm option: never guessed
                t.problem(k, f"not a TRL 1.16 field; {hint}")
            else:
                t.ignore(k, "not a field of TRL 1.16's GRPOConfig, ModelConfig or ScriptArguments "
                            "(check its spelling)")
    loss_type = c["loss_type"]
    eps = _float(c["epsilon"])
    eps_high = _float(c["epsilon_high"]) if c["epsilon_high"] is not None else eps
    v: dict[str, Any] = {
        "epsilon": eps, "epsilon_high": eps_high, "cispo_high": round(eps_high - 1, 12),
        "max_completion_length": int(c["max_completion_length"]),
        **{k: _float(c[k]) for k in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                                     "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}}
    t.put(["objective ppo"])
    level = c["importance_sampling_level"]
    if level in TRL_IS_LEVELS:
        t.put(TRL_IS_LEVELS[level])
    else:
        t.problem("importance_sampling_level", f"{level!r} is not one of {', '.join(TRL_IS_LEVELS)}")
    scale = {True: "group", False: "none"}.get(c["scale_rewards"], c["scale_rewards"]) \
        if isinstance(c["scale_rewards"], bool) else c["scale_rewards"]
    if scale in TRL_SCALE_REWARDS:
        t.put(TRL_SCALE_REWARDS[scale])
    else:
        t.problem("scale_rewards", f"{scale!r} is not one of {', '.join(TRL_SCALE_REWARDS)}")
    if loss_type not in TRL_LOSS_TYPES:
        t.problem("loss_type", f"{loss_type!r} is not a TRL 1.16 loss_type ({', '.join(TRL_LOSS_TYPES)})")
    else:
        rows = TRL_LOSS_TYPES[loss_type]
        if not any(r.startswith("trust_region") for r in rows):
            delta = c["delta"]
            if delta is None:
                t.put(["trust_region clip(low={epsilon}, high={epsilon_high})"], v)
            elif _float(delta) <= 1:
                t.problem("delta", f"delta={delta}: the INTELLECT-2 cap on rho must exceed 1")
            else:
                d = _float(delta)
                t.put([f"trust_region dual_clip(low={format_value(eps)}, high={format_value(round(min(eps_high, d - 1), 12))}, "
                       f"c={format_value(max(d, round(1 + eps_high, 12)))})"])
        elif c["delta"] is not None:
            t.problem("delta", f"TRL applies delta to the clipped losses only, not to loss_type={loss_type!r}")
        t.put(rows, v)
        if loss_type == "luspo" and level in TRL_IS_LEVELS:  # its row assumes the sequence level LUSPO is run with
            t.put(TRL_IS_LEVELS[level])
    if _float(c["beta"]) and c["use_bias_correction_kl"] and (level == TRL_SEQUENCE_LEVEL or loss_type == "vespo"):
        t.problem("use_bias_correction_kl",
                  "TRL weights the KL by its importance weight exp(log-ratio at importance_sampling_level) and "
                  "differentiates through it; the spec's ratio-weighted KL takes the ratio slot's "
                  + ("sequence ratio, whose per-token gradient differs from TRL's (the losses agree, the gradients "
                     "do not)" if loss_type != "vespo" else "sequence product (VESPO), not the token ratio")
                  + "; use_bias_correction_kl: false translates exactly")
    beta = _float(c["beta"])
    if beta:
        rw = ", ratio_weighted=true" if c["use_bias_correction_kl"] else ""
        t.put([f"kl k3(beta={format_value(beta)}, where=loss{rw})"])
    if c["mask_truncated_completions"]:
        t.add("filter", "overlong")
    if c["use_adaptive_entropy"] is True:
        t.put([f"entropy adaptive(init={format_value(_float(c['entropy_coef']))}, "
               + ", ".join(f"{k}={format_value(_float(c[f]))}" for k, f in (
                   ("min", "entropy_coef_min"), ("max", "entropy_coef_max"), ("delta", "entropy_coef_delta"),
                   ("target", "entropy_target"))) + ")"])
    elif _float(c["entropy_coef"]):
        t.put([f"entropy bonus(coef={format_value(_float(c['entropy_coef']))})"])
    bonus = c["use_adaptive_entropy"] is True or _float(c["entropy_coef"])
    if bonus and t.lines.get("aggregation") != ["aggregation token_mean"]:
        t.problem("entropy_coef", "TRL's entropy bonus is a token mean whatever the loss_type; the spec's "
                                  "bonus is aggregated like the loss, equal only with aggregation token_mean")
    q = _float(c["top_entropy_quantile"])
    if q < 1:
        t.add("selection", f"top_entropy(quantile={format_value(q)})")
        if _float(c["entropy_coef"]):
            t.problem("top_entropy_quantile", "TRL also restricts the entropy bonus to the kept tokens")
    if c["off_policy_mask_threshold"] is not None:
        t.add("selection", f"off_policy_sequence(threshold={format_value(_float(c['off_policy_mask_threshold']))})")
    if c["use_vllm"]:
        _engine(t, "use_vllm=true")
        if c["vllm_importance_sampling_correction"] and loss_type == "vespo":
            t.problem("vllm_importance_sampling_correction",
                      "with loss_type=vespo TRL folds the vLLM importance weight into the sequence ratio inside "
                      "VESPO's gamma weight, phi(w * IS); a correction slot multiplies outside it, phi(w) * IS, "
                      "which differs, and no spec reproduces phi(w * IS) yet (vllm_importance_sampling_correction: "
                      "false, or use_vllm: false, translates)")
        elif c["vllm_importance_sampling_correction"]:
            mode = c["vllm_importance_sampling_mode"]
            if mode not in TRL_VLLM_IS_MODES:
                t.problem("vllm_importance_sampling_mode", f"{mode!r} is not one of {', '.join(TRL_VLLM_IS_MODES)}")
            else:
                lo = c["vllm_importance_sampling_clip_min"]
                t.add("correction", TRL_VLLM_IS_MODES[mode].format(
                    low=f", low={format_value(_float(lo))}" if lo is not None else "",
                    high=format_value(_float(c["vllm_importance_sampling_clip_max"]))))
    else:
        t.notes.append("use_vllm is false: TRL's vLLM importance-sampling correction does not apply")
    agg = c["multi_objective_aggregation"]
    if agg in TRL_MULTI_OBJECTIVE:
        t.put(TRL_MULTI_OBJECTIVE[agg])
        t.notes.append(f"multi_objective_aggregation={agg} (GDPO): TRL ignores scale_rewards here; "
                       + GDPO_REWARDS_NOTE)
    elif agg != "sum_then_normalize":
        t.problem("multi_objective_aggregation", f"{agg!r} is not one of sum_then_normalize, "
                                                 f"{', '.join(TRL_MULTI_OBJECTIVE)}")
    if cfg.get("reward_weights") not in (None, []):
        t.notes.append(f"reward_weights {cfg['reward_weights']}: the weights of the run's reward functions, "
                       "`--reward fn_a=W_A,fn_b=W_B` in their order")
    if cfg.get("sync_ref_model"):
        t.problem("sync_ref_model", "the reference model is fixed; a periodically synced reference is not supported")
    # run config
    for k, key in TRL_RUN.items():
        t.run[key] = c[k]
    for k, key in TRL_RUN_IF_GIVEN.items():
        if k in cfg and not (k == "max_steps" and cfg[k] in (-1, None)):
            t.run[key] = cfg[k]
    if "adam_beta1" in cfg or "adam_beta2" in cfg:
        t.run["train.betas"] = [cfg.get("adam_beta1", 0.9), cfg.get("adam_beta2", 0.999)]
    if cfg.get("bf16"):
        t.run["model.dtype"] = "bfloat16"
    elif cfg.get("fp16"):
        t.run["model.dtype"] = "float16"
    elif cfg.get("dtype") in ("bfloat16", "float16", "float32"):
        t.run["model.dtype"] = cfg["dtype"]
    elif "dtype" in cfg:
        t.ignore(f"dtype={cfg['dtype']}", "model loading: rldsl loads --model (model.path) with model.dtype")
    if "seed" in cfg:
        t.run["seed"] = cfg["seed"]
    if cfg.get("model_name_or_path"):
        t.run["model.path"] = cfg["model_name_or_path"]
    if isinstance(cfg.get("chat_template_kwargs"), dict):
        t.run["data.chat_template_kwargs"] = cfg["chat_template_kwargs"]
    if cfg.get("dataset_name"):
        t.run["data.path"] = cfg["dataset_name"]
        t.notes.append(f"dataset_name {cfg['dataset_name']} -> data.path: rldsl reads a local .jsonl / .json / "
                       ".parquet file or a datasets folder (save_to_disk); a hub dataset must be saved to one first "
                       "(its prompt and answer columns: data.prompt_key, data.answer_key)")
    _report_to(t, "report_to", cfg.get("report_to"))
    if cfg.get("project"):
        t.run["log.project"] = cfg["project"]
    _trl_lora(cfg, t)
    optim = cfg.get("optim", "adamw_torch_fused")
    if optim not in TRL_ADAMW:
        t.ignore(f"optim={optim}", "rldsl trains with AdamW (train.betas, train.eps, train.weight_decay)")
    sched = cfg.get("lr_scheduler_type", "linear")  # TRL's default
    if sched in TRL_LR_SCHEDULES:
        t.run["train.lr_schedule"] = TRL_LR_SCHEDULES[sched]
    else:
        t.ignore(f"lr_scheduler_type={sched}", "train.lr_schedule is constant, linear or cosine: choose the "
                                              "closest by hand (the run keeps its constant default)")
    _trl_warmup(cfg, t)
    n = int(c["num_generations"])
    ga = int(c["gradient_accumulation_steps"])
    spg = int(c["steps_per_generation"] or ga)
    gen = int(c["generation_batch_size"] or int(c["per_device_train_batch_size"]) * spg)
    if gen % n or spg % ga:
        t.problem("generation_batch_size", f"{gen} completions per generation is not whole groups of "
                                           f"{n}, or steps_per_generation {spg} is not a multiple of "
                                           f"gradient_accumulation_steps {ga}")
    else:
        t.run["rollout.prompts_per_step"] = gen // n
        t.run["train.minibatches"] = spg // ga
        t.notes.append("prompts per step and minibatches assume one process (per_device_train_batch_size x "
                       "steps_per_generation completions per generation)")
    return t


def _trl_lora(cfg: dict[str, Any], t: Translation) -> None:
    """TRL's ModelConfig LoRA fields (with ``use_peft: true``) -> model.lora.* (ModelConfig's defaults)."""
    lora = [k for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules") if k in cfg]
    if not cfg.get("use_peft"):
        for k in lora:
            t.ignore(k, "LoRA options without use_peft: true (TRL ignores them too)")
        return
    t.run["model.lora.rank"] = int(cfg.get("lora_r", 16))
    t.run["model.lora.alpha"] = float(cfg.get("lora_alpha", 32))
    t.run["model.lora.dropout"] = float(cfg.get("lora_dropout", 0.05))
    targets = cfg.get("lora_target_modules")
    if targets is not None:
        t.run["model.lora.target_modules"] = [targets] if isinstance(targets, str) else list(targets)
    else:
        t.notes.append("use_peft without lora_target_modules: PEFT picks the architecture's default modules, "
                       "rldsl's model.lora.target_modules default is all-linear")


def _trl_warmup(cfg: dict[str, Any], t: Translation) -> None:
    """``warmup_ratio`` (or a ``warmup_steps`` below 1, which transformers 5 reads as a ratio) of
    ``max_steps`` -> train.warmup_steps = ceil(ratio * max_steps), as transformers counts it."""
    ratio = cfg.get("warmup_ratio")
    steps = cfg.get("warmup_steps")
    if isinstance(steps, float) and 0 < steps < 1:  # transformers 5: a fraction of the steps
        ratio = steps
        t.run.pop("train.warmup_steps", None)
    elif steps is not None:
        t.run["train.warmup_steps"] = int(steps)
        if int(steps) > 0:
            return  # transformers: warmup_steps > 0 wins over warmup_ratio
    if not ratio:
        return
    total = cfg.get("max_steps")
    if total is None or int(total) <= 0:
        t.ignore(f"warmup_ratio={ratio}", "a warm-up ratio needs max_steps to become train.warmup_steps: set "
                                          "max_steps, or --set train.warmup_steps=N")
        return
    t.run["train.warmup_steps"] = math.ceil(float(ratio) * int(total))


# ---------------------------------------------------------------------------------------
# verl trainer YAML


def _get(cfg: dict[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return default if node is None and default is not None else node


VERL_DEFAULTS: dict[str, Any] = {  # verl 0.9.1 (AlgoConfig, ActorConfig, PolicyLossConfig)
    "algorithm.adv_estimator": "gae", "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean", "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "algorithm.kl_penalty": "kl",
}
_VERL_ALGO_KNOWN = {"adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty",
                    "gdpo_reward_keys", "gdpo_reward_weights",
                    "kl_ctrl", "filter_groups", "rollout_correction", "_target_", "use_pf_ppo", "pf_ppo"}


#: Why a verl config's keys that no rule reads are ignored, by the longest prefix that matches
VERL_IGNORED: dict[str, str] = {
    "trainer.": "trainer bookkeeping (devices, nodes, logging, checkpoints, validation files): rldsl's flags and "
                "run keys (--out, --trainers, --rollout-workers, log.*, checkpoint.*)",
    "actor_rollout_ref.rollout.": "rollout engine tuning (memory, parallelism, batching, sampling extras): the same "
                                  "samples; rldsl's engine settings are rollout.vllm.*",
    "actor_rollout_ref.actor.": "actor memory and parallelism (micro-batches, FSDP, offload, checkpoint contents): the "
                                "same update; rldsl's are train.max_tokens_per_microbatch and --trainers",
    "actor_rollout_ref.ref.": "reference-model memory and parallelism: the same reference logprobs",
    "actor_rollout_ref.model.": "model loading: rldsl loads model.path with model.dtype",
    "actor_rollout_ref.": "worker layout: the same algorithm",
    "critic.": "critic memory and parallelism: the same value model (its learning rate is train.critic_lr)",
    "data.": "data loading: rldsl reads data.path (data.prompt_key, data.answer_key), dealt in a seeded order",
    "reward_model.": "the reward: give it with --reward (a function, http://... server, judge:URL or rm:PATH)",
    "custom_reward_function.": "the reward: give it with --reward (module:function or path/to/file.py:function)",
    "ray_kwargs.": "Ray: rldsl starts or joins one with --ray-address (distributed.*)",
    "ray_init.": "Ray: rldsl starts or joins one with --ray-address (distributed.*)",
    "distillation.": "the teacher's resources and routing (GPUs, nodes, teacher_key): the teacher runs in the "
                     "trainer's process (teacher.path)",
    "distillation.teacher_models.": "teacher serving (inference engine, parallelism, memory, replicas): the "
                                    "teacher runs in the trainer's process (teacher.path)",
}


def _leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every non-table value of a nested config by its dotted key (hydra's ``_target_`` markers left out)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        elif k != "_target_":
            out[f"{prefix}{k}"] = v
    return out


def _verl_ignored_reason(key: str) -> str:
    best = max((p for p in VERL_IGNORED if key.startswith(p)), key=len, default=None)
    return VERL_IGNORED[best] if best else "not used by this translation"


def _verl(cfg: dict[str, Any]) -> Translation:
    """The spec and run keys of a verl config; every key no rule read is listed as ignored."""
    read: set[str] = set()

    def get(key: str, default: Any = None) -> Any:
        read.add(key)
        return _get(cfg, key, default)

    t = _verl_rules(cfg, get)
    for key, value in _leaves(cfg).items():
        if key not in read and not key.startswith("algorithm."):  # unknown algorithm keys are problems
            t.ignore(f"{key}={_shown(value)}", _verl_ignored_reason(key))
    return t


def _verl_rules(cfg: dict[str, Any], get: Any) -> Translation:
    t = Translation("verl")
    a = "actor_rollout_ref.actor."
    for k in (get("algorithm") or {}):
        if k not in _VERL_ALGO_KNOWN:
            t.problem(f"algorithm.{k}", "not an algorithm option this translation knows")
    low = get(a + "clip_ratio_low", get(a + "clip_ratio", 0.2))
    high = get(a + "clip_ratio_high", get(a + "clip_ratio", 0.2))
    v: dict[str, Any] = {
        "clip_ratio_low": _float(low), "clip_ratio_high": _float(high),
        "clip_ratio_c": _float(get(a + "clip_ratio_c", 3.0)),
        "tau_pos": _float(get(a + "tau_pos", 1.0)), "tau_neg": _float(get(a + "tau_neg", 1.05)),
        "gamma": _float(get("algorithm.gamma", 1.0)), "lam": _float(get("algorithm.lam", 1.0)),
        "cliprange_value": _float(get("critic.cliprange_value", 0.5)),
        "cispo_low": "" if _float(low) >= 1 else f"low={format_value(_float(low))}, ",
        "clip_cov_ratio": _float(get(a + "policy_loss.clip_cov_ratio", 0.0002)),
        "clip_cov_lb": _float(get(a + "policy_loss.clip_cov_lb", 1.0)),
        "clip_cov_ub": _float(get(a + "policy_loss.clip_cov_ub", 5.0)),
        "kl_cov_ratio": _float(get(a + "policy_loss.kl_cov_ratio", 0.0002)),
        # 0.1 in verl's actor config; an explicit null takes compute_policy_loss_kl_cov's own fallback 1.0
        "ppo_kl_coef": _float(get(a + "policy_loss.ppo_kl_coef", 1.0 if "ppo_kl_coef" in (get(a + "policy_loss")
                                                                                       or {}) else 0.1)),
    }
    t.put(["objective ppo"])
    adv = get("algorithm.adv_estimator", VERL_DEFAULTS["algorithm.adv_estimator"])
    if adv in VERL_ADV_ESTIMATORS:
        rows = VERL_ADV_ESTIMATORS[adv]
        if adv in VERL_STD_OPTIONAL and not get("algorithm.norm_adv_by_std_in_grpo", True):
            rows = tuple(r for r in rows if not r.startswith("normalizer"))
        if adv in VERL_NO_STD and not get("algorithm.norm_adv_by_std_in_grpo", True):
            rows = VERL_NO_STD[adv]
        t.put(rows, v)
        if adv in VERL_NO_STD:
            keys, weights = get("algorithm.gdpo_reward_keys"), get("algorithm.gdpo_reward_weights")
            t.notes.append(f"adv_estimator={adv}: gdpo_reward_keys {keys}, gdpo_reward_weights {weights}: "
                           + GDPO_REWARDS_NOTE)
    else:
        why = UNSUPPORTED.get(("verl", f"adv_estimator={adv}"), "not a verl 0.9.1 adv_estimator")
        t.problem("algorithm.adv_estimator", f"{adv!r}: {why}")
    agg = get(a + "loss_agg_mode", VERL_DEFAULTS[a + "loss_agg_mode"])
    if agg in VERL_AGG_MODES:
        lsf = get(a + "loss_scale_factor")
        if agg == "seq-mean-token-sum-norm" and lsf is None:
            lsf = get("data.max_response_length", 512)
            t.problem(a + "loss_scale_factor", "null: verl divides by the padded length of each micro-batch, "
                                               "which varies with the padding; set it (Dr. GRPO: "
                                               "max_response_length, used here)")
        t.put(VERL_AGG_MODES[agg], {"loss_scale_factor": int(lsf) if lsf is not None else 0})
    else:
        t.problem(a + "loss_agg_mode", f"{agg!r} is not one of {', '.join(VERL_AGG_MODES)}")
    mode = get(a + "policy_loss.loss_mode", VERL_DEFAULTS[a + "policy_loss.loss_mode"])
    rc = "algorithm.rollout_correction."
    bypass = bool(get(rc + "bypass_mode", False))
    loss_type = get(rc + "loss_type", "ppo_clip")
    if bypass:  # verl's apply_bypass_mode sets policy_loss.loss_mode = "bypass_mode", whatever it was
        if mode != "vanilla":
            t.notes.append(f"loss_mode={mode} is ignored: with rollout_correction.bypass_mode verl uses its bypass "
                           f"loss (loss_type={loss_type})")
        if loss_type in VERL_BYPASS_LOSS_TYPES:
            t.put(VERL_BYPASS_LOSS_TYPES[loss_type], v)
        else:
            t.problem(rc + "loss_type", f"{loss_type!r} is not one of {', '.join(VERL_BYPASS_LOSS_TYPES)}")
    elif mode in VERL_LOSS_MODES:
        if any("{dro_beta}" in r for r in VERL_LOSS_MODES[mode]) and get(a + "policy_loss.dro_beta") is None:
            t.problem(a + "policy_loss.dro_beta", f"loss_mode={mode} needs dro_beta (verl raises without it)")
        v["dro_beta"] = _float(get(a + "policy_loss.dro_beta", 0.05))
        t.put(VERL_LOSS_MODES[mode], v)
        if mode in VERL_LOSS_MODE_NOTES:
            t.notes.append(VERL_LOSS_MODE_NOTES[mode])
    else:
        why = UNSUPPORTED.get(("verl", f"loss_mode={mode}"), "not a verl 0.9.1 loss_mode")
        if mode == "bypass_mode":
            why = ("verl sets it itself from algorithm.rollout_correction.bypass_mode: true (and raises without "
                   "that section); set that instead")
        t.problem(a + "policy_loss.loss_mode", f"{mode!r}: {why}")
    in_loss, in_reward = bool(get(a + "use_kl_loss", False)), bool(get("algorithm.use_kl_in_reward", False))
    if in_loss and in_reward:
        t.problem("algorithm.use_kl_in_reward", "a KL both in the reward and in the loss: the kl slot holds one "
                                                "(verl itself prints a notice for this combination)")
    for on, where, typ, coef in ((in_loss, "loss", get(a + "kl_loss_type", VERL_DEFAULTS[a + "kl_loss_type"]),
                                  get(a + "kl_loss_coef", 0.001)),
                                 (in_reward and not in_loss, "reward",
                                  get("algorithm.kl_penalty", VERL_DEFAULTS["algorithm.kl_penalty"]),
                                  get("algorithm.kl_ctrl.kl_coef", 0.001))):
        if not on:
            continue
        if typ in VERL_KL_TYPES:
            t.put(VERL_KL_TYPES[typ], {"kl_coef": _float(coef), "kl_where": where})
        else:
            why = UNSUPPORTED.get(("verl", f"kl_loss_type={typ}"), "not a verl KL estimator")
            t.problem(a + "kl_loss_type" if where == "loss" else "algorithm.kl_penalty", f"{typ!r}: {why}")
        if where == "reward" and get("algorithm.kl_ctrl.type", "fixed") != "fixed":
            t.problem("algorithm.kl_ctrl.type", "an adaptive KL coefficient is state across steps; beta is fixed")
    ent = _float(get(a + "entropy_coeff", 0.0))
    if ent:
        t.put([f"entropy bonus(coef={format_value(ent)})"])
    level = get(rc + "rollout_is")
    if level is not None and bypass and loss_type == "ppo_clip":
        t.notes.append(f"rollout_is={level}: with bypass_mode and loss_type=ppo_clip verl computes the IS weights "
                       "for its metrics only (the PPO ratio already is pi_theta / pi_rollout): no importance line")
    elif level is not None:
        thr = get(rc + "rollout_is_threshold", 2.0)
        norm = ", normalize=true" if get(rc + "rollout_is_batch_normalize", False) else ""
        if level not in VERL_IS_LEVELS:
            t.problem(rc + "rollout_is", f"{level!r} is not one of {', '.join(VERL_IS_LEVELS)}")
        elif isinstance(thr, str) and "_" in thr:
            lo_, hi_ = thr.split("_", 1)
            t.add("correction", f"importance(level={level}, mode=mask, low={format_value(float(lo_))}, "
                                f"high={format_value(float(hi_))}{norm})")
        else:
            t.add("correction", f"importance(level={level}, high={format_value(float(thr))}{norm})")
    stat = get(rc + "rollout_rs")
    if stat is not None:
        thr = get(rc + "rollout_rs_threshold")
        stats = registry.REGISTRY["correction"]
        choices = next((p.choices for c_ in stats.values() for k, p in c_.params.items() if k == "stat"), ())
        if stat not in choices:
            t.problem(rc + "rollout_rs", f"{stat!r} is not one statistic of {', '.join(choices)}")
        elif thr is None:
            t.problem(rc + "rollout_rs_threshold", "rejection without a threshold")
        elif isinstance(thr, str) and "_" in thr:
            lo_, hi_ = thr.split("_", 1)
            t.add("correction", f"reject(stat={stat}, low={format_value(float(lo_))}, high={format_value(float(hi_))})")
        else:
            t.add("correction", f"reject(stat={stat}, high={format_value(float(thr))})")
    if get("algorithm.filter_groups.enable", False):
        rounds = int(get("algorithm.filter_groups.max_num_gen_batches", 0))
        if rounds <= 0:
            t.problem("algorithm.filter_groups.max_num_gen_batches", "0 = no limit; dynamic sampling needs a cap "
                                                                    "(the DAPO recipe: 10, used here)")
            rounds = 10
        t.put([f"sampling dynamic(max_rounds={rounds})"])
        if get("algorithm.filter_groups.metric") not in (None, "seq_reward", "score", "seq_final_reward"):
            t.notes.append(f"filter_groups.metric={get('algorithm.filter_groups.metric')}: dynamic sampling here "
                           "reads the reward itself")
    if get("reward_model.overlong_buffer.enable", False):
        t.add("shaping", f"overlong_penalty(max_len={int(get('data.max_response_length', 512))}, "
                         f"cache={int(get('reward_model.overlong_buffer.len', 0))}, "
                         f"factor={format_value(_float(get('reward_model.overlong_buffer.penalty_factor', 1.0)))})")
    if get("algorithm.use_pf_ppo", False):
        t.problem("algorithm.use_pf_ppo", "PF-PPO's reward-weighted resampling of the batch is not supported")
    if get("distillation.enabled", False):
        _verl_distillation(get, t)
    # run config
    n = int(get("actor_rollout_ref.rollout.n", 1))
    t.run["rollout.n"] = n
    t.run["rollout.max_new_tokens"] = int(get("data.max_response_length", 512))
    t.run["rollout.temperature"] = get("actor_rollout_ref.rollout.temperature", 1.0)
    t.run["rollout.top_p"] = get("actor_rollout_ref.rollout.top_p", 1.0)
    if get("actor_rollout_ref.rollout.top_k", -1) not in (-1, 0, None):
        t.problem("actor_rollout_ref.rollout.top_k", "the rollout samples with temperature and top_p only")
    t.run["train.lr"] = get(a + "optim.lr", 1e-6)
    t.run["train.weight_decay"] = get(a + "optim.weight_decay", 0.01)
    t.run["train.ppo_epochs"] = int(get(a + "ppo_epochs", 1))
    t.run["train.grad_clip"] = get(a + "grad_clip", 1.0)
    tbs, mini = int(get("data.train_batch_size", 1024)), int(get(a + "ppo_mini_batch_size", 256))
    t.run["rollout.prompts_per_step"] = tbs
    if tbs % mini:
        t.problem(a + "ppo_mini_batch_size", f"{mini} does not divide data.train_batch_size {tbs}")
    else:
        t.run["train.minibatches"] = tbs // mini
    if get("trainer.total_training_steps") is not None:
        t.run["train.steps"] = int(get("trainer.total_training_steps"))
    warm = get(a + "optim.lr_warmup_steps", -1)
    if warm is not None and int(warm) > 0:
        t.run["train.warmup_steps"] = int(warm)
    if "critic" in t.lines and get("critic.optim.lr") is not None:  # the spec has a value model
        t.run["train.critic_lr"] = get("critic.optim.lr")
    if get("actor_rollout_ref.model.enable_gradient_checkpointing") is not None:
        t.run["train.gradient_checkpointing"] = bool(get("actor_rollout_ref.model.enable_gradient_checkpointing"))
    if int(get("actor_rollout_ref.model.lora_rank", 0) or 0) > 0:
        t.run["model.lora.rank"] = int(get("actor_rollout_ref.model.lora_rank"))
        t.run["model.lora.alpha"] = get("actor_rollout_ref.model.lora_alpha", 16)
    if get("actor_rollout_ref.model.path"):
        t.run["model.path"] = get("actor_rollout_ref.model.path")
    _verl_files(t, get)
    if get("data.prompt_key") is not None:
        t.run["data.prompt_key"] = get("data.prompt_key")
    _report_to(t, "trainer.logger", get("trainer.logger"))
    if get("trainer.project_name"):
        t.run["log.project"] = get("trainer.project_name")
    freq = get("trainer.test_freq")
    if freq is not None:  # verl: -1 = never
        t.run["eval.every"] = max(int(freq), 0)
    save = get("trainer.save_freq")
    if save is not None and int(save) > 0:
        t.run["checkpoint.every"] = int(save)
    engine = get("actor_rollout_ref.rollout.name", "vllm")
    if engine == "vllm":
        _engine(t, "actor_rollout_ref.rollout.name=vllm")
    elif engine == "hf":
        t.run["rollout.engine"] = "hf"
    else:
        _engine(t, f"actor_rollout_ref.rollout.name={engine}")
        t.notes.append(f"actor_rollout_ref.rollout.name={engine}: rldsl's engines are hf and vllm; the rollout "
                       "engine changes speed, not the algorithm")
    return t


def _verl_files(t: Translation, get: Any) -> None:
    """``data.train_files`` -> ``data.path`` (one file: rldsl reads one), ``data.val_files`` -> ``eval.data``."""
    train = get("data.train_files")
    files = [train] if isinstance(train, str) else list(train or [])
    if len(files) == 1:
        t.run["data.path"] = files[0]
    elif files:
        t.ignore(f"data.train_files={_shown(files)}", f"rldsl reads one data file (data.path): join the {len(files)} "
                                                     "files into one and give it with --data")
    val = get("data.val_files")
    vals = [val] if isinstance(val, str) else list(val or [])
    if vals:
        t.run["eval.data"] = vals
    if files or vals:
        t.notes.append("verl's parquet rows keep the answer in reward_model.ground_truth: give rldsl a column with it "
                       "(data.answer_key) and the prompt's column (data.prompt_key)")


def _verl_distillation(get: Any, t: Translation) -> None:
    """verl's ``distillation:`` section: the distill slot's line and teacher.path."""
    d = "distillation.distillation_loss."
    o = {k: get(d + k, v) for k, v in VERL_DISTILL_DEFAULTS.items()}
    for k in (get("distillation.distillation_loss") or {}):
        if k not in VERL_DISTILL_DEFAULTS and k not in ("_target_", "use_chunked_topk", "chunked_topk_chunk_size"):
            t.problem(d + k, "not a verl 0.9.1 distillation loss option this translation knows")
    mode = o["loss_mode"]
    if mode not in VERL_DISTILL_MODES:
        t.problem(d + "loss_mode", f"{mode!r} is not one of {', '.join(VERL_DISTILL_MODES)}")
        return
    if o["policy_loss_mode"] != "vanilla":
        t.problem(d + "policy_loss_mode", "verl 0.9.1 raises for anything but vanilla")
    pg, task = bool(o["use_policy_gradient"]), bool(o["use_task_rewards"])
    if not pg and mode in VERL_DISTILL_PG_ONLY:
        t.problem(d + "loss_mode", VERL_DISTILL_PG_ONLY[mode])
    coef = _float(o["distillation_loss_coef"])
    if not task and coef != 1.0:
        t.notes.append(f"distillation_loss_coef={format_value(coef)} is ignored without use_task_rewards (verl uses 1)")
        coef = 1.0
    args = [VERL_DISTILL_MODES[mode].format(topk=int(o["topk"] or 32))]
    if "{topk}" in VERL_DISTILL_MODES[mode] and o["log_prob_min_clamp"] is not None:  # the top-k divergence
        args.append(f"log_prob_min_clamp={format_value(_float(o['log_prob_min_clamp']))}")
    args += [f"mode={'policy_gradient' if pg else 'supervised'}", f"coef={format_value(coef)}",
             f"task={format_value(task)}"]
    if o["loss_max_clamp"] is not None:
        args.append(f"max_clamp={format_value(_float(o['loss_max_clamp']))}")
    if pg:
        args += [f"clip_low={format_value(_float(o['clip_ratio_low']))}",
                 f"clip_high={format_value(_float(o['clip_ratio_high']))}"]
    t.put(["distill " + ", ".join(args) + ")"])
    teachers = get("distillation.teacher_models") or {}
    paths = [get(f"distillation.teacher_models.{name}.model_path") for name in teachers]
    paths = [p for p in paths if p]
    if len(paths) > 1:
        t.problem("distillation.teacher_models", "several teachers routed by teacher_key: one teacher per run")
    elif paths:
        t.run["teacher.path"] = paths[0]
    else:
        t.notes.append("distillation: no teacher_models.*.model_path: give teacher.path in the run config")
    for k in ("use_chunked_topk", "chunked_topk_chunk_size"):
        if get(d + k) is not None:
            t.ignore(f"{d}{k}={_shown(get(d + k))}", "speed and memory only (the same numbers)")


# ---------------------------------------------------------------------------------------
# TRL DistillationConfig

#: TRL 1.16 DistillationConfig fields that change the algorithm or the run (the others are the
#: training loop's, ignored and listed)
TRL_DISTILL_DEFAULTS: dict[str, Any] = {"beta": 1.0, "temperature": 1.0, "max_completion_length": 512,
                                        "learning_rate": 1e-6, "top_p": 1.0, "top_k": 0}


def _trl_distillation(cfg: dict[str, Any]) -> Translation:
    """TRL's DistillationTrainer: the generalized JSD over the vocabulary on the student's own
    samples, minimised directly, mean over the completion tokens; one completion per prompt."""
    t = Translation("TRL")
    c = {**TRL_DISTILL_DEFAULTS, **cfg}
    for k in cfg:
        if k not in TRL_DISTILL_DEFAULTS and k != "teacher_model_name_or_path":
            t.ignore(f"{k}={_shown(cfg[k])}", "a training-loop setting of TRL's DistillationConfig, not the loss")
    beta, temp = _float(c["beta"]), _float(c["temperature"])
    t.put(["kl none", "aggregation token_mean",
           f"distill jsd(beta={format_value(beta)}, temperature={format_value(temp)}, mode=supervised, task=false)"])
    if c.get("teacher_model_name_or_path"):
        t.run["teacher.path"] = c["teacher_model_name_or_path"]
    else:
        t.notes.append("no teacher_model_name_or_path: give teacher.path in the run config")
    t.run["rollout.n"] = 1
    t.run["rollout.temperature"] = temp
    t.run["rollout.top_p"] = c["top_p"]
    t.run["rollout.max_new_tokens"] = int(c["max_completion_length"])
    t.run["train.lr"] = c["learning_rate"]
    if c["top_k"] not in (0, -1, None):
        t.ignore(f"top_k={c['top_k']}", "sampling options beyond temperature and top_p: the rollout samples "
                                        "with those two only (the completions differ, the algorithm does not)")
    return t


# ---------------------------------------------------------------------------------------
# Output


def nearest_library(text: str) -> tuple[str, list[str]]:
    """(the library spec whose resolved slots are closest to those of ``text``, the slots that differ)."""
    mine = loads(text).slots
    best: tuple[str, list[str]] | None = None
    for name in library():
        theirs = load(name).slots
        diff = [s for s in registry.SLOTS if [(v.component, v.params) for v in theirs[s]] !=
                [(v.component, v.params) for v in mine[s]]]
        if best is None or len(diff) < len(best[1]):
            best = (name, diff)
    assert best is not None
    return best


def spec_block(t: Translation, source: str, name: str) -> str:
    """The spec file: the spec, the library spec it equals or is closest to, every problem as a
    ``# WARNING`` line, the notes and the ignored options, as comments."""
    spec = t.spec_text(name, source)
    near, diff = nearest_library(spec)
    lines = [spec.rstrip("\n")]
    if not diff:
        lines.append(f"# same as algorithms/{near}.rl: `rldsl run {near}` runs it")
    elif len(diff) <= 2:
        lines.append(f"# closest library spec: algorithms/{near}.rl (differs in {', '.join(diff)})")
    for p in t.problems:
        lines.append(f"# WARNING: {p.option} not reproduced: {p.why}")
    for note in t.notes:
        lines.append(f"# note: {note}")
    for why, options in t.ignored.items():
        lines.append(f"# ignored ({why}): {', '.join(options)}")
    return "\n".join(lines) + "\n"


def run_toml(t: Translation, header: str = "") -> str:
    """The run config as TOML (``rldsl run SPEC --config run.toml``)."""
    return to_toml(t.run, header=header)


def set_flags(t: Translation) -> str:
    """The run config as ``--set`` flags, quoted for a POSIX shell: a string as it is, a list or a
    table as compact JSON (what ``--set`` parses), a number or a bool as TOML writes it."""
    def text(v: Any) -> str:
        if isinstance(v, str):
            return v
        if isinstance(v, (dict, list, tuple)):
            return json.dumps(v, separators=(",", ":"))
        return toml_value(v)

    return " ".join(f"--set {shlex.quote(f'{k}={text(v)}')}" for k, v in t.run.items() if v is not None)


def render(t: Translation, source: str, name: str, lenient: bool = False) -> str:
    """The printed output: the spec, then the run config as TOML and as --set flags."""
    lines = [spec_block(t, source, name).rstrip("\n"), "",
             run_toml(t, "run config (rldsl run SPEC --config this.toml); the same as --set flags below").rstrip("\n"),
             "", f"# rldsl run {name}.rl {set_flags(t)}"]
    return "\n".join(lines) + "\n"


def write_out(t: Translation, source: str, name: str, folder: str | Path) -> tuple[Path, Path]:
    """``--out DIR``: DIR/spec.rl (the spec and its comments) and DIR/run.toml (the run config)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    spec_path, toml_path = out / "spec.rl", out / "run.toml"
    spec_path.write_text(spec_block(t, source, name), encoding="utf-8")
    toml_path.write_text(run_toml(t, f"run config translated from {source} by `rldsl translate`\n"
                                     f"rldsl run {spec_path} --config {toml_path}"), encoding="utf-8")
    return spec_path, toml_path
