"""The import graph: the runtime and the language core (``rldsl/``) each import one way (no
cycle), nobody borrows another module's private names, and the language package never imports
the runtime (the runtime adds its CLI commands through the ``rldsl.commands`` entry point group).

Every import counts, wherever it stands: module level, inside a function, under
``if TYPE_CHECKING``. Importing ``a.b.c`` also runs the ``__init__`` of ``a.b``, so an
import reaches the target's parent packages too. Run this file as a script to print the
graph's cycles and private imports (``python tests/test_architecture.py``).
"""
from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUNTIME = ("rldsl.runtime", REPO / "runtime")
LANGUAGE = ("rldsl", REPO / "rldsl")
#: Language modules that import package modules inside functions: the CLI's commands import what
#: they run, so that `rldsl --help` starts fast. Anywhere else an import inside a function would
#: only hide a cycle (the cycle check counts it anyway).
#: language modules allowed an import that does not run at module level: the CLI (each command
#: imports what it runs) and lint (its annotations name spec.py's types under TYPE_CHECKING:
#: spec.py imports the parser and every component, which `rldsl check --help` -- lint's rule
#: table -- does not need)
LAZY_IMPORTS = {"rldsl.cli", "rldsl.lint"}


@dataclass(frozen=True)
class Import:
    """``module`` imports ``target`` (a module) at ``line``; ``names``: what ``from`` took."""

    module: str
    target: str
    line: int
    names: tuple[str, ...] = ()


def modules_of(package: str, folder: Path) -> dict[str, Path]:
    """Dotted module name -> file for every .py file of a package folder."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join([package, *parts])] = path
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """Every import statement of a module (any depth), resolved to absolute module names."""
    is_pkg = path.name == "__init__.py"
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = tuple(a.name for a in node.names)
            submodules = [n for n in names if f"{target}.{n}" in known]
            found += [Import(module, f"{target}.{n}", node.lineno) for n in submodules]
            rest = tuple(n for n in names if n not in submodules)
            if rest or not submodules:
                found.append(Import(module, target, node.lineno, rest))
    return found


def attribute_uses(path: Path, module_aliases: dict[str, str]) -> list[tuple[str, str, int]]:
    """``alias._name`` uses where ``alias`` is bound to a module: (module, name, line)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in module_aliases and _private(node.attr):
            out.append((module_aliases[node.value.id], node.attr, node.lineno))
    return out


def _aliases(path: Path, module: str, known: set[str]) -> dict[str, str]:
    """Local names bound to a package module by ``import x.y as z`` / ``from . import y``."""
    is_pkg = path.name == "__init__.py"
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known and a.asname:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            for a in node.names:
                if f"{target}.{a.name}" in known:
                    out[a.asname or a.name] = f"{target}.{a.name}"
    return out


def graph(package: str, folder: Path) -> tuple[dict[str, set[str]], list[Import], list[str]]:
    """(edges within the package, every import, private cross-module uses as messages)."""
    mods = modules_of(package, folder)
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    every: list[Import] = []
    private: list[str] = []
    for module, path in mods.items():
        rel = path.relative_to(REPO)
        for imp in imports_of(module, path, known):
            every.append(imp)
            if imp.target not in known:
                continue
            # importing a.b.c runs the __init__ of every package above it not yet running
            own = module.split(".")
            parts = imp.target.split(".")
            for k in range(len(package.split(".")) + 1, len(parts) + 1):
                target = ".".join(parts[:k])
                if target != module and target in known and parts[:k] != own[:k]:
                    edges[module].add(target)
            if imp.target == module:
                continue
            if _private(parts[-1]) and imp.target.rsplit(".", 1)[0] != module.rsplit(".", 1)[0]:
                private.append(f"{rel}:{imp.line}: imports private module {imp.target}")
            for name in imp.names:
                if _private(name):
                    private.append(f"{rel}:{imp.line}: imports {imp.target}.{name}")
        for target, name, line in attribute_uses(path, _aliases(path, module, known)):
            if target != module:
                private.append(f"{rel}:{line}: uses {target}.{name}")
    return edges, every, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def language_imports_of_runtime() -> list[str]:
    """Imports of the runtime from the language package (there must be none)."""
    package, folder = LANGUAGE
    mods = modules_of(package, folder)
    out = []
    for module, path in mods.items():
        for imp in imports_of(module, path, set(mods)):
            if imp.target == RUNTIME[0] or imp.target.startswith(RUNTIME[0] + "."):
                out.append(f"{path.relative_to(REPO)}:{imp.line}: imports {imp.target}")
    return out


