"""What a run is settled to before any model loads: the checks, and the one ``resolve`` step.

Everything that can be known from the config, the spec, the data and the model folder's
``config.json`` / tokenizer is checked here, so a typo costs seconds, not a model load:

- ``check_device``: ``--device cuda`` on a machine without CUDA;
- ``check_engine``: a ``rollout.engine`` this kind of run cannot use;
- ``check_group_size``: ``rollout.n=1`` with a spec that compares a prompt's samples
  (every advantage would be 0: refused unless ``train.allow_zero_advantages``);
- ``resolve``: the task's defaults filled in (``reward.name``, ``rollout.max_new_tokens``),
  ``max_new_tokens`` clipped to the model's context, a micro-batch budget smaller than a
  row reported; the result is frozen (:meth:`RunConfig.frozen`), and it is what
  ``config.json`` records: the saved config is what ran.

Nothing here loads weights; ``run/plan.py: plan_run`` calls these in order, ``run/build.py: build``
loads the models afterwards.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

from rldsl import lint
from rldsl.inputs import INPUTS
from rldsl import Algorithm

from .config import POLICY_BASE, RunConfig
from .data import reasoning_gym as rg
from .data.sources import Source
from .errors import ConfigError, RunError
from .models.kinds import folder_kind, text_kind
from .models.loading import folder_is_moe, load_tokenizer, model_context
from .rewards.functions import RewardFn
from .rewards.spec import with_answer_format
from .rollout.multi_turn import check_episode_template, check_tools

#: The lint rule whose finding means every advantage is 0 (rldsl/lint.py, run-start rules).
GROUP_OF_ONE_RULE = "group-of-one"


# ----------------------------------------------------------------------------- checks

def check_device(cfg: RunConfig) -> None:
    """``device = "cuda"`` needs CUDA in this process (a Ray cluster elsewhere is its own judge)."""
    if cfg.device != "cuda" or cfg.distributed.ray_address is not None or torch.cuda.is_available():
        return
    why = ("no CUDA device is visible (torch.cuda.is_available() is False)" if torch.backends.cuda.is_built()
           else f"this torch build ({torch.__version__}) has no CUDA support")
    raise ConfigError(f"--device cuda (device=\"cuda\"): {why}. Train on the CPU with --device cpu, or run "
                      f"on a machine with a GPU and a CUDA build of torch.")


def check_engine(cfg: RunConfig) -> None:
    """The rollout engine can run here: ``vllm`` needs the vllm package (its CPU build on a
    machine without GPUs: ``make setup-vllm``), in one process or on Ray rollout workers."""
    if cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise RunError("rollout.engine=vllm but vllm is not installed here: on GPUs pip install "
                       "'rldsl[vllm]'; on a CPU machine use the vLLM venv (`make setup-vllm`, then "
                       ".venv-vllm/bin/rldsl run ...); or use rollout.engine=hf")


def check_async(algo: Algorithm, cfg: RunConfig) -> None:
    """What asynchronous rollouts (rollout.max_staleness > 0) cannot do yet, refused by name."""
    r = cfg.rollout
    if r.partial and r.max_staleness == 0:
        raise ConfigError("rollout.partial resumes samples cut off by a weight sync, which only an "
                          "asynchronous run has: set rollout.max_staleness >= 1 (or drop rollout.partial)")
    if r.partial and (cfg.distributed.uses_ray or r.tools is not None or r.env is not None
                      or r.agent is not None):
        raise ConfigError("rollout.partial runs in one process with single-turn completions for now "
                          "(not with Ray rollout workers, rollout.tools, rollout.env or rollout.agent)")
    if cfg.rollout.max_staleness == 0:
        return
    for v in algo.active():
        if "pass_rate_cap" in v.spec.facts.plan:
            raise RunError(f"{v.slot} {v.component} retires prompts from the data as they are solved, "
                           f"which the trainer decides while the rollout producer is already drawing "
                           f"later prompts: it does not run with rollout.max_staleness="
                           f"{cfg.rollout.max_staleness} (use 0, or drop the filter)")


def check_tree(algo: Algorithm, cfg: RunConfig) -> None:
    """``sampling tree`` runs where it is tested (docs/formulas.md, "Trees"): the HF engine in this
    process, a synchronous run of single-turn answers, ``rollout.n`` its rows per prompt; the rest
    is refused by name. A formula reading the tree inputs needs the tree sampler."""
    tree = next((v for v in algo.active() if "tree_shape" in v.spec.facts.plan), None)
    reads = [x for x in algo.needs() if INPUTS[x].source == "tree"]
    if tree is None:
        if reads:
            raise ConfigError(f"the spec reads {', '.join(reads)}, which only a tree's rows have: add "
                              "`sampling tree(M=..., N=..., L=..., T=...)` to the spec")
        return
    p, r = tree.params, cfg.rollout
    other = [name for name, on in (("rollout.engine=vllm", r.engine == "vllm"),
                                   ("rollout.max_staleness > 0", r.max_staleness > 0),
                                   ("Ray workers (distributed)", cfg.distributed.uses_ray),
                                   ("rollout.partial", bool(r.partial)),
                                   ("rollout.tools / rollout.env / rollout.agent",
                                    r.tools is not None or r.env is not None or r.agent is not None)) if on]
    if other:
        raise ConfigError(f"sampling tree runs on rollout.engine=hf in one process, synchronously, with "
                          f"single-turn answers; not yet with {', '.join(other)}")
    rows = p["M"] * (1 + p["L"] * p["N"] * p["T"])
    if r.n != rows:
        raise ConfigError(f"sampling tree(M={p['M']}, N={p['N']}, L={p['L']}, T={p['T']}) makes M (1 + L N T) = "
                          f"{rows} rows (leaves) per prompt: set rollout.n={rows} (it is {r.n})")


def check_settings(algo: Algorithm, cfg: RunConfig, source: Source | None = None) -> None:
    """The checks that need the config alone, cheapest first: the device, the engine, an
    asynchronous run's limits, what the run's prompt source (``source``, bound by the plan; a
    caller checking the settings alone gives none) needs of the config (reasoning-gym's: one
    process, no data.eval_path), the tools, environment or agent (rollout/multi_turn.py
    ``check_tools``: they import, before any model loads). (The trackers ``log.report_to``
    names: run/plan.py.)"""
    check_device(cfg)
    check_tree(algo, cfg)  # before the engine's: a tree on vLLM is refused by name, installed or not
    check_engine(cfg)
    check_async(algo, cfg)
    check_model_kind(algo, cfg)
    check_reference(algo, cfg)
    check_answers(algo, cfg)
    check_weight_sync(cfg)
    check_precision(cfg)
    check_lora_sync(cfg, folder_moe(cfg))
    if source is not None and source.check is not None:
        source.check(cfg)
    check_tools(cfg)


def folder_moe(cfg: RunConfig) -> bool:
    """Whether ``model.path``'s config.json says mixture-of-experts, read once for the checks that
    depend on it (no ``model.path``: the embedded text model; a config.json that does not parse:
    not, and run/sources.py ``model_of`` says so in a sentence)."""
    path = cfg.model.path
    if path is None:
        return False
    try:
        return folder_is_moe(path) is True
    except ValueError:  # not JSON
        return False


def check_model_kind(algo: Algorithm, cfg: RunConfig) -> None:
    """The model folder's kind (models/kinds/: a vision-language policy's) refuses, before any model
    loads, what its forwards cannot run: a folder without the files the kind reads, or settings its
    inputs do not reach (docs/vlm.md, "Engines and trainers"). Reads config.json only."""
    kind = folder_kind(cfg.model.path) if cfg.model.path is not None else text_kind()
    kind.check_run(algo, cfg)


def check_reference(algo: Algorithm, cfg: RunConfig) -> None:
    """A spec reading the reference model's reward (an input made by ``reference_rollout``:
    ``ref_reward``) names the reference (``reward.reference``: ``policy_base`` or a model folder)
    and runs where its answers are sampled: single-turn rollouts in this process, the policy on
    either engine (the reference samples on an HF engine of its own: workers/start.py
    reference_rollouts), synchronously or asynchronously (an asynchronous run's producer samples
    the reference where it makes the step's batch). Anything else is refused here, before any
    model loads, rather than run untested; a reference named for a spec that reads none is
    refused too (it would cost a model and nothing would read it)."""
    reads = [x for x in algo.needs() if INPUTS[x].source == "reference_rollout"]
    ref = cfg.reward.reference
    if not reads:
        if ref is not None:
            raise ConfigError(f"reward.reference={ref} but {algo.name} reads no reference reward (ref_reward in a "
                              "formula): drop reward.reference, or read ref_reward in the spec")
        return
    what = f"{algo.name} reads {', '.join(reads)} (the reference model's reward of each row's prompt)"
    if ref is None:
        raise ConfigError(f"{what}: name the reference, reward.reference=policy_base (the policy as the run "
                          "starts; with LoRA, its adapters off) or reward.reference=PATH (a model folder)")
    if ref != POLICY_BASE and not (Path(ref) / "config.json").is_file():
        raise ConfigError(f"reward.reference={ref}: not a model folder (no config.json there); "
                          f"use {POLICY_BASE} or the folder of a Hugging Face model")
    r, d = cfg.rollout, cfg.distributed
    refused = [what for what, on in (
        ("multi-turn episodes (rollout.tools / rollout.env / rollout.agent)",
         r.tools is not None or r.env is not None or r.agent is not None),
        ("Ray workers (distributed.trainers > 1, distributed.rollout_workers or a Ray address)", d.uses_ray),
    ) if on]
    if refused:
        raise ConfigError(f"{what}; its answers are sampled only in a one-process single-turn run (the policy on "
                          f"rollout.engine=hf or vllm, synchronous or asynchronous), not with: {'; '.join(refused)}")


def check_answers(algo: Algorithm, cfg: RunConfig) -> None:
    """A spec reading the policy's probability of the reference answer (an input made by ``answer``:
    ``answer_prob``, ``bare_answer_prob``) needs the data's answers (``data.answer_key``), a
    non-empty opening tag (``reward.answer_tags``), and the policy that sampled the step in this
    process to score them: a one-process, synchronous, single-turn run. Refused here otherwise,
    before any model loads."""
    reads = [x for x in algo.needs() if INPUTS[x].source == "answer"]
    if not reads:
        return
    what = f"{algo.name} reads {', '.join(reads)} (the policy's probability of each row's reference answer)"
    if cfg.data.answer_key is None:
        raise ConfigError(f"{what}: the data has no answers (data.answer_key=null); name the column that holds "
                          "each prompt's reference answer, e.g. --set data.answer_key=answer")
    if not cfg.reward.answer_tags[0]:
        raise ConfigError(f"{what}: reward.answer_tags' opening tag is empty; it marks where a completion's "
                          "answer starts, e.g. ['<answer>', '</answer>']")
    r, d = cfg.rollout, cfg.distributed
    refused = [what for what, on in (
        ("multi-turn episodes (rollout.tools / rollout.env / rollout.agent)",
         r.tools is not None or r.env is not None or r.agent is not None),
        ("Ray workers (distributed.trainers > 1, distributed.rollout_workers or a Ray address)", d.uses_ray),
        (f"an asynchronous run (rollout.max_staleness={r.max_staleness})", r.max_staleness > 0),
    ) if on]
    if refused:
        raise ConfigError(f"{what}; the policy that sampled scores the answers only in a one-process synchronous "
                          f"single-turn run, not with: {'; '.join(refused)}")


def check_precision(cfg: RunConfig) -> None:
    """One precision end to end: a float16 run's trainer ranks do not compute in bf16."""
    if cfg.model.dtype == "float16" and cfg.distributed.mixed_precision == "bf16":
        raise ConfigError("model.dtype=float16 with distributed.mixed_precision=bf16: the engine would sample in "
                          "float16 and the trainer ranks compute in bfloat16. Use distributed.mixed_precision=auto "
                          "(float16 in both) or model.dtype=bfloat16")


