"""The runtime's CLI commands (``rldsl run``, ``plot``, ``samples``, ``export``, ``reward``,
``serve-reward``, ``serve-tinker``, ``eval``, ``ablate``), added to the app by :func:`register` (the one hook through
which the language package's CLI imports the runtime). Each command's options are declared here
and its body imports the module that does the work, so that loading the app imports no model,
engine or reward code: ``rldsl --help``, ``check`` or ``list`` start in well under a second.

``rldsl run`` builds the :class:`~rldsl.runtime.config.RunConfig` from, lowest to highest
precedence: the field defaults (or, with ``--resume``, the run's saved config), the
``--config`` file, the ``--set key=value`` overrides in order, then the dedicated flags
(``--model``, ``--data``, ``--reward``, ``--steps``, ``--seed``, ``--out``, ``--device``,
``--tensorboard``, and ``--trainers``, ``--rollout-workers``, ``--gpus-per-worker``,
``--ray-address`` for the distributed runtime). It then calls ``rldsl.runtime.run.loop.train(spec, cfg, resume=...)``.

Exit codes, as for every command (``rldsl.cli_errors``, docs/errors.md): 0 success; 1 a
failed run; 2 bad input (spec, configuration, command line, model path, reward, data);
130 interrupted. No Python traceback unless ``--traceback``.
"""
from __future__ import annotations

import json

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ..cli_errors import reports_errors
from ..errors import Interrupted, UsageError
from .errors import ConfigError

if TYPE_CHECKING:  # the run config (pydantic) is imported by the commands that read one: not by --help, check, list
    from .config import RunConfig

__all__ = ["register", "run_command", "plot_command", "samples_command", "export_command", "reward_command",
           "serve_reward_command", "serve_tinker_command", "eval_command", "ablate_command", "build_run_config"]


def set_option(help: str) -> Any:
    """``--set KEY=VALUE`` (``-s``), declared once for every command that takes run-config overrides."""
    return typer.Option("--set", "-s", metavar="KEY=VALUE", help=help)


#: The options ``run`` and ``eval`` share: flag -> (metavar, what it names); each command adds what
#: it falls back to (``rldsl run``: the task's own; ``rldsl eval``: the run's)
SHARED_OPTIONS = {
    "--reward": ("NAME", "Reward: a built-in name, module:function (the current folder is searched first) or "
                         "path/to/file.py:function (reward.name)"),
    "--tools": ("MOD:FN[,MOD:FN]", "Tools the model may call: typed, documented Python functions; every sample "
                                   "is a multi-turn episode (rollout.tools)"),
    "--env": ("MOD:CLASS", "A multi-turn environment class with reset(row) and step(message), or "
                           "verifiers:<taskset id>, openenv:<url>, openenv:mcp@<url> (rollout.env; docs/agents.md)"),
}


def shared_option(flag: str, default: str) -> Any:
    """One of :data:`SHARED_OPTIONS`, declared once for ``run`` and ``eval``; ``default``: the
    command's fallback when the option is not given."""
    metavar, what = SHARED_OPTIONS[flag]
    return typer.Option(flag, metavar=metavar, help=f"{what}; default: {default}.")


def _looks_like_path(spec: str) -> bool:
    return spec.endswith(".rl") or "/" in spec or "\\" in spec


def build_run_config(spec: Optional[str], *, config: Optional[Path] = None,
                     overrides: Optional[list[str]] = None, resume: Optional[Path] = None,
                     flags: Optional[dict[str, Any]] = None) -> tuple[str, RunConfig]:
    """Resolve the spec argument and the run config of ``rldsl run``; raise ConfigError.

    With ``resume``, the run's saved config is the base (``--config`` is refused: the
    saved file is the config), ``out`` is the resumed folder and SPEC defaults to the
    run's saved ``spec.rl``.
    """
    from .config import load_config
    from .records.run_dir import SPEC_FILE, load_run_config

    flags = dict(flags or {})
    base = None
    if resume is not None:
        if config is not None:
            raise ConfigError("--config cannot be combined with --resume: a resumed run "
                              "keeps its saved config (change single keys with --set)")
        if not resume.is_dir():
            raise ConfigError(f"--resume: run folder not found: {resume}")
        base = load_run_config(resume)
        out = flags.get("out")
        if out is not None and Path(out).resolve() != resume.resolve():
            raise ConfigError(f"--out {out} conflicts with --resume {resume}: a resumed "
                              f"run continues in its own folder")
        flags["out"] = str(resume)
        if spec is None:
            spec = str(resume / SPEC_FILE)
    if spec is None:
        raise ConfigError("missing SPEC: give a spec file (algorithms/grpo.rl) or a "
                          "library name (grpo)")
    if _looks_like_path(spec) and not Path(spec).is_file():
        raise ConfigError(f"spec file not found: {spec}")
    return spec, load_config(config, overrides or [], flags=flags, base=base)


