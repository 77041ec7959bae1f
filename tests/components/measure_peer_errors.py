"""Print the table of docs/peers.md: for every peer option in peer_cases.py, the spec lines that
reproduce it and the largest error measured against the independent reference (peer_refs.py).

    RLDSL_COMPILE=0 .venv/bin/python tests/components/measure_peer_errors.py [--seeds 10]

Losses: float64, error relative to max(1, |value|) for the loss and to max(1, max|grad|) for the
gradient wrt log pi. Advantages: through estimate() (float32), absolute error on response tokens.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_cases import (ADV_CASES, LOSS_CASES, NOT_EXPRESSIBLE, loss_batch, reward_batch, run_adv,  # noqa: E402
                        run_loss)


def _spec(text: str) -> str:
    return "<br>".join(f"`{line.strip()}`" for line in text.splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10)
    args = ap.parse_args(argv)
    print("| peer | option | spec lines | max error: loss | max error: d/d log pi |")
    print("|---|---|---|---|---|")
    for c in LOSS_CASES:
        e_loss = e_grad = 0.0
        for seed in range(args.seeds):
            ours, ref, g, g_ref = run_loss(c, loss_batch(seed))
            e_loss = max(e_loss, abs(ours.item() - ref.item()) / max(1.0, abs(ref.item())))
            e_grad = max(e_grad, (g - g_ref).abs().max().item() / max(1.0, g_ref.abs().max().item()))
        print(f"| {c.peer} | {c.option} | {_spec(c.spec)} | {e_loss:.1e} | {e_grad:.1e} |")
    print()
    print("| peer | option | spec lines | group sizes | max error: advantages (float32) |")
    print("|---|---|---|---|---|")
    for c in ADV_CASES:
        err = 0.0
        for G in c.group_sizes:
            for seed in range(args.seeds):
                ours, ref = run_adv(c, reward_batch(seed, G))
                err = max(err, (ours - ref).abs().max().item())
        sizes = ", ".join(map(str, c.group_sizes))
        print(f"| {c.peer} | {c.option} | {_spec(c.spec)} | {sizes} | {err:.1e} |")
    print()
    print("| peer | option | not expressible: why |")
    print("|---|---|---|")
    for peer, option, why in NOT_EXPRESSIBLE:
        print(f"| {peer} | {option} | {why} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
