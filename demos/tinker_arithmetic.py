"""tinker-cookbook's arithmetic recipe learning on CPU against ``rldsl serve-tinker`` (docs/tinker.md,
"A CPU demo: the cookbook's arithmetic recipe learns").

    python demos/tinker_arithmetic.py [--root runs/tinker_arithmetic] [--seeds 0 1 2] [--steps 40]
                                      [--minutes 5] [--plot docs/tinker_arithmetic.png] [--parallel] [--table]

1. The model: ``toy:arithmetic-chat`` (runtime/tinker/arithmetic_chat.py), the embedded toy's
   shape warm-started briefly on the recipe's own prompts as its role_colon renderer writes them
   (minutes, once, then cached): it writes the format and adds right on a minority of problems.
2. Per seed: ``rldsl serve-tinker --model Qwen/Qwen3-8B-Base=toy:arithmetic-chat`` on a free
   127.0.0.1 port, and the unchanged ``python -m tinker_cookbook.recipes.math_rl.train
   env=arithmetic ...`` (``RECIPE`` below) run from a folder where ``Qwen/Qwen3-8B-Base`` is that
   model's folder (the client and the cookbook resolve the name to it, offline), stopped after
   ``--steps`` steps or ``--minutes``, whichever comes first.
3. The recipe's own ``metrics.jsonl``: ``env/all/reward/total`` (and ``env/all/correct``) per step,
   a table per seed and a curve (``--plot``).

Runs already in ``--root`` are kept (``--table`` only reads them); each child process is niced.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rldsl.runtime.tinker.arithmetic_chat import MAX_TOKENS, arithmetic_chat_model
from rldsl.runtime.tinker.models import MODEL_REF

NAME = "Qwen/Qwen3-8B-Base"  # a name the cookbook maps to its role_colon renderer
REWARD, CORRECT = "env/all/reward/total", "env/all/correct"
#: the recipe's settings: 16 problems x 8 samples a step; answers are " 058+067=125\n\nUser:" (19 tokens)
RECIPE = ["env=arithmetic", "group_size=8", "groups_per_batch=16", f"max_tokens={MAX_TOKENS}", "lora_rank=8",
          "eval_every=0", "save_every=0", "behavior_if_log_dir_exists=delete"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_open(port: int, server: subprocess.Popen, seconds: float = 600) -> None:
    """Until the server accepts connections (its imports and the model load take minutes on a
    loaded 2-core machine), or it exits, or ``seconds`` pass."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if server.poll() is not None:
            raise SystemExit(f"serve-tinker exited with {server.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"serve-tinker did not open port {port} in {seconds:.0f} s")


def home_folder(root: Path) -> Path:
    """``root/home/Qwen/Qwen3-8B-Base`` -> the warm-started model's folder."""
    link = root / "home" / NAME
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(arithmetic_chat_model(verbose=True))
    return root / "home"


def run_seed(root: Path, seed: int, steps: int, minutes: float, lr: float) -> Path:
    """Serve the model and run the recipe for one seed; the recipe's log folder."""
    home, log = home_folder(root), root / f"seed{seed}"
    port = free_port()
    env = {**os.environ, "TINKER_API_KEY": "tml-local", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    server = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", "from rldsl.cli import app; app()",
                               "serve-tinker", "--model", f"{NAME}={MODEL_REF}", "--port", str(port),
                               "--out", str(root / f"states{seed}")], env=env,
                              stdout=subprocess.DEVNULL, stderr=open(root / f"server{seed}.log", "w"))
    try:
        wait_open(port, server)
        cmd = ["nice", "-n", "10", sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train",
               f"base_url=http://127.0.0.1:{port}", f"model_name={NAME}", *RECIPE, f"learning_rate={lr}", f"seed={seed}",
               f"max_steps={steps}", f"log_path={log.resolve()}"]
        print("$", " ".join(cmd[3:]), flush=True)
        t0 = time.monotonic()
        try:
            subprocess.run(cmd, cwd=home, env=env, timeout=minutes * 60, check=False,
                           stdout=subprocess.DEVNULL, stderr=open(root / f"recipe{seed}.log", "w"))
        except subprocess.TimeoutExpired:
            print(f"seed {seed}: stopped at {minutes} min", flush=True)
        (log / "wall.json").write_text(json.dumps({"seconds": round(time.monotonic() - t0, 1)}))
    finally:
        server.terminate()
        server.wait(timeout=60)
    return log


