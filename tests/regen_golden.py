"""Regenerate the golden files the language tests compare against.

    python tests/regen_golden.py              # tests/golden/<algo>.py: generated code per library algorithm
    python tests/regen_golden.py --messages   # also tests/specs/bad*/*.expected: the rendered errors

Run it after an intended change to the templates, a component's parameters or an error
message, then read the diff (`git diff tests/golden tests/specs`) before committing: the
golden files are the review copy of what users will see.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
BAD = ROOT / "tests" / "specs" / "bad"
BAD_FORMULA = ROOT / "tests" / "specs" / "bad_formula"  # malformed formulas (define blocks)


def golden_source(name: str) -> str:
    """What ``tests/golden/<name>.py`` holds: the generated source of a library algorithm."""
    import rldsl

    return rldsl.compile(rldsl.load(name), compile=False).source


def bad_spec_files() -> list[Path]:
    """The numbered bad specs (helpers such as ``cycle_b.rl`` have no number and no .expected)."""
    return sorted(p for folder in (BAD, BAD_FORMULA) for p in folder.glob("*.rl") if p.name[:2].isdigit())


def rendered_error(path: Path) -> str:
    """What ``<path>.expected`` holds: the rendered SpecError, the path relative to the repo root.

    Must be called with the repo root as the working directory.
    """
    import rldsl

    rel = path.relative_to(ROOT).as_posix()
    try:
        rldsl.load(rel)
    except rldsl.SpecError as e:
        return e.render() + "\n"
    raise AssertionError(f"{rel} loads without an error; a bad spec must fail")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", action="store_true", help="also rewrite tests/specs/bad*/*.expected")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    import rldsl

    GOLDEN.mkdir(parents=True, exist_ok=True)
    names = sorted(rldsl.library())
    for stale in GOLDEN.glob("*.py"):
        if stale.stem not in names:
            stale.unlink()
            print(f"removed {stale.relative_to(ROOT)}")
    for name in names:
        out = GOLDEN / f"{name}.py"
        out.write_text(golden_source(name), encoding="utf-8", newline="\n")
        print(f"wrote {out.relative_to(ROOT)}")
    if args.messages:
        for path in bad_spec_files():
            out = path.with_suffix(".expected")
            out.write_text(rendered_error(path), encoding="utf-8", newline="\n")
            print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