def _interrupted(cfg: RunConfig, resume: Optional[Path]) -> Interrupted:
    """Ctrl-C: name the command that continues the run only if a checkpoint exists to resume."""
    from .records.checkpoint import latest_checkpoint

    folder = resume if resume is not None else (Path(cfg.out) if cfg.out else None)
    last = latest_checkpoint(folder) if folder is not None else None
    if last is not None:
        return Interrupted(f"interrupted; continue from checkpoint {last.name} with:\n"
                           f"rldsl run --resume {folder}")
    if folder is not None:
        return Interrupted(f"interrupted before the first checkpoint of {folder}; "
                           f"`rldsl run --resume {folder}` starts it again from step 0 with its saved config")
    return Interrupted("interrupted")


@reports_errors
def run_command(
    spec: Annotated[Optional[str], typer.Argument(
        metavar="SPEC", show_default=False,
        help="Spec file (algorithms/grpo.rl) or library name (grpo); with --resume, "
             "defaults to the run's saved spec.rl.")] = None,
    config: Annotated[Optional[Path], typer.Option(
        "--config", "-c", metavar="FILE", help="TOML config file (or a saved config.json).")] = None,
    set_: Annotated[Optional[list[str]], set_option(
        "Override one config key, e.g. --set train.lr=1e-4 (repeatable; applied after --config, in order).")] = None,
    model: Annotated[Optional[str], typer.Option(
        "--model", metavar="DIR", help="Policy model folder or hub id (model.path); "
                                       "default: the embedded toy model.")] = None,
    data: Annotated[Optional[str], typer.Option(
        "--data", metavar="FILE", help="Training prompts, .jsonl/.json/.parquet or a datasets "
                                       "folder (data.path); default: the built-in addition task.")] = None,
    reward: Annotated[Optional[str], shared_option("--reward", "the task's own")] = None,
    tools: Annotated[Optional[str], shared_option("--tools", "none (single-turn completions)")] = None,
    env: Annotated[Optional[str], shared_option("--env", "none")] = None,
    agent: Annotated[Optional[str], typer.Option(
        "--agent", metavar="MOD:FN", help="An agent program, async def agent(client, row) -> reward, "
                                          "run once per sample against the policy's OpenAI-compatible "
                                          "endpoint (rollout.agent; docs/agents.md).")] = None,
    steps: Annotated[Optional[int], typer.Option(
        "--steps", metavar="N", help="Training steps (train.steps).")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", metavar="S", help="Random seed.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        "--out", metavar="DIR", help="Run folder; default runs/<spec>-<timestamp>.")] = None,
    device: Annotated[Optional[str], typer.Option(
        "--device", metavar="cpu|cuda", help="Training device.")] = None,
    resume: Annotated[Optional[Path], typer.Option(
        "--resume", metavar="DIR", help="Continue the run in DIR from its newest "
                                        "checkpoint, with its saved config.")] = None,
    restart: Annotated[bool, typer.Option(
        "--restart", help="With --resume DIR: start that run again from step 0 with its saved "
                          "config, whatever its checkpoints; its records and checkpoints are moved "
                          "to DIR/previous/N, not deleted.")] = False,
    trainers: Annotated[Optional[int], typer.Option(
        "--trainers", metavar="N", min=1,
        help="Trainer ranks (FSDP2 over Ray actors; distributed.trainers); may differ on "
             "--resume.")] = None,
    rollout_workers: Annotated[Optional[int], typer.Option(
        "--rollout-workers", metavar="M", min=0,
        help="Rollout actors, each with an engine and the reward "
             "(distributed.rollout_workers).")] = None,
    gpus_per_worker: Annotated[Optional[float], typer.Option(
        "--gpus-per-worker", metavar="G", min=0.0,
        help="GPUs per rollout actor (distributed.gpus_per_worker).")] = None,
    ray_address: Annotated[Optional[str], typer.Option(
        "--ray-address", metavar="ADDR",
        help="Join this Ray cluster (distributed.ray_address); default: a local one when "
             "the run needs Ray.")] = None,
    tensorboard: Annotated[Optional[bool], typer.Option(
        "--tensorboard/--no-tensorboard", help="Also write TensorBoard events "
                                               "(log.tensorboard).", show_default=False)] = None,
    traceback: Annotated[bool, typer.Option(
        "--traceback", help="Show Python tracebacks on errors.")] = False,
) -> None:
    """Train a policy with the algorithm in SPEC.

    Config precedence, lowest to highest: defaults, --config FILE, --set KEY=VALUE, then the dedicated flags (--model, --data, --reward, --tools, --env, --agent, --steps, --seed, --out, --device, --tensorboard, --trainers, --rollout-workers, --gpus-per-worker, --ray-address).

    With --trainers N > 1, --rollout-workers M > 0 or --ray-address, the run scales out on Ray: N FSDP2 trainer ranks and M rollout actors, the same spec and step.
    """  # noqa: E501 - one line per paragraph: typer rewraps it
    flags = {"model.path": model, "data.path": data, "reward.name": reward,
             "rollout.tools": tools, "rollout.env": env, "rollout.agent": agent,
             "train.steps": steps, "seed": seed, "out": str(out) if out is not None else None,
             "device": device, "log.tensorboard": tensorboard,
             "distributed.trainers": trainers, "distributed.rollout_workers": rollout_workers,
             "distributed.gpus_per_worker": gpus_per_worker, "distributed.ray_address": ray_address}
    if restart and resume is None:
        raise ConfigError("--restart starts a run folder again from step 0: give the folder with "
                          "--resume DIR")
    spec, cfg = build_run_config(spec, config=config, overrides=set_, resume=resume, flags=flags)
    try:
        from .run.loop import train
    except ImportError as exc:  # a broken install: a failure (1), not the user's input
        raise RuntimeError("the training loop (rldsl.runtime.run.loop) is not part of this install "
                           f"({exc})") from exc

    try:
        train(spec, cfg, resume=resume, restart=restart)
    except KeyboardInterrupt:
        if traceback:
            raise
        raise _interrupted(cfg, resume) from None


