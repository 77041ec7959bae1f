"""Write constraints/cpu.txt from a venv that resolved the project's requirements freshly.

Usage (what `make pin` runs): ``python constraints/pin.py VENV constraints/cpu.txt``.
Keeps the file's comment header, pins every installed distribution but the project itself,
and writes torch without its local tag (``torch==2.13.0`` selects the ``+cpu`` wheel that the
machine's wheel directory holds; the tag is not on PyPI's index).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main(venv: str, out: str) -> None:
    frozen = subprocess.run([str(Path(venv) / "bin" / "pip"), "freeze", "--all", "--exclude-editable"],
                            check=True, capture_output=True, text=True).stdout.splitlines()
    pins = []
    for line in frozen:
        if "==" not in line or line.startswith(("-e", "#")):
            continue
        name, version = line.split("==", 1)
        if name.lower() in ("rldsl", "pip"):  # pip is the installer, upgraded first
            continue
        pins.append(f"{name}=={version.split('+', 1)[0] if name.lower() == 'torch' else version}")
    path = Path(out)
    header = [ln for ln in path.read_text().splitlines() if ln.startswith("#")] if path.exists() else []
    path.write_text("\n".join(header + sorted(pins, key=str.lower)) + "\n")
    print(f"{out}: {len(pins)} pins")


if __name__ == "__main__":
    main(*sys.argv[1:3])