def check_weight_sync(cfg: RunConfig) -> None:
    """``distributed.weight_sync = "collective"`` broadcasts to rollout workers on Ray, the
    weights of the moment: not in one process, nor with weights published ahead (an asynchronous
    run's producer loads a version after the trainer has moved on)."""
    d = cfg.distributed
    if d.weight_sync != "collective":
        return
    if not d.uses_ray:
        raise ConfigError("distributed.weight_sync='collective' broadcasts the weights to rollout workers on Ray: "
                          "set distributed.rollout_workers >= 1 (or distributed.trainers > 1), or keep "
                          "'object_store' (a one-process run copies the weights in place)")
    if cfg.rollout.max_staleness > 0:
        raise ConfigError(f"distributed.weight_sync='collective' sends the trainers' current weights, and "
                          f"rollout.max_staleness={cfg.rollout.max_staleness} loads published older versions: "
                          "use distributed.weight_sync='object_store' for an asynchronous run")


#: The largest LoRA rank vLLM serves (vllm.config.lora.MaxLoRARanks, vLLM 0.32: 1, 8, ..., 320, 512).
VLLM_MAX_LORA_RANK = 512
#: Modules whose adapters are not sent to vLLM as adapters: the adapter folder rldsl writes holds
#: linear-layer LoRA (``lora_A`` / ``lora_B``) of the decoder's attention and MLP; an embedding's
#: (peft's ``lora_embedding_A`` / ``_B``) or the output head's (vLLM's logits-processor LoRA, tied to the
#: embedding in small models) would need a layout of their own, untested here.
VLLM_LORA_REFUSED = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out")