@reports_errors
def plot_command(
    runs: Annotated[list[Path], typer.Argument(
        metavar="RUN...", help="Run folders (or their metrics.jsonl files) to overlay.")],
    out: Annotated[Optional[Path], typer.Option(
        "--out", "-o", metavar="PNG", help="Output PNG; default <run>/curves.png for one "
                                           "run, ./curves.png for several.")] = None,
    smooth: Annotated[float, typer.Option(
        "--smooth", metavar="W", help="Exponential moving average weight in [0, 1) "
                                      "(0 = raw values).")] = 0.0,
    perf: Annotated[bool, typer.Option(
        "--perf", help="Also draw the update's tokens/s, perf/padding_ratio and perf/mfu.")] = False,
) -> None:
    """Plot reward, held-out accuracy, response length, entropy and clip fraction of runs."""
    from .records.plot import plot_runs

    try:
        path = plot_runs(runs, out, smooth=smooth, perf=perf)
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    typer.echo(str(path))


@reports_errors
def samples_command(
    run: Annotated[Path, typer.Argument(metavar="RUN", help="A run folder (or its samples.jsonl).")],
    step: Annotated[Optional[int], typer.Option(
        "--step", metavar="N", help="The step to show; default the last one.")] = None,
    width: Annotated[int, typer.Option(
        "--width", metavar="CHARS", help="Characters of prompt and completion shown "
                                         "(their ends; 0 = all).")] = 200,
) -> None:
    """Show the samples of a step: prompt as fed to the model, completion, reward, advantage."""
    from rich.console import Console
    from rich.table import Table

    from .records.samples import read_samples

    try:
        n, rows = read_samples(run, step)
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from None

    def cut(text: str) -> str:
        return text if not width or len(text) <= width else "..." + text[-width:]

    episodes = any("messages" in r for r in rows)
    table = Table(title=f"step {n}", show_lines=True,
                  caption="episode: * = an assistant turn, trained on (loss mask 1); the other messages "
                          "(prompt, tool results) carry mask 0" if episodes else None)
    for col in ("group", "prompt", "episode" if episodes else "completion", "reward", "advantage", "finish",
                "tokens"):
        table.add_column(col, overflow="fold")
    for r in rows:
        reward = "failed" if r["reward"] is None else f"{r['reward']:.3g}"
        advantage = "-" if r["advantage"] is None else f"{r['advantage']:+.3f}"
        if "messages" in r:
            turns = [m for m in r["messages"] if m.get("role") not in ("system", "user", "prompt")] or r["messages"]
            shown = "\n".join(("* " if m.get("trained") else "  ") + f"[{m.get('role')}"
                               + (f" {m['name']}" if m.get("name") else "") + f"] {cut(_message_text(m))}"
                               for m in turns)
            tokens = f"{r.get('trained_tokens', r['response_length'])} + {r.get('environment_tokens', 0)} env"
            agent = r.get("agent")
            if agent:  # rollout.agent: which of the episode's rows this is, its calls, its error
                shown += (f"\n  (agent: row {agent['row'] + 1} of {max(1, agent['rows'])}"
                          + (", padding" if agent["padding"] else "")
                          + f", {len(agent['calls'])} calls, {agent['prefix_breaks']} prefix breaks"
                          + "".join(f", policy version {v}" for v in sorted({c["version"] for c in agent["calls"]}))
                          + (f"; error: {agent['error']}" if agent["error"] else "") + ")")
        else:
            shown, tokens = cut(r["completion"]), str(r["response_length"])
        prompt = cut(r["prompt"]) + "".join(f"\n(image: {_image_ref(ref)})" for ref in r.get("images") or [])
        table.add_row(str(r["group"]), prompt, shown, reward, advantage, r["finish_reason"], tokens)
    Console(width=max(120, Console().width)).print(table)


