"""The names TRL's GRPOConfig and verl's trainer YAML give the settings a run config holds.

``rldsl translate`` carries a TRL config's fields into run keys with :data:`TRL_RUN` and
:data:`TRL_RUN_IF_GIVEN`; the run config's unknown-key message (``--set learning_rate=1e-6``)
reads the same tables through :func:`peer_setting`, so a peer's name gets rldsl's as its
"did you mean". A light module on purpose: the run config imports it at every start.
"""
from __future__ import annotations

__all__ = ["TRL_RUN", "TRL_RUN_IF_GIVEN", "peer_setting"]

#: TRL field -> run key, carried by ``rldsl translate`` always (TRL's default when absent)
TRL_RUN = {"num_generations": "rollout.n", "max_completion_length": "rollout.max_new_tokens",
           "temperature": "rollout.temperature", "top_p": "rollout.top_p", "learning_rate": "train.lr",
           "num_iterations": "train.ppo_epochs"}
#: TRL field -> run key, carried by ``rldsl translate`` when the config gives it
TRL_RUN_IF_GIVEN = {"max_grad_norm": "train.grad_clip", "weight_decay": "train.weight_decay",
                    "adam_epsilon": "train.eps", "max_steps": "train.steps", "warmup_steps": "train.warmup_steps",
                    "gradient_checkpointing": "train.gradient_checkpointing"}
#: verl's leaf names (actor_rollout_ref.*, data.*, trainer.*) -> the run key ``rldsl translate`` sets from them
_VERL_RUN = {"max_response_length": "rollout.max_new_tokens", "train_batch_size": "rollout.prompts_per_step",
             "total_training_steps": "train.steps", "lora_rank": "model.lora.rank",
             "enable_gradient_checkpointing": "train.gradient_checkpointing", "project_name": "log.project"}
#: peer names whose value is a product of run keys: what rldsl sets instead
_DERIVED = {
    "per_device_train_batch_size": ("rollout.prompts_per_step", "TRL's completions per device; rldsl sets "
                                    "rollout.prompts_per_step (prompts) x rollout.n (samples per prompt)"),
    "generation_batch_size": ("rollout.prompts_per_step", "TRL's completions per generation; rldsl sets "
                              "rollout.prompts_per_step (prompts) x rollout.n (samples per prompt)"),
    "ppo_mini_batch_size": ("train.minibatches", "verl's prompts per update; rldsl sets train.minibatches = "
                            "rollout.prompts_per_step / ppo_mini_batch_size"),
}
#: TRL's and verl's algorithm options: parameters of the spec, not run keys
_ALGORITHM_OPTIONS = ("beta", "epsilon", "epsilon_high", "delta", "loss_type", "scale_rewards",
                      "importance_sampling_level", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "kl_coef",
                      "kl_loss_coef", "use_kl_loss", "kl_loss_type", "entropy_coeff", "adv_estimator",
                      "loss_agg_mode", "norm_adv_by_std_in_grpo")


def peer_setting(name: str) -> tuple[str | None, str] | None:
    """For a TRL or verl name (``learning_rate``): the run key that holds that setting (or None: an
    algorithm option, which the spec holds) and a line that says so; None for a name no peer uses."""
    if name in TRL_RUN or name in TRL_RUN_IF_GIVEN:
        key = {**TRL_RUN, **TRL_RUN_IF_GIVEN}[name]
        return key, f"{name} is TRL's name (GRPOConfig); the run key is {key}"
    if name in _VERL_RUN:
        return _VERL_RUN[name], f"{name} is verl's name; the run key is {_VERL_RUN[name]}"
    if name in _DERIVED:
        key, why = _DERIVED[name]
        return key, f"{name} is {why}"
    if name in _ALGORITHM_OPTIONS:
        return None, (f"{name} is an algorithm option of TRL or verl: a parameter of the spec here (e.g. "
                      f"kl(beta=...), clip(low=..., high=...)), not a run key; `rldsl translate CONFIG` "
                      f"turns a TRL or verl config into a spec and a run config")
    return None