def check_lora_sync(cfg: RunConfig, moe: bool) -> None:
    """``model.lora.sync = "adapter"`` needs adapters (``model.lora.rank > 0``), and on the vLLM
    engine adapters vLLM can serve: a rank up to 512, linear layers of a dense model's decoder
    (``moe``: :func:`folder_moe`; a vision-language model's refusal is its kind's, models/kinds/).
    Refused here, before any model loads."""
    lo = cfg.model.lora
    if lo.sync != "adapter":
        return
    if lo.rank == 0:
        raise ConfigError("model.lora.sync='adapter' sends the LoRA adapters to the engines, and model.lora.rank=0 "
                          "trains no adapter: set model.lora.rank > 0, or drop model.lora.sync")
    experts = [m for m in lo.target_modules if m.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj")]
    if moe and experts:
        raise ConfigError(f"model.lora.target_modules={experts} adapt {cfg.model.path}'s fused expert parameters, "
                          "and model.lora.sync='adapter' sends linear-layer adapters only (docs/moe.md): use "
                          "model.lora.sync='merged'")
    if cfg.rollout.engine != "vllm":
        return
    if moe:
        raise ConfigError(f"{cfg.model.path} is a mixture-of-experts model: model.lora.sync='adapter' on the vLLM "
                          "engine is tested on dense text models only; use model.lora.sync='merged'")
    if lo.rank > VLLM_MAX_LORA_RANK:
        raise ConfigError(f"model.lora.rank={lo.rank}: vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANK}; "
                          "use model.lora.sync='merged' (vLLM then loads merged weights)")
    refused = [m for m in lo.target_modules if m.rsplit(".", 1)[-1] in VLLM_LORA_REFUSED]
    if refused:
        raise ConfigError(f"model.lora.target_modules={refused}: model.lora.sync='adapter' sends the decoder's "
                          "linear-layer adapters (attention and MLP projections) to vLLM, not an embedding's or "
                          "the output head's; drop them, or use model.lora.sync='merged'")


def check_teacher_settings(algo: Algorithm, cfg: RunConfig) -> None:
    """A spec that distills has a teacher (``teacher.path`` a model folder, ``teacher.url``
    with the settings a server allows, ``teacher.self`` on a privileged context from a data
    column, or ``teacher.ema``), and a spec that does not has none; reads no model file
    and imports neither torch nor transformers (:func:`check_teacher` then reads the folder)."""
    t = cfg.teacher
    path, url = t.path, t.url
    given = [k for k, on in (("teacher.path", path is not None), ("teacher.url", url is not None),
                             ("teacher.self", t.self), ("teacher.ema", t.ema is not None),
                             ("teacher.context_key", t.context_key is not None)) if on]
    key = given[0] if given else "teacher.path"
    readers = [f"{v.slot} {v.component}" for v in algo.active()
               if any(INPUTS[x].teacher for x in v.spec.facts.needs)]
    if not algo.uses_teacher:
        if given:
            raise ConfigError(f"{key} is set but {algo.name} reads no teacher (no distill slot): "
                              f"drop {key}, or add e.g. `distill reverse_kl` to the spec")
        return
    if path is None and url is None and not t.self and t.ema is None:
        raise ConfigError(f"{algo.name}: {', '.join(readers)} learns from a teacher, and teacher.path is "
                          "not set (nor teacher.url, teacher.self, teacher.ema): give teacher.path=<an HF model "
                          "folder with the policy's vocabulary>, teacher.url=<an OpenAI-compatible server of it "
                          "that returns prompt logprobs, e.g. vLLM's>, or teacher.self=true with "
                          "teacher.context_key=<a data column> (the policy itself on a privileged prompt)")
    if t.self and t.context_key is None:
        raise ConfigError("teacher.self=true: the teacher is the policy itself, and without teacher.context_key "
                          "it sees the policy's own prompt (it would teach nothing): give teacher.context_key="
                          "<a data column, e.g. solution> that the teacher's prompt adds")
    if t.context_key is not None and cfg.data.path is None:
        raise ConfigError(f"teacher.context_key={t.context_key}: the teacher's context is a column of a data "
                          "file, and data.path is not set (a built-in task's rows have no such column)")
    if cfg.distributed.uses_ray:
        raise ConfigError(f"a teacher ({key}) runs in the trainer's process for now (an actor or a server: "
                          "called from it): it does not run with distributed.trainers > 1, rollout workers or a "
                          "Ray address")
    if path is None and url is None:  # the policy itself, or its EMA copy: nothing to read
        return
    if url is not None:  # a server returns logprobs only (an actor returns its hidden states too)
        jsd = sorted({v.component for v in algo.active() if v.spec.facts.plan.get("jsd_beta") is not None})
        if jsd:
            raise ConfigError(f"{algo.name}: distill {', '.join(jsd)} reads the teacher's hidden states and LM head, "
                              "and teacher.url returns logprobs only: give teacher.path (in the trainer's "
                              "process, or on a Ray actor with teacher.actor=true)")
        # the server itself is checked when the trainer is built (train/teachers.py)
        temp = cfg.rollout.temperature
        if temp not in (0.0, 1.0):
            raise ConfigError(f"teacher.url: the server's prompt logprobs are at temperature 1 (vLLM computes them "
                              f"from the raw logits) and rollout.temperature={temp:g} is scored at {temp:g}: "
                              "sample at 1, or give teacher.path")
        return
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"teacher.path={path}: " + ("not found" if not folder.exists() else
                                                      "not a Hugging Face model folder (no config.json)"))