def _image_ref(ref: str) -> str:
    """An image of a sample as `rldsl samples` shows it: its path, or a data: URL's kind and size
    (not its base64 text)."""
    if ref.startswith("data:"):
        return f"{ref.split(';', 1)[0].split(',', 1)[0]} URL, {len(ref)} characters"
    return ref


def _message_text(m: dict) -> str:
    """A message's text for `rldsl samples`: its content, then its tool calls as name(arguments)."""
    text = str(m.get("content") or "")
    for tc in m.get("tool_calls") or []:
        f = tc.get("function", tc)
        args = f.get("arguments")
        text += f" {f.get('name')}({args if isinstance(args, str) else json.dumps(args)})"
    return text.strip()


@reports_errors
def export_command(
    run: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="A run folder.")],
    out: Annotated[Path, typer.Option("--out", "-o", metavar="DIR", help="The folder to write.")],
    step: Annotated[Optional[int], typer.Option(
        "--step", metavar="N", help="The checkpoint's step; default the newest.")] = None,
) -> None:
    """Write a checkpoint's policy as a plain Hugging Face folder (LoRA merged, tokenizer included)."""
    from .records.export import export_run

    path = export_run(run, out, step)  # a RunError (bad folder or step) exits 2
    typer.echo(str(path))


@reports_errors
def reward_command(
    name: Annotated[str, typer.Argument(
        metavar="NAME", show_default=False,
        help="Reward: a built-in (math, gsm8k, exact, addition), module:function (the current folder "
             "first), path/to/file.py:function, with options (math(allow_truncated=true)) or a weighted "
             "sum (math=0.9,pkg.mod:fn=0.1).")],
    completion: Annotated[str, typer.Option(
        "--completion", metavar="TEXT", show_default=False, help="The model's completion.")],
    answer: Annotated[str, typer.Option(
        "--answer", metavar="TEXT", show_default=False, help="The reference answer (the data's answer column).")],
    prompt: Annotated[Optional[str], typer.Option(
        "--prompt", metavar="TEXT",
        help="The row's prompt as a reward receives it in a run: the original, before the chat "
             "template (default: empty).")] = None,
    finish_reason: Annotated[str, typer.Option(
        "--finish-reason", metavar="stop|length",
        help="Why generation ended: 'stop' (EOS) or 'length' (cut off at max_new_tokens).")] = "stop",
    task: Annotated[Optional[str], typer.Option(
        "--task", metavar="NAME",
        help="reasoning_gym: the reasoning-gym task whose verifier scores the row (--prompt: its "
             "question).")] = None,
    traceback: Annotated[bool, typer.Option(
        "--traceback", help="Show Python tracebacks on errors.")] = False,
) -> None:
    """Print the reward a verifier gives one completion (and, for math/gsm8k, the answer it found and why)."""
    from .rewards.cli import show_reward

    show_reward(name, completion, answer, prompt, finish_reason, traceback, task)