def read_rows(log: Path) -> list[dict]:
    """The recipe's own metrics rows that have a reward, in step order."""
    path = log / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [r for r in rows if REWARD in r]


def carry_split(log: Path, step: int) -> list[list[float]] | None:
    """[correct samples, samples] on the step's problems that need no carry, then on those that
    need one, from
    the recipe's own per-sample records of that step (``iteration_*/train_rollout_summaries.jsonl``)
    and its own problem generator: the batches differ in how many problems carry (every seed sees
    the same ones), so the reward per step moves with that mix; the carrying rate is what RL must
    raise here."""
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDataset
    from rldsl.runtime.toy.task import carry_free_sum

    path = log / f"iteration_{step:06d}" / "train_rollout_summaries.jsonl"
    if not path.is_file():
        return None
    problems = [g.env_thunk.args[:2] for g in ArithmeticDataset(16, None, 8).get_batch(step)]  # type: ignore[arg-type]
    counts = [[0.0, 0.0], [0.0, 0.0]]
    for line in path.read_text().splitlines():
        row = json.loads(line)
        x, y = problems[row["group_idx"]]
        kind = counts[carry_free_sum(x, y) != str(x + y)]
        kind[0] += row["steps"][0]["metrics"]["correct"]
        kind[1] += 1
    return counts


def table(logs: dict[int, Path], every: int) -> str:
    runs = {seed: read_rows(log) for seed, log in logs.items()}
    n = min((len(r) for r in runs.values()), default=0)
    head = ("| steps | " + " | ".join(f"seed {s}: reward (correct)" for s in runs)
            + " | mean reward | mean correct, no carry / carry |")
    lines = [head, "|" + "---|" * (len(runs) + 3)]
    for start in range(0, n, every):
        cells, means = [], []
        for rows in runs.values():
            chunk = rows[start:min(start + every, n)]
            reward = sum(r[REWARD] for r in chunk) / len(chunk)
            correct = sum(r.get(CORRECT, 0.0) for r in chunk) / len(chunk)
            cells.append(f"{reward:.3f} ({correct:.3f})")
            means.append(reward)
        split = [c for log in logs.values() for i in range(start, start + len(chunk))
                 if (c := carry_split(log, i)) is not None]
        plain, carry = (sum(c[k][0] for c in split) / max(sum(c[k][1] for c in split), 1) for k in (0, 1))
        lines.append(f"| {start}-{start + len(chunk) - 1} | " + " | ".join(cells)
                     + f" | {sum(means) / len(means):.3f} | {plain:.2f} / {carry:.2f} |")
    walls = [json.loads((log / "wall.json").read_text())["seconds"] for log in logs.values()
             if (log / "wall.json").is_file()]
    lines.append(f"\n{n} steps per seed in common; wall seconds per seed: {walls}")
    return "\n".join(lines)


def plot(logs: dict[int, Path], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for seed, log in logs.items():
        rows = read_rows(log)
        ax.plot([r["progress/batch"] for r in rows], [r[REWARD] for r in rows], label=f"seed {seed}", alpha=0.8)
    ax.set_xlabel("recipe step (16 problems x 8 samples)")
    ax.set_ylabel(REWARD)
    ax.set_title("math_rl.train env=arithmetic on rldsl serve-tinker (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("runs/tinker_arithmetic"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--lr", type=float, default=5e-4,
                        help="the recipe's learning_rate (its default, 1e-5, is for an 8B model's LoRA; "
                             "3e-3 broke this model's format within 4 steps)")
    parser.add_argument("--every", type=int, default=5, help="steps per row of the table")
    parser.add_argument("--plot", type=Path, default=None, help="write the reward curves here (PNG)")
    parser.add_argument("--table", action="store_true", help="only read the runs already in --root")
    parser.add_argument("--parallel", action="store_true", help="run the seeds at the same time")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    logs = {seed: args.root / f"seed{seed}" for seed in args.seeds}
    if not args.table:
        home_folder(args.root)  # the warm start, once, before any seed
        todo = [seed for seed, log in logs.items() if not read_rows(log)]
        with ThreadPoolExecutor(len(todo) if args.parallel and todo else 1) as pool:
            list(pool.map(lambda seed: run_seed(args.root, seed, args.steps, args.minutes, args.lr), todo))
    print(table(logs, args.every))
    if args.plot:
        plot(logs, args.plot)


if __name__ == "__main__":
    main()