def check_teacher(algo: Algorithm, cfg: RunConfig, student: Path, tokenizer: Any) -> None:
    """A spec that distills has a teacher (:func:`check_teacher_settings`), and the teacher shares
    the policy's vocabulary and has the top-k tokens the spec asks for; said before any model
    loads (reads config.json and the tokenizer only)."""
    check_teacher_settings(algo, cfg)
    path = cfg.teacher.path
    if path is None:  # no teacher, or a server's (checked when the trainer is built)
        return
    folder = Path(path)
    from transformers import AutoConfig
    t_cfg, s_cfg = AutoConfig.from_pretrained(str(folder)), AutoConfig.from_pretrained(str(student))
    t_v = t_cfg.get_text_config().vocab_size
    s_v = s_cfg.get_text_config().vocab_size
    if t_v != s_v:
        raise ConfigError(f"teacher.path={path} has a vocabulary of {t_v} tokens and the policy "
                          f"{s_v}: a teacher scores the policy's token ids, so both need one vocabulary")
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        t_tok = load_tokenizer(folder)
        if t_tok.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"teacher.path={path}: its tokenizer maps tokens to other ids than the "
                              f"policy's ({vocab_difference(tokenizer.get_vocab(), t_tok.get_vocab())}): a "
                              "teacher scores the policy's token ids, so both need one vocabulary")
    k = algo_topk(algo)
    if k is not None and k > t_v:
        raise ConfigError(f"{algo.name}: top-k of {k} tokens per position, but the teacher's "
                          f"vocabulary has {t_v}: lower k")