@reports_errors
def serve_reward_command(
    reward: Annotated[str, typer.Argument(help="The reward to serve: a --reward string "
                                               "(built-in, module:function, path.py:function, weights).")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    timeout_s: Annotated[float, typer.Option(help="Seconds a per-sample reward call may take (in a worker "
                                                  "process, killed past it: that sample's reward is null); "
                                                  "0 = no limit. The run's reward.timeout_s.")] = 30.0,
) -> None:
    """Serve a reward function over HTTP (POST /score, OpenRLHF's POST /get_reward, GET /health),
    for `--reward http://HOST:PORT/score`."""
    from .rewards.server import serve

    serve(reward, host, port, timeout_s)


@reports_errors
def serve_tinker_command(
    model: Annotated[Optional[list[str]], typer.Option(
        "--model", metavar="NAME=PATH", help="A base model to serve: the name clients give (e.g. "
        "Qwen/Qwen3-8B-Base) and a local HF folder, or toy:arithmetic-chat (a tiny model warm-started on "
        "the cookbook's arithmetic recipe, docs/tinker.md); repeat for several. Default: the embedded tiny "
        "model as rldsl/toy.")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on (not loopback: --api-key is required).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", metavar="KEY", help="The only key accepted (X-API-Key); default: any key.")] = None,
    out: Annotated[Path, typer.Option("--out", metavar="DIR",
                                      help="Where save_weights writes its checkpoints.")] = Path("tinker_states"),
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch's CPU threads (as a run's `threads`).")] = 1,
    engine: Annotated[str, typer.Option("--engine", metavar="hf|vllm", help="What samples asample requests: hf "
                                        "(rldsl's own loop on the HF model) or vllm (rldsl's vLLM engine, float32, "
                                        "each sampler's weights synced in; needs vLLM: make setup-vllm). The trainer "
                                        "is HF either way.")] = "hf",
    vllm_memory: Annotated[float, typer.Option("--vllm-memory", metavar="FRACTION", help="--engine vllm: the share "
                                               "of GPU memory (on CPU: of RAM) each vLLM engine reserves "
                                               "(gpu_memory_utilization).")] = 0.1,
) -> None:
    """Serve the Tinker training API (tinker 0.38's client, tinker-cookbook's recipes) on rldsl's
    trainer, sampler and losses; any spec is a loss (docs/tinker.md)."""
    from .tinker.models import check_address, check_engine, served_models

    check_address(host, api_key)  # the options first: torch and the models load after
    check_engine(engine, vllm_memory)
    models = served_models(model or [], vllm=engine == "vllm")
    from .tinker.server import serve

    serve(models, host, port, api_key, out, threads, engine, vllm_memory)


@reports_errors
def eval_command(
    target: Annotated[Path, typer.Argument(metavar="RUN_OR_MODEL",
                                           help="A run folder (its newest checkpoint) or a Hugging Face model folder.")],
    data: Annotated[list[Path], typer.Option("--data", metavar="FILE",
                                             help="An evaluation set (.jsonl, .parquet, .json, a datasets "
                                                  "folder); repeat for several.")],
    reward: Annotated[Optional[str], shared_option("--reward", "the run's (a model folder: exact), for every set")] = None,
    n: Annotated[int, typer.Option("--n", min=0, help="Samples per prompt for pass@k (0: greedy only).")] = 8,
    temperature: Annotated[Optional[float], typer.Option(
        "--temperature", min=0.0, help="Sampling temperature; default: the run's rollout.temperature, else 1.")] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", help="Top-p; default: the run's, else 1.")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(
        "--max-new-tokens", min=1, help="Default: the run's rollout.max_new_tokens, else 256.")] = None,
    step: Annotated[Optional[int], typer.Option("--step", metavar="N",
                                                help="A run's checkpoint step; default the newest.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampled answers.")] = 0,
    out: Annotated[Optional[Path], typer.Option("--out", metavar="FILE",
                                                help="Also write the metrics as JSON.")] = None,
    tools: Annotated[Optional[str], shared_option("--tools", "the run's rollout.tools")] = None,
    env: Annotated[Optional[str], shared_option("--env", "the run's rollout.env")] = None,
) -> None:
    """Evaluate a checkpoint or a model on data sets without training: greedy accuracy, pass@1 and
    pass@k (unbiased), mean reward, length and truncation rate per set. A run with tools or an
    environment is evaluated as it trained: in multi-turn episodes (its rollout.* settings)."""
    from .run.eval_command import evaluate_target

    evaluate_target(target, data, reward, n, temperature, top_p, max_new_tokens, step, seed, out, tools, env)


