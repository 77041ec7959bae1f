"""Wall time of the language commands (`rldsl --help`, list, check, explain, translate) and of
`rldsl run` rejecting a typo (a missing data file, an unknown reasoning-gym task, an agent that
does not import, a missing teacher folder, the reasoning_gym reward on other data, an unknown
config key, a data file with a bad line, a reward function of the wrong signature, prompts with
images for the text model, an --out folder that holds a run: each exits 2 before torch or
transformers load, issue 57 asks at most 1.5 s of those), each the best of N fresh processes,
beside Python's own start and `import torch` for scale.

    .venv/bin/python bench/cli_startup.py            # 7 runs of each
    .venv/bin/python bench/cli_startup.py --runs 15 --json cli.json

The best of N is what an idle machine gives; a busy one only adds to it. The first run of each
command is dropped (it writes the bytecode caches and the grammar tables: rldsl/parse_tables.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RLDSL = [sys.executable, "-m", "rldsl.cli"]

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "rldsl --help": RLDSL + ["--help"],
    "rldsl list": RLDSL + ["list"],
    "rldsl check algorithms/grpo.rl": RLDSL + ["check", "algorithms/grpo.rl"],
    "rldsl explain algorithms/grpo.rl": RLDSL + ["explain", "algorithms/grpo.rl"],
    "rldsl explain grpo dapo": RLDSL + ["explain", "grpo", "dapo"],
    "rldsl translate tests/translate/trl_grpo.yaml": RLDSL + ["translate", "tests/translate/trl_grpo.yaml"],
}

#: `rldsl run` with a typo, exit code 2 (the run folder, never made, is under a temporary folder)
TYPOS = {
    "rldsl run grpo --data nosuch.jsonl": ["grpo", "--data", "nosuch.jsonl"],
    "rldsl run grpo --data reasoning_gym:spel_backward": ["grpo", "--data", "reasoning_gym:spel_backward"],
    "rldsl run grpo --agent nosuch_agent:agent": ["grpo", "--agent", "nosuch_agent:agent"],
    "rldsl run gkd --set teacher.path=nosuch_teacher": ["gkd", "--set", "teacher.path=nosuch_teacher"],
    "rldsl run grpo --reward reasoning_gym --data rows.jsonl": ["grpo", "--reward", "reasoning_gym", "--data",
                                                                "{tmp}/rows.jsonl"],
    # issue 57: a config, data, reward, image and --out error each
    "rldsl run grpo --set train.nosuch=1 (config)": ["grpo", "--set", "train.nosuch=1"],
    "rldsl run grpo --data bad.jsonl (a bad line)": ["grpo", "--data", "{tmp}/bad.jsonl"],
    "rldsl run grpo --reward reward.py:two (signature)": ["grpo", "--data", "{tmp}/rows.jsonl", "--reward",
                                                          "{tmp}/reward.py:two"],
    "rldsl run grpo --data images.jsonl (text model)": ["grpo", "--data", "{tmp}/images.jsonl"],
    "rldsl run grpo --out DIR (holds a run)": ["grpo", "--out", "{tmp}/occupied"],
}


def write_inputs(tmp: Path) -> None:
    """The files the typos read: good rows, a bad line, a reward of two parameters, rows whose
    prompts hold an image (a PNG beside them), a folder holding a run's metrics."""
    from PIL import Image

    row = '{"prompt": "1+1=", "answer": "2"}\n'
    (tmp / "rows.jsonl").write_text(row, encoding="utf-8")
    (tmp / "bad.jsonl").write_text(row + '{"prompt": "2+2=", "answer": \n', encoding="utf-8")
    (tmp / "reward.py").write_text("def two(prompt, completion):\n    return 1.0\n", encoding="utf-8")
    Image.new("RGB", (28, 28), (200, 30, 30)).save(tmp / "red.png")
    image_row = {"prompt": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                                         {"type": "text", "text": "Which colour?"}]}],
                 "answer": "red"}
    (tmp / "images.jsonl").write_text(json.dumps(image_row) + "\n", encoding="utf-8")
    (tmp / "occupied").mkdir()
    (tmp / "occupied" / "metrics.jsonl").write_text('{"step": 0}\n', encoding="utf-8")


def wall(cmd: list[str], env: dict[str, str], code: int = 0) -> float:
    t = time.perf_counter()
    rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    elapsed = time.perf_counter() - t
    if rc != code:
        raise SystemExit(f"{' '.join(cmd)}: exit code {rc}, expected {code}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as a user's machine runs it: bytecode is cached
    results = {}
    print(f"{'command':<62} {'best s':>7} {'median s':>9}")
    tmp = Path(tempfile.mkdtemp(prefix="cli_startup-"))
    write_inputs(tmp)
    out = tmp / "run"
    commands = {name: (cmd, 0) for name, cmd in COMMANDS.items()}
    commands.update({name: (RLDSL + ["run", *[x.format(tmp=tmp) for x in a],
                                     *([] if "--out" in a else ["--out", str(out)])], 2)
                     for name, a in TYPOS.items()})
    for name, (cmd, code) in commands.items():
        wall(cmd, env, code)  # warm: bytecode, grammar tables, reasoning-gym's task names, the page cache
        times = sorted(wall(cmd, env, code) for _ in range(args.runs))
        if out.exists():
            raise SystemExit(f"{name}: a rejected run made its folder {out}")
        if [p.name for p in (tmp / "occupied").iterdir()] != ["metrics.jsonl"]:
            raise SystemExit(f"{name}: a rejected run wrote into {tmp / 'occupied'}")
        results[name] = {"best_s": times[0], "median_s": times[len(times) // 2], "runs": times}
        print(f"{name:<62} {times[0]:7.3f} {times[len(times) // 2]:9.3f}", flush=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "loadavg": load}, indent=1))


if __name__ == "__main__":
    main()