def check_tokenizer(algo: Algorithm, cfg: RunConfig, model_path: Path, tokenizer: Any) -> None:
    """The checks that need the policy's tokenizer, before any weights load: a distill spec's
    teacher shares its vocabulary (:func:`check_teacher`), and multi-turn episodes have a chat
    template that renders them and their tools (rollout/multi_turn.py ``check_episode_template``)."""
    check_teacher(algo, cfg, model_path, tokenizer)
    check_episode_template(cfg, tokenizer, model_path)


def vocab_difference(policy: dict[str, int], teacher: dict[str, int], most: int = 3) -> str:
    """The first ``most`` tokens whose ids differ, each saying which side has which id, e.g.
    ``'0' is policy id 4, teacher id 5; 'x' is policy id 9, not in the teacher's vocabulary``."""
    def side(name: str, vocab: dict[str, int], token: str) -> str:
        return f"{name} id {vocab[token]}" if token in vocab else f"not in the {name}'s vocabulary"

    differ = sorted((t for t in policy.keys() | teacher.keys() if policy.get(t) != teacher.get(t)),
                    key=lambda t: (min(policy.get(t, math.inf), teacher.get(t, math.inf)), t))
    shown = [f"{t!r} is {side('policy', policy, t)}, {side('teacher', teacher, t)}" for t in differ[:most]]
    return "; ".join(shown) + (f"; {len(differ) - most} more" if len(differ) > most else "")