@reports_errors
def ablate_command(
    base: Annotated[Optional[str], typer.Argument(
        metavar="BASE", show_default=False,
        help="The base spec: a file (algorithms/grpo.rl) or a library name (lite_ppo).")] = None,
    vary: Annotated[Optional[list[str]], typer.Option(
        "--vary", "-v", metavar="\"SLOT: ALT | ALT\"",
        help="An axis: a slot and its alternatives, e.g. \"normalizer: group_std | none\"; "
             "label one with \"name = component(...)\"; slot 'algorithm' takes whole specs "
             "(\"algorithm: grpo | dapo\"). Repeatable.")] = None,
    one_at_a_time: Annotated[Optional[bool], typer.Option(
        "--one-at-a-time/--full-grid",
        help="Toggle each alternative against the base alone (plus the base itself), or "
             "run every combination of the axes (the default).", show_default=False)] = None,
    seeds: Annotated[Optional[int], typer.Option(
        "--seeds", metavar="N", min=1, help="Seeds 0..N-1 per variant (default 3).")] = None,
    steps: Annotated[Optional[int], typer.Option(
        "--steps", metavar="S", min=1, help="Training steps of every cell (default: "
                                            "train.steps of the run config).")] = None,
    set_: Annotated[Optional[list[str]], set_option(
        "Run-config override for every cell, as in rldsl run (repeatable).")] = None,
    jobs: Annotated[Optional[int], typer.Option(
        "--jobs", "-j", metavar="J", min=1,
        help="Cells run at once (default: the machine's cores, or the Ray cluster's CPUs); "
             "each cell uses one thread.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        "--out", metavar="DIR", help="Study folder; default studies/<name>-<hash of the "
                                     "grid>, so the same command finds it again.")] = None,
    grid: Annotated[Optional[Path], typer.Option(
        "--grid", metavar="FILE", help="A TOML grid file (keys base, vary, one_at_a_time, "
                                       "seeds, steps, set, threshold, jobs, name, "
                                       "ray_address); flags override it, --set adds to it.")] = None,
    threshold: Annotated[Optional[float], typer.Option(
        "--threshold", metavar="ACC", help="Held-out greedy accuracy for the 'steps to "
                                           "threshold' column (default 0.5); also with "
                                           "--report.")] = None,
    ray_address: Annotated[Optional[str], typer.Option(
        "--ray-address", metavar="ADDR", help="Run the cells as Ray tasks on this cluster "
                                              "('auto', 'ray://head:10001', or 'local').")] = None,
    report: Annotated[Optional[Path], typer.Option(
        "--report", metavar="DIR", help="Only rebuild the report of the study in DIR from "
                                        "its finished runs.")] = None,
    traceback: Annotated[bool, typer.Option(
        "--traceback", help="Show Python tracebacks on errors.")] = False,
) -> None:
    """Run an ablation study: variants of BASE x seeds, in parallel, then a report.

    Every variant is written to DIR/cells/<variant>.rl, a plain spec that extends BASE (rldsl run it from anywhere); each cell runs as `rldsl run` in DIR/runs/<variant>-s<seed>. Running the same command again skips finished cells and resumes interrupted ones from their checkpoints; a failing cell is reported and the others go on (exit code 1).

    The report: DIR/report.md (per variant: final and best held-out accuracy and reward, mean ± std over seeds, steps to the threshold, length, entropy, the diff against BASE), DIR/figures/*.png (a band over seeds per variant) and DIR/results.csv.
    """  # noqa: E501 - one line per paragraph: typer rewraps it
    from .ablate import ablate

    ablate(base, vary, one_at_a_time, seeds, steps, set_, jobs, out, grid, threshold, ray_address, report,
           traceback)


def register(app: typer.Typer) -> None:
    """Add the ``run``, ``plot``, ``samples``, ``export``, ``reward``, ``serve-reward``, ``serve-tinker``, ``eval`` and
    ``ablate`` commands. Registering imports nothing of the runtime but this module: each command
    imports what it runs in its body, so that ``rldsl --help``, ``check`` or ``list`` start
    without torch's model stack (tests/test_cli_startup.py)."""
    app.command("run")(run_command)
    app.command("plot")(plot_command)
    app.command("samples")(samples_command)
    app.command("export")(export_command)
    app.command("reward")(reward_command)
    app.command("serve-reward")(serve_reward_command)
    app.command("serve-tinker")(serve_tinker_command)
    app.command("eval")(eval_command)
    app.command("ablate")(ablate_command)