def deferred_imports(package: str, folder: Path) -> list[tuple[str, str, int]]:
    """(module, target, line) of every import of a package module that does not run at module
    level: inside a function or under ``if TYPE_CHECKING``."""
    mods = modules_of(package, folder)
    known = set(mods)
    out = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        top = {id(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                out += [(module, i.target, i.line) for i in imports_of(module, path, known)
                        if i.line == node.lineno and (i.target in known or i.target == package)]
    return out


def report() -> str:
    edges, _, private = graph(*RUNTIME)
    lines = [f"runtime modules: {len(edges)}, import edges: {sum(map(len, edges.values()))}"]
    found = cycles(edges)
    lines.append(f"cycles: {len(found)}")
    lines += ["  " + " <-> ".join(c) for c in found]
    lines.append(f"private cross-module imports: {len(private)}")
    lines += ["  " + p for p in private]
    lang_edges, _, lang_private = graph(*LANGUAGE)
    lang_cycles = cycles(lang_edges)
    lines.append(f"language modules: {len(lang_edges)}, import edges: {sum(map(len, lang_edges.values()))}, "
                 f"cycles: {len(lang_cycles)}, private cross-module imports: {len(lang_private)}")
    lines += ["  " + " <-> ".join(c) for c in lang_cycles] + ["  " + p for p in lang_private]
    lang = language_imports_of_runtime()
    lines.append(f"language -> runtime imports: {len(lang)}")
    lines += ["  " + p for p in lang]
    counts = sorted(((len(t), m) for m, t in runtime_imports().items()), reverse=True)
    lines.append(f"runtime top-level files: {len(list(RUNTIME[1].glob('*.py')))}; "
                 f"room-level cycles: {len(cycles(room_edges()))}; most runtime imports: "
                 + ", ".join(f"{m.removeprefix('rldsl.runtime.')} {n}" for n, m in counts[:6]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the rules

def test_runtime_imports_have_no_cycle():
    edges, _, _ = graph(*RUNTIME)
    assert cycles(edges) == []


def test_no_module_uses_another_modules_private_names():
    _, _, private = graph(*RUNTIME)
    assert private == []


def test_language_package_never_imports_the_runtime():
    assert language_imports_of_runtime() == []


def test_the_runtime_adds_its_commands_through_the_entry_point_group():
    """pyproject declares the group rldsl/cli.py loads; the installed app has the runtime's commands."""
    from rldsl import cli

    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert f'[project.entry-points."{cli.COMMANDS_GROUP}"]' in text
    assert 'runtime = "rldsl.runtime.cli:register"' in text
    names = {c.name or c.callback.__name__ for c in cli.app.registered_commands}
    assert {"check", "explain", "run", "plot", "ablate"} <= names, \
        "re-run `pip install -e .` (and remove a stale rldsl.egg-info) to install the entry point"


def test_language_core_imports_have_no_cycle():
    """Every import counts (module level, inside a function, under TYPE_CHECKING): an import
    moved into a function to dodge a cycle is still a cycle here."""
    edges, _, _ = graph(*LANGUAGE)
    assert cycles(edges) == []


def test_language_core_imports_inside_functions_only_in_the_cli():
    lazy = [f"{m}:{line}: imports {t}" for m, t, line in deferred_imports(*LANGUAGE) if m not in LAZY_IMPORTS]
    assert lazy == [], "import at module level (a cycle it would close is the real problem)"


def test_no_language_module_uses_another_modules_private_names():
    _, _, private = graph(*LANGUAGE)
    assert private == []


def test_runtime_root_package_imports_nothing():
    """``import rldsl.runtime`` must stay free: every submodule import runs it first. It is a
    docstring only -- no import hook: a module has one import path, its place in the folders."""
    tree = ast.parse((RUNTIME[1] / "__init__.py").read_text(encoding="utf-8"))
    code = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
            and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    assert code == [], "runtime/__init__.py holds only its docstring (no finder serving old module paths)"
    hooks = [str(p.relative_to(REPO)) for p in python_files(("runtime", "rldsl"))
             if "meta_path" in p.read_text(encoding="utf-8")]
    assert hooks == [], "no import hook: a module is imported by its one path"


# ----------------------------------------------------------------------------- one import path per module

#: The packages whose modules the paths below are checked against (pyproject.toml's package-dir)
PACKAGES = (RUNTIME, LANGUAGE, ("rldsl._grammar", REPO / "grammar"), ("rldsl._algorithms", REPO / "algorithms"))
#: Where Python code of the repository lives (each file's imports are checked)
CODE_FOLDERS = ("runtime", "rldsl", "grammar", "algorithms", "tests", "bench", "demos", "examples")
#: Where module paths are written as text too (docs, `python -c` / `-m` strings, scripts, CI)
TEXT_FOLDERS = (*CODE_FOLDERS, "docs", "constraints", ".ci")
TEXT_FILES = ("README.md", "Makefile", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".yaml", ".yml", ".json", ".cfg", ".ini", ""}


def every_module(packages=PACKAGES) -> dict[str, Path]:
    return {m: p for package, folder in packages if folder.is_dir() for m, p in modules_of(package, folder).items()}


@functools.lru_cache(maxsize=None)
def bound_names(path: Path) -> tuple[set[str], set[str]]:
    """(names a module defines at module level -- def, class, assignment --, names it imports
    there); ``if`` / ``try`` / ``with`` blocks at module level count, functions' bodies do not."""
    defined: set[str] = set()
    imported: set[str] = set()
    body = list(ast.parse(path.read_text(encoding="utf-8"), str(path)).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        for field in ("body", "orelse", "finalbody", "handlers"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                body += getattr(node, field, [])
    return defined, imported


@functools.lru_cache(maxsize=None)
def _strings(path: Path) -> set[str]:
    return {n.value for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def package_face(init: Path) -> set[str]:
    """The names a package's ``__init__`` hands out: what it defines or imports, and the names a
    module-level ``__getattr__`` loads on first use (toy/__init__.py: the names in its table)."""
    defined, imported = bound_names(init)
    return defined | imported | (_strings(init) if "__getattr__" in defined else set())


def _module_name(path: Path, packages=PACKAGES) -> str | None:
    for package, folder in packages:
        if path.is_relative_to(folder):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            return ".".join([package, *parts])
    return None


def misplaced_imports(files: list[Path], packages=PACKAGES) -> list[str]:
    """Imports of the project's modules that take a path or a name from anywhere but its home: a
    module that does not exist (an old path), or a name from a module that only imports it (a
    re-export). A package may hand out its modules and what its ``__init__`` binds (its face)."""
    mods = every_module(packages)
    roots = {package.split(".")[0] for package, _ in packages}
    out = []
    for path in files:
        module = _module_name(path, packages)
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                out += [f"{rel}:{node.lineno}: no module {a.name}" for a in node.names
                        if a.name.split(".")[0] in roots and a.name not in mods]
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                if module is None:
                    continue
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in roots:
                continue
            if target not in mods:
                out.append(f"{rel}:{node.lineno}: no module {target}")
                continue
            defined, imported = bound_names(mods[target])
            for a in node.names:
                if a.name == "*" or f"{target}.{a.name}" in mods or a.name in defined:
                    continue
                if mods[target].name == "__init__.py" and a.name in package_face(mods[target]):
                    continue  # the package's face: what its __init__ imports or loads on first use
                where = "only imports" if a.name in imported else "has no"
                out.append(f"{rel}:{node.lineno}: {target} {where} {a.name}: import it from its home")
    return out


def python_files(folders=CODE_FOLDERS) -> list[Path]:
    return sorted(p for f in folders for p in (REPO / f).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_import_takes_a_module_and_a_name_from_their_home():
    """One import path per module: no finder serves a moved module under its old path, and no
    module re-exports a name "from its old home" -- every import in the repository names the
    module a name is defined in (a package's ``__init__`` may hand out its own face)."""
    assert misplaced_imports(python_files()) == []


def written_module_paths(text: str, prefix: str = RUNTIME[0]) -> list[str]:
    return re.findall(r"\b" + re.escape(prefix) + r"(?:\.[A-Za-z_]\w*)+", text)


def unknown_module_paths(files: list[Path], packages=PACKAGES, prefix: str = RUNTIME[0]) -> list[str]:
    """Runtime module paths written anywhere (a ``python -c`` string, ``-m``, a monkeypatch
    target, a doc) whose modules do not exist: each part down to a module is a subpackage, a module
    or a name of the package's face; what follows a module is an attribute (not checked)."""
    mods = every_module(packages)
    out = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
        for written in written_module_paths(text, prefix):
            parts = written.split(".")
            for k in range(len(prefix.split(".")) + 1, len(parts) + 1):
                name = ".".join(parts[:k])
                if name in mods and mods[name].name != "__init__.py":
                    break  # a module: the rest names its attributes
                if name in mods:
                    continue
                if parts[k - 1] not in package_face(mods[".".join(parts[: k - 1])]):
                    line = text[: text.index(written)].count("\n") + 1
                    out.append(f"{rel}:{line}: {written}: no module {name}")
                break
    return sorted(set(out))


def text_files() -> list[Path]:
    found = [REPO / f for f in TEXT_FILES if (REPO / f).is_file()]
    for folder in TEXT_FOLDERS:
        found += [p for p in (REPO / folder).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                  and "__pycache__" not in p.parts]
    return sorted(found)


def test_every_runtime_module_path_written_in_the_repository_exists():
    """Module paths in strings and docs (``python -c`` snippets, ``-m``, monkeypatch targets)
    name the module's one path: nothing keeps an old path working."""
    assert unknown_module_paths(text_files()) == []


def re_exports(files: list[Path], packages=PACKAGES) -> list[str]:
    """Names a plain module (not a package's ``__init__``) imports from the project at module
    level and never uses: imported there only for others to take. A module imported for its
    side effect (the rows it registers) is a module, not a name: allowed."""
    mods = every_module(packages)
    roots = {package.split(".")[0] for package, _ in packages}
    found = []
    for path in files:
        module = _module_name(path, packages)
        if path.name == "__init__.py" or module is None:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {n.id for s in _strings(path) if len(s) < 200  # quoted annotations: "Foo | None"
                 for n in ast.walk(_parsed(s)) if isinstance(n, ast.Name)}
        base = module.split(".")[:-1]
        for node in tree.body:
            if not isinstance(node, ast.ImportFrom):
                continue
            target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            if target.split(".")[0] in roots:
                found += [f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}:{node.lineno}: "
                          f"{a.asname or a.name}" for a in node.names
                          if f"{target}.{a.name}" not in mods and (a.asname or a.name) not in used]
    return found


def _parsed(text: str) -> ast.AST:
    try:
        return ast.parse(text, mode="eval")
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def test_runtime_and_language_modules_re_export_nothing():
    """Every name a runtime or language module imports from the project, it uses: none is kept
    "in its old home" for others (resolve.py and recipe.py once held five such names)."""
    assert re_exports(python_files(("runtime", "rldsl"))) == [], "import the name where it is used, from its home"


def test_the_import_checks_see_old_paths_and_re_exports(tmp_path):
    """The checkers themselves, on a toy package: an old module path, a name taken from a module
    that only imports it, a written path to a missing module; a package's face and a real home pass."""
    root = tmp_path / "pkg"
    (root / "run").mkdir(parents=True)
    (root / "__init__.py").write_text('"""The package."""\nMOVED = {"loop": "run.loop"}\n')  # a table, no face
    (root / "run" / "__init__.py").write_text("from .loop import train\n_LAZY = {'helper': 'loop'}\n\n\n"
                                              "def __getattr__(name):\n    return _LAZY[name]\n")
    (root / "run" / "loop.py").write_text("def train():\n    pass\n")
    (root / "recipe.py").write_text("from .run.loop import train  # noqa: F401 (its old home)\n")
    user = root / "user.py"
    user.write_text("from pkg.loop import train\nfrom pkg.recipe import train\nfrom pkg.run import train\n"
                    "from pkg.run.loop import train\nimport pkg.run.loop\n")
    packages = (("pkg", root),)
    found = misplaced_imports([user], packages)
    assert [f.split(": ", 1)[1] for f in found] == ["no module pkg.loop",
                                                    "pkg.recipe only imports train: import it from its home"]
    assert re_exports([root / "recipe.py", root / "run" / "loop.py"], packages) == ["recipe.py:1: train"]
    doc = tmp_path / "doc.md"
    doc.write_text("`python -c 'import pkg.loop'`, `-m pkg.run.loop`, `pkg.run.train`, `pkg.run.helper`,\n"
                   "`pkg.run.loop.train`, monkeypatch.setattr('pkg.run.missing.x', ...)\n")
    assert [f.split(": ", 1)[1] for f in unknown_module_paths([doc], packages, prefix="pkg")] \
        == ["pkg.loop: no module pkg.loop", "pkg.run.missing.x: no module pkg.run.missing"]


# ----------------------------------------------------------------------------- the runtime's layout

#: The runtime's rooms from the bottom up (docs/architecture.md, "Import order"): a room imports
#: only rooms of lower rows (and itself). A top-level file is a room of its own.
LAYOUT_ORDER = (
    ("errors", "faults"),
    ("config", "plugins", "processes", "batch", "models"),
    ("data",),
    ("rewards", "records"),
    ("rollout",),
    ("toy",),
    ("resolve", "train"),
    ("recipe",),
    ("workers",),
    ("run",),
    ("tinker",),
    ("ablate", "cli"),
)
#: At most this many .py files at runtime/'s top level (its package __init__ included)
MAX_TOP_LEVEL_FILES = 10
#: At most this many runtime modules imported by one module (the CLI, which registers every
#: command, excepted)
MAX_RUNTIME_IMPORTS = 8
#: Modules still above the limit, with their count today: a count may only go down; a module
#: leaves this table when it reaches the limit (docs/architecture.md says how to get there). Empty:
#: keep it so -- give a concept its home rather than a row here.
OVER_THE_LIMIT: dict[str, int] = {}
#: Runtime modules allowed an import inside a function, and why (never to dodge a cycle: the
#: cycle checks count these imports too)
RUNTIME_LAZY_IMPORTS = {
    "rldsl.runtime.cli": "each command imports what it runs, so that `rldsl --help` starts fast",
    "rldsl.runtime.ablate.command": "`rldsl ablate` reads configs only when it runs a study (a fast --help)",
    "rldsl.runtime.ablate.grid": "as ablate.command",
    "rldsl.runtime.recipe": "an engine's packages (vLLM, transformers' generation) load only for the engine a run uses",
    "rldsl.runtime.workers.start": "Ray is imported only by the runs that use it",
    "rldsl.runtime.rollout.agents.runner": "the endpoint's web server (starlette, uvicorn: the agents extra) loads only when an agent runs",
    "rldsl.runtime.run.loop": "`rldsl run` checks everything that needs no weights before torch loads (run/build.py)",
    "rldsl.runtime.run.plan": "as run.loop: the rollout-stage inputs (torch) are checked after the cheap checks",
    "rldsl.runtime.toy.sources": "as run.loop: a built-in task's model (transformers, torch) loads only when a run builds it",
    "rldsl.runtime.toy.shapes_source": "as toy.sources: the shapes task's model (transformers, torch) loads only when a run builds it",
    "rldsl.runtime.rewards.spec": "a reward model (torch, transformers) loads only for an rm: reward",
    "rldsl.runtime.tinker.models": "`rldsl serve-tinker` checks its options before torch and a model load "
                                   "(a bad option is an error at once)",
    "rldsl.runtime.workers.base": "as run.loop: the sync kinds (torch) name their type in annotations only; "
                                  "the plan reads workers/base before the cheap checks",
}


def room_of(module: str) -> str:
    """The room of a runtime module: its folder, or its own name for a top-level file."""
    parts = module.split(".")[2:]
    return parts[0] if parts else "__init__"


def runtime_imports() -> dict[str, set[str]]:
    """Module -> the distinct runtime modules it imports, as written: ``from ..a.b import x`` counts
    ``a.b``; the package ``__init__``s an import runs on the way are not counted (importing
    ``rldsl.runtime.records.metrics`` counts 1, not 2), nor is a module importing itself."""
    package, folder = RUNTIME
    mods = modules_of(package, folder)
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    return {m: {i.target for i in imports_of(m, p, set(mods))
                if i.target in mods and i.target not in packages and i.target != m}
            for m, p in mods.items()}


def room_edges() -> dict[str, set[str]]:
    """Room -> the other rooms its modules import (every import: module level or not)."""
    edges: dict[str, set[str]] = {}
    for module, targets in runtime_imports().items():
        for t in targets:
            if room_of(t) != room_of(module):
                edges.setdefault(room_of(module), set()).add(room_of(t))
    return edges


def test_runtime_top_level_holds_at_most_ten_files():
    files = sorted(p.name for p in RUNTIME[1].glob("*.py"))
    assert len(files) <= MAX_TOP_LEVEL_FILES, f"{len(files)} files at runtime/'s top level: {files}"


def test_every_room_of_the_runtime_is_in_the_documented_order():
    rooms = {room_of(m) for m in modules_of(*RUNTIME)} - {"__init__"}
    ordered = {r for row in LAYOUT_ORDER for r in row}
    assert rooms - ordered == set(), "a new folder or top-level file needs its row in LAYOUT_ORDER"
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    order_line = " < ".join(" ".join(row) for row in LAYOUT_ORDER)
    assert order_line in doc, f"docs/architecture.md must state the import order: {order_line}"


def test_rooms_import_only_rooms_below_them():
    """Folder-level import graph, top-level files as rooms of their own: no cycle, and each arrow
    points down the documented order."""
    row = {r: i for i, rooms in enumerate(LAYOUT_ORDER) for r in rooms}
    edges = room_edges()
    upward = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if row[b] >= row[a])
    assert upward == []
    assert cycles(edges) == []


def test_no_module_but_the_cli_imports_more_than_eight_runtime_modules():
    counts = {m: len(t) for m, t in runtime_imports().items() if m != "rldsl.runtime.cli"}
    over = {m: n for m, n in counts.items() if n > MAX_RUNTIME_IMPORTS}
    worse = {m: n for m, n in over.items() if n > OVER_THE_LIMIT.get(m, MAX_RUNTIME_IMPORTS)}
    assert worse == {}, f"more runtime imports than allowed (at most {MAX_RUNTIME_IMPORTS}): give a concept a home"
    paid = sorted(m for m, n in OVER_THE_LIMIT.items() if counts.get(m, 0) < n)
    assert paid == [], f"lower OVER_THE_LIMIT to today's counts (or drop the rows at <= 8): {paid}"


def test_runtime_imports_inside_functions_only_where_a_reason_is_given():
    lazy = sorted({f"{m}:{line}: imports {t}" for m, t, line in deferred_imports(*RUNTIME)
                   if m not in RUNTIME_LAZY_IMPORTS})
    assert lazy == [], "import at module level (a cycle it would close is the real problem)"


def _strings_and_calls(path: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(string constants that are not docstrings, names called) of a module, with their lines."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    strings = [(n.value, n.lineno) for n in ast.walk(tree)
               if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]
    calls = [(n.func.id if isinstance(n.func, ast.Name) else n.func.attr, n.lineno) for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))]
    return strings, calls


#: Where a built-in task's name may be written besides config.BUILTIN_TASKS, and why
TASK_NAME_ELSEWHERE = {("rewards/verify.py", "addition"): "the built-in reward of the same name",
                       ("toy/sources.py", "addition"): "that reward, the default the built-in tasks score with"}


def test_a_built_in_task_is_named_by_its_row_only():
    """docs/architecture.md: "nothing else names a task" -- every other module refers to the row."""
    from rldsl.runtime.config import BUILTIN_TASKS

    found = []
    for path in sorted(RUNTIME[1].rglob("*.py")):
        rel = path.relative_to(RUNTIME[1]).as_posix()
        if rel == "config.py":
            continue
        found += [f"{rel}:{line}: {text!r}" for text, line in _strings_and_calls(path)[0]
                  if text in BUILTIN_TASKS and (rel, text) not in TASK_NAME_ELSEWHERE]
    assert found == [], "refer to the task's row (config.ADDITION_TASK, config.CALCULATOR_TASK)"


def test_sampling_parameters_are_made_by_the_engines_factories():
    """SamplingParams are built in one place (rollout/engines/base.py: greedy, for_rollout,
    for_evaluation): no module builds them by hand."""
    found = []
    for path in sorted(RUNTIME[1].rglob("*.py")):
        rel = path.relative_to(RUNTIME[1]).as_posix()
        if rel != "rollout/engines/base.py":
            found += [f"{rel}:{line}" for name, line in _strings_and_calls(path)[1] if name == "SamplingParams"]
    assert found == [], "use SamplingParams.greedy / for_rollout / for_evaluation"


# ----------------------------------------------------------------------------- the checker

@pytest.fixture
def toy_package(tmp_path: Path) -> Path:
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("from .c import thing\n")
    (root / "a.py").write_text("from .b import helper\n")
    (root / "b.py").write_text("def helper():\n    from .a import _secret  # hidden in a function\n")
    (root / "sub" / "c.py").write_text("from .. import a\nthing = a._secret\n")
    (root / "d.py").write_text("from .sub import c\n")
    return root


def test_checker_sees_function_level_cycles_and_private_names(toy_package, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", toy_package.parent)
    edges, _, private = graph("pkg", toy_package)
    assert cycles(edges) == [["pkg.a", "pkg.b"]]
    assert "pkg.sub" in edges["pkg.d"] and "pkg.sub.c" in edges["pkg.d"]  # parents run too
    assert sorted(p.split(": ", 1)[1] for p in private) == ["imports pkg.a._secret", "uses pkg.a._secret"]
    assert deferred_imports("pkg", toy_package) == [("pkg.b", "pkg.a", 2)]


def test_the_sources_table_imports_neither_the_toy_nor_the_rollouts():
    """data/sources.py is the table; the built-in tasks (toy/) and a verifiers taskset (rollout/)
    register their rows with it, as components register with the language's registry."""
    package, folder = RUNTIME
    mods = modules_of(package, folder)
    targets = {i.target for i in imports_of(f"{package}.data.sources", folder / "data" / "sources.py", set(mods))}
    assert targets and not [t for t in targets if room_of(t) in ("toy", "rollout")]


# ------------------------------------------------------------- branches on images (issue 58)

#: what a branch about images names in its condition
VISION_WORDS = re.compile(r"image|vision|pixel|processor|visual", re.IGNORECASE)
#: the rooms where a model kind's images may be decided on: the model kinds, the data, the engines
VISION_ROOMS = ("models", "data", "rollout/engines")


def vision_branches(folder: Path = RUNTIME[1]) -> dict[str, int]:
    """Runtime file (relative to ``folder``) -> its branches whose condition names images, vision,
    pixels or processors (``if`` / ``elif`` / ``while`` statements, conditional expressions and
    comprehension filters), outside :data:`VISION_ROOMS`."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).as_posix()
        if rel.startswith(VISION_ROOMS):
            continue
        tests = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.If, ast.IfExp, ast.While)):
                tests.append(node.test)
            elif isinstance(node, ast.comprehension):
                tests += node.ifs
        n = sum(1 for t in tests if VISION_WORDS.search(ast.unparse(t)))
        if n:
            out[rel] = n
    return out


def vision_report() -> str:
    found = vision_branches()
    return "\n".join([f"branches on images outside {', '.join(VISION_ROOMS)}: {sum(found.values())} "
                      f"(train/: {sum(n for f, n in found.items() if f.startswith('train/'))})"]
                     + [f"  {f} {n}" for f, n in sorted(found.items(), key=lambda x: -x[1])])


#: the ceiling (34 before issue 58, 38 after issue 57's checks; issue 58's target: at most 5, none in
#: train/): the model kinds (models/kinds/) decide on images -- the trainer's forward inputs, the
#: rollout side's prompt ids, the checks before any model loads -- and the data layer finds the
#: rows with images. A new branch on images outside the model kinds, the data and the engines fails
#: here; any in train/ fails on its own.
VISION_BRANCHES_MAX = 5


def test_no_new_branches_on_images_outside_the_model_kinds():
    found = vision_branches()
    assert sum(found.values()) <= VISION_BRANCHES_MAX, vision_report()


def test_no_branch_on_images_in_train():
    found = vision_branches()
    assert not [f for f in found if f.startswith("train/")], vision_report()


def test_train_names_no_images():
    """train/ asks the model kind for a forward's inputs (models/kinds/) and passes them on: none of
    its files, code or docstrings, names images, vision, pixels or processors."""
    named = [p.relative_to(RUNTIME[1]).as_posix() for p in sorted((RUNTIME[1] / "train").rglob("*.py"))
             if VISION_WORDS.search(p.read_text())]
    assert named == []


def test_the_vision_branch_count_sees_every_kind_of_branch(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "models").mkdir()
    (tmp_path / "train" / "a.py").write_text(
        "if images:\n    pass\nelif pixel_values is None:\n    pass\nx = 1 if processor else 2\n"
        "y = [i for i in items if i.image]\nwhile vision:\n    break\nif text:\n    pass\n")
    (tmp_path / "models" / "b.py").write_text("if images:\n    pass\n")
    assert vision_branches(tmp_path) == {"train/a.py": 5}


def imports_report() -> str:
    """The modules at the import limit (:data:`MAX_RUNTIME_IMPORTS`) and above it, the CLI aside,
    each with what it imports: ``python tests/test_architecture.py --imports``."""
    imports = {m: t for m, t in runtime_imports().items() if m != "rldsl.runtime.cli"}
    at = sorted(m for m, t in imports.items() if len(t) == MAX_RUNTIME_IMPORTS)
    over = sorted(m for m, t in imports.items() if len(t) > MAX_RUNTIME_IMPORTS)
    short = lambda m: m.removeprefix("rldsl.runtime.")  # noqa: E731
    lines = [f"modules at the limit of {MAX_RUNTIME_IMPORTS} runtime imports: {len(at)}; above it: {len(over)}"]
    lines += [f"  {short(m)} ({len(imports[m])}): {', '.join(sorted(map(short, imports[m])))}" for m in over + at]
    return "\n".join(lines)


if __name__ == "__main__":
    if "--vision-branches" in sys.argv[1:]:
        print(vision_report())
    elif "--imports" in sys.argv[1:]:
        print(imports_report())
    else:
        print(report())