def algo_topk(algo: Algorithm) -> int | None:
    """The top-k a spec asks of its teacher (a component's ``plan`` teacher_topk), or None."""
    for v in algo.active():
        p = v.spec.facts.plan.get("teacher_topk")
        if p is not None:
            return int(v.params[p])
    return None


def run_facts(cfg: RunConfig) -> lint.RunFacts:
    """What the run-start warnings check the spec against. The HF engine samples from a copy of
    the policy in the trainer's dtype: with float32 its logprobs are the trainer's own (exact);
    in bf16/fp16 (or with vLLM) they differ, which is what a correction is for."""
    return lint.RunFacts(group_size=cfg.rollout.n, max_new_tokens=cfg.max_new_tokens,
                         engine=cfg.rollout.engine,
                         exact_logprobs=cfg.rollout.engine == "hf" and cfg.model.dtype == "float32"
                         and cfg.rollout.max_staleness == 0,  # stale samples: the engine's logprobs differ
                         max_staleness=cfg.rollout.max_staleness)


def check_group_size(algo: Algorithm, cfg: RunConfig) -> list[Any]:
    """The run-start warnings of ``algo`` under ``cfg`` (``lint.check_run``); raises when a group
    statistic meets ``rollout.n=1`` and the run does not insist (``train.allow_zero_advantages``):
    every group then has one sample, every advantage is 0 and no update can happen."""
    found = lint.check_run(algo, run_facts(cfg))
    zero = [w for w in found if w.rule == GROUP_OF_ONE_RULE]
    if zero and not cfg.train.allow_zero_advantages:
        what = "; ".join(w.message for w in zero)
        raise ConfigError(f"{what}. With one sample per prompt every advantage is 0 and no update "
                          f"can happen: set rollout.n >= 2 (e.g. --set rollout.n=8), or --set "
                          f"train.allow_zero_advantages=true to run anyway")
    return found


#: What a function that reads a settled config says of one that is not
UNSETTLED = ("the config is not settled (reward.name / rollout.max_new_tokens unset): data/sources.py "
             "settle(cfg, source) fills in the source's defaults first, as run/plan.py does")


def reward_note(cfg: RunConfig, origin: str | None) -> str:
    """The run-start line naming the reward of a settled config; ``origin``: whose default it took
    (data/sources.py ``settle``), None when the config names its own."""
    note = f"reward: {reward_spec(cfg)}"
    return note if origin is None else f"{note} (the default for {origin}; choose one with --reward)"


def reward_spec(cfg: RunConfig) -> str:
    """The reward the run scores with: ``reward.name`` (settled: data/sources.py ``settle``), with
    ``reward.answer_format`` given to its ``reasoning_gym`` terms."""
    if cfg.reward.name is None:
        raise ValueError(UNSETTLED)
    return with_answer_format(cfg.reward.name, cfg.reward.answer_format)


def reward_fn(cfg: RunConfig) -> RewardFn:
    """The run's reward, ``reward.name`` (settled: data/sources.py ``settle``),
    with ``reward.answer_format`` given to its ``reasoning_gym`` terms."""
    r = cfg.reward
    if r.name is None:
        raise ValueError(UNSETTLED)
    return RewardFn(with_answer_format(r.name, r.answer_format), on_error=r.on_error, workers=r.workers,
                    timeout_s=r.timeout_s)


