"""bench/ (benchmarks) and demos/ (docs figures and tables): each README's index names every file
of its folder, and every bench/ or demos/ path the docs, the Makefile and the scripts name exists.
Reads files only (no script runs)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ["bench", "demos"]
PATH = re.compile(r"(?<![\w/.-])(bench|demos)/[\w.-]+\.(?:py|sh|json|rl|md)\b")


def _index(folder: str) -> set[str]:
    """The paths in the first column of the README's first table (its index)."""
    text = (ROOT / folder / "README.md").read_text()
    table = re.search(r"(?m)^\|.*\|\n(?:^\|.*\|\n)*", text).group(0)
    return {m.group(1) for line in table.splitlines() if (m := re.match(r"\| `([^`]+)` \|", line))}


@pytest.mark.parametrize("folder", FOLDERS)
def test_readme_indexes_every_file(folder):
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*")  # subfolders' files too
             if p.is_file() and p.name != "README.md" and p.suffix != ".pyc" and "__pycache__" not in p.parts}
    index = _index(folder)
    assert not files - index, f"{folder}/README.md does not index {sorted(files - index)}"
    assert not index - files, f"{folder}/README.md indexes missing files {sorted(index - files)}"


def test_named_paths_exist():
    texts = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in FOLDERS:
        texts += sorted(p for p in (ROOT / folder).iterdir() if p.is_file())
    missing = {(str(t.relative_to(ROOT)), m.group(0)) for t in texts
               for m in PATH.finditer(t.read_text(errors="replace"))
               if not (ROOT / m.group(0)).exists()}
    assert not missing, f"paths named but absent: {sorted(missing)}"