def checked_reward(cfg: RunConfig) -> RewardFn:
    """The reward of a settled config (data/sources.py ``settle``), built once, before any model loads:
    an unknown name, a module that does not import, a reasoning-gym answer format nobody knows,
    ``reasoning_gym`` on other data than reasoning-gym's or a function of the wrong signature
    fails here."""
    reward = reward_fn(cfg)
    reward.check_signatures()
    rg.check_reward(reward, cfg.data.path)
    return reward


# ----------------------------------------------------------------------------- the model's context
# (model_context: models/loading.py, which reads a model folder)

def fit_context(max_new_tokens: int, context: int | None, longest_prompt: int,
                model: str) -> tuple[int, str | None]:
    """(``max_new_tokens`` clipped so that the longest prompt plus the completion fits the model's
    context, a note when it was clipped); refuses a prompt that does not fit at all -- past the
    last position a model's forward fails mid-step (an ``IndexError`` in its position
    embedding) or silently extrapolates."""
    if context is None:
        return max_new_tokens, None
    if longest_prompt >= context:
        raise ConfigError(f"the longest prompt has {longest_prompt} tokens but the model ({model}) has a "
                          f"context of {context} positions (max_position_embeddings): no room for "
                          f"even one new token (max_new_tokens). Shorten or drop the long prompts.")
    room = context - longest_prompt
    if max_new_tokens <= room:
        return max_new_tokens, None
    return room, (f"max_new_tokens {max_new_tokens} + the longest prompt ({longest_prompt} tokens) "
                  f"exceeds the model's context of {context} positions: generating at most "
                  f"{room} new tokens (set rollout.max_new_tokens to silence this)")


def microbatch_note(cfg: RunConfig, longest_prompt: int) -> str | None:
    """A warning when ``train.max_tokens_per_microbatch`` is smaller than one row (the longest
    prompt plus ``max_new_tokens``): a row is never split, so each such row is a forward of
    its own -- correct, but several times slower than the budget suggests."""
    budget = cfg.train.max_tokens_per_microbatch
    row = longest_prompt + cfg.max_new_tokens
    if budget is None or budget >= row:
        return None
    return (f"train.max_tokens_per_microbatch={budget} is smaller than one row (up to {longest_prompt} "
            f"prompt + {cfg.max_new_tokens} new tokens = {row}): a row is never split, so every row "
            f"longer than {budget} tokens gets a forward of its own (slow). Set it to at least {row}, "
            f"or null for one forward per minibatch")


def vllm_prefill_budget_note(cfg: RunConfig, longest: int, context: int | None) -> str | None:
    """vLLM 0.32's CPU runner fails on a *seeded* request whose prompt it prefills in chunks
    (``CPU Generator does not use offset``: it rewinds the generator of a partially prefilled
    request, which CPU generators cannot), and a run seeds every request. A
    ``max_num_batched_tokens`` (``rollout.vllm.engine_kwargs``) below the longest prompt
    (``longest`` tokens) would stop the run at its first rollout: refused (exit 2). With episodes
    or agents a later turn's prompt holds the episode so far, up to the context: a budget below
    it gets a note."""
    budget = cfg.rollout.vllm.engine_kwargs.get("max_num_batched_tokens")
    if cfg.rollout.engine != "vllm" or cfg.device != "cpu" or budget is None:
        return None
    if int(budget) < longest:
        raise ConfigError(f"rollout.vllm.engine_kwargs.max_num_batched_tokens={budget} is below the longest prompt "
                          f"({longest} tokens): vLLM's CPU build prefills it in chunks, and fails on a seeded "
                          "request prefilled in chunks (every request of a run is seeded; docs/moe.md): set it to "
                          "at least the model's context, or drop it (vLLM's default)")
    r = cfg.rollout
    limit = r.vllm.max_model_len or context
    if (r.tools or r.env or r.agent) and limit is not None and int(budget) < limit:
        return (f"note: rollout.vllm.engine_kwargs.max_num_batched_tokens={budget} is below the context ({limit}): "
                "a later turn's prompt longer than it is prefilled in chunks, where vLLM's CPU build fails on a "
                "seeded request (docs/moe.md); set it to at least the context")
    return None


# ----------------------------------------------------------------------------- resolve

def check_routing_replay(cfg: RunConfig, model_path: Path) -> None:
    """``rollout.routing_replay`` needs a mixture-of-experts policy (its config.json declares
    routed experts). Both engines record it (single-turn completions, multi-turn episodes and
    agents' calls alike); the vLLM engine with prefix caching off (a cached prompt block is not
    computed, so its routing is not captured; docs/moe.md)."""
    r = cfg.rollout
    if r.routing_replay and r.engine == "vllm" and r.vllm.engine_kwargs.get("enable_prefix_caching"):
        raise ConfigError("rollout.routing_replay=true with rollout.engine=vllm records the experts of every token "
                          "vLLM computes, and prefix caching skips the cached prompt blocks (docs/moe.md): drop "
                          "rollout.vllm.engine_kwargs.enable_prefix_caching (the engine turns it off)")
    if r.routing_replay and folder_is_moe(model_path) is False:
        raise ConfigError(f"rollout.routing_replay=true replays the experts a mixture-of-experts model routed "
                          f"each token to, and the model at {model_path} is dense (its config.json declares no "
                          "experts: num_local_experts / num_experts / n_routed_experts): drop rollout.routing_replay")


#: the names transformers 5 gives a mixture-of-experts layer's fused expert parameters
FUSED_EXPERT_NAMES = ("gate_up_proj", "down_proj")


def check_expert_lora(cfg: RunConfig, model_path: Path) -> None:
    """LoRA on a mixture-of-experts model's fused expert parameters (``model.lora.target_modules``
    naming ``gate_up_proj`` / ``down_proj``: models/lora.py) is merged by the module in one
    process; the FSDP2 trainers' sync merges Linear adapters only: refused before a model loads."""
    lo = cfg.model.lora
    names = sorted(set(lo.target_modules) & set(FUSED_EXPERT_NAMES))
    if lo.rank and names and cfg.distributed.trainers > 1 and folder_is_moe(model_path):
        raise ConfigError(f"model.lora.target_modules {names} adapt the fused expert parameters of the "
                          f"mixture-of-experts model at {model_path}, whose adapters are merged in one process "
                          f"only (docs/moe.md): with distributed.trainers={cfg.distributed.trainers} adapt the "
                          "attention (q_proj, k_proj, v_proj, o_proj), or train in one process")


def resolve(cfg: RunConfig, model_path: Path, tokenizer: Any, prompts: list[str],
            model_label: str | None = None) -> tuple[RunConfig, list[str]]:
    """(the config that runs, frozen; the notes to print at the start of the run).

    Takes the config the plan settled (data/sources.py ``settle``: ``reward.name``, the tools and
    ``rollout.max_new_tokens`` its prompt source leaves it) and clips ``max_new_tokens`` to the
    context of the model at ``model_path`` (its config.json; ``prompts`` are the rendered
    prompts, tokenized with ``tokenizer``). Call it before ``config.json`` is written:
    the saved config is then what ran, and resuming from it changes nothing.
    """
    if cfg.reward.name is None or cfg.rollout.max_new_tokens is None:
        raise ValueError(UNSETTLED)
    check_routing_replay(cfg, model_path)
    check_expert_lora(cfg, model_path)
    notes: list[str] = []
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    longest = max(lengths, default=0)
    context = model_context(model_path)
    if context is not None and longest >= context:  # name the prompt: which one, from which data
        i = lengths.index(longest)
        source = f" of data.path={cfg.data.path}" if cfg.data.path else ""
        over = sum(n >= context for n in lengths)
        raise ConfigError(f"a prompt{source} has {longest} tokens (as rendered, it starts {prompts[i][:60]!r}) "
                          f"but the model ({model_label or model_path}) has a context of {context} positions "
                          f"(max_position_embeddings): no room for even one new token; {over} of "
                          f"{len(lengths)} prompts do not fit. Shorten or drop the long prompts.")
    max_new, clipped = fit_context(cfg.max_new_tokens, context, longest, model_label or str(model_path))
    if clipped:
        notes.append(clipped)
    resolved = cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={"max_new_tokens": max_new})})
    resolved = RunConfig.model_validate(resolved.model_dump())  # the copies above skip validation
    micro = microbatch_note(resolved, longest)
    if micro:
        notes.append(micro)
    chunked = vllm_prefill_budget_note(resolved, longest, model_context(model_path))
    if chunked:
        notes.append(chunked)
    return resolved.frozen(), notes
