"""User code named in a config: reward functions, tools, environments, agents -- one loader for all.

A reference is one of::

    module:name                 ``name`` of an importable module; the current folder comes first
                                on the import path (as ``python -m`` does), so a ``mymodule.py``
                                beside the command is found
    path/to/file.py:name        ``name`` of that file (relative to the current folder), imported
                                as a module of its own (two ``tools.py`` files never collide)

The last ``:`` splits the reference (a Windows path may hold a drive's ``:``). Every error is
a :class:`~rldsl.runtime.errors.ConfigError` whose message starts with the kind of thing that
failed and its reference (``environment 'envs.py:Maze': ...``); a reward's is a
:class:`~rldsl.runtime.errors.RewardSpecError` (docs/errors.md). What the loaded object must be
(a function, a class with ``reset``/``step``) each kind checks itself.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .errors import ConfigError, RewardSpecError


@dataclass(frozen=True)
class Kind:
    """A kind of user code: its name in messages, the flag that names it, what the reference's
    name part names (in "expected module:function"), the error it raises."""

    name: str
    flag: str
    names: str = "name"
    error: type[ConfigError] = ConfigError


REWARD = Kind("reward", "--reward", "function", RewardSpecError)
TOOL = Kind("tool", "--tools", "function")
ENVIRONMENT = Kind("environment", "--env", "Class")
AGENT = Kind("agent", "--agent", "function")

#: module name -> file, for every file loaded by path: a spawned process (the tool runner's)
#: loads them again under the same names so that the objects they hold unpickle there
_FILES: dict[str, str] = {}


def split_reference(ref: str, kind: Kind) -> tuple[str, str]:
    """``(module or file, name)`` of ``module:name`` / ``path/file.py:name``."""
    module_ref, sep, attr = ref.rpartition(":")
    if not sep or not module_ref or not attr:
        raise kind.error(f"{kind.name} {ref!r}: expected module:{kind.names} or path/to/file.py:{kind.names}")
    return module_ref, attr


def is_file_reference(module_ref: str) -> bool:
    """``path/to/file.py`` (or any reference with a folder separator) names a file, not a module."""
    return module_ref.endswith(".py") or "/" in module_ref or os.sep in module_ref


def load_module(ref: str, module_ref: str, kind: Kind) -> ModuleType:
    """The module (or file) part of ``ref``, imported."""
    if is_file_reference(module_ref):
        return _load_file(ref, module_ref, kind)
    return _import_module(ref, module_ref, kind)


def load_object(ref: str, kind: Kind) -> object:
    """The object ``ref`` names (module doc); an error naming ``kind`` when it cannot be loaded."""
    module_ref, attr = split_reference(ref, kind)
    module = load_module(ref, module_ref, kind)
    if not hasattr(module, attr):
        raise missing(ref, kind, module_ref, module, attr)
    return getattr(module, attr)


def load_function(ref: str, kind: Kind) -> object:
    """The function ``ref`` names: :func:`load_object`, and an error saying what the module has
    when the name is not a callable there."""
    module_ref, attr = split_reference(ref, kind)
    module = load_module(ref, module_ref, kind)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise missing(ref, kind, module_ref, module, attr)
    return fn


def missing(ref: str, kind: Kind, module_ref: str, module: ModuleType, attr: str) -> ConfigError:
    """The error of a reference whose module has no ``attr`` (of the kind's sort): what the module
    has of that sort, e.g. ``agent 'agents:nosuch': module 'agents' (FILE) has no function
    'nosuch'; its functions: solve, chat``."""
    where = getattr(module, "__file__", None) or module_ref
    classes = kind.names == "Class"
    what, found = ("class", classes_of(module)) if classes else ("function", functions_of(module))
    return kind.error(f"{kind.name} {ref!r}: module {module_ref!r} ({where}) has no {what} {attr!r}; "
                      f"its {'classes' if classes else 'functions'}: " + (", ".join(found) or "none"))


def functions_of(module: ModuleType) -> list[str]:
    """The public functions a module defines itself (for "its functions: ..." in a message)."""
    return sorted(n for n, v in vars(module).items()
                  if callable(v) and not n.startswith("_") and not isinstance(v, type)
                  and getattr(v, "__module__", None) == module.__name__)


def classes_of(module: ModuleType) -> list[str]:
    """The public classes a module defines itself (for "its classes: ..." in a message)."""
    return sorted(n for n, v in vars(module).items()
                  if isinstance(v, type) and not n.startswith("_") and v.__module__ == module.__name__)


def loaded_files() -> dict[str, str]:
    """Module name -> file of every module loaded from a path so far."""
    return dict(_FILES)


def load_files(files: dict[str, str]) -> None:
    """Load modules by path under the names :func:`loaded_files` gave (in a spawned process)."""
    for name, path in files.items():
        if name not in sys.modules:
            _exec_file(name, Path(path))


def _exec_file(module_name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _load_file(ref: str, file_ref: str, kind: Kind) -> ModuleType:
    """Import ``file_ref`` (relative to the current folder) as a module of its own."""
    path = Path(file_ref).expanduser()
    if not path.is_file():
        raise kind.error(f"{kind.name} {ref!r}: file not found: {path.resolve()}\n"
                         f"(a path is read relative to the current folder {Path.cwd()})")
    path = path.resolve()
    # one module per file, named after its full path so two reward.py files never collide
    module_name = "rldsl_reward_" + re.sub(r"\W", "_", str(path.with_suffix("")))
    if module_name in sys.modules:
        return sys.modules[module_name]
    if importlib.util.spec_from_file_location(module_name, path) is None:
        raise kind.error(f"{kind.name} {ref!r}: {path} is not a Python file")
    try:
        module = _exec_file(module_name, path)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the file's own error (a syntax error, a missing package)
        raise kind.error(f"{kind.name} {ref!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    _FILES[module_name] = str(path)
    return module


def _import_module(ref: str, module_name: str, kind: Kind) -> ModuleType:
    """Import ``module_name`` with the current folder first on the import path."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            first = module_name.split(".")[0]
            raise kind.error(
                f"{kind.name} {ref!r}: cannot import module {module_name!r}: no {first}.py (or package "
                f"{first}/) in the current folder {cwd} nor among the installed packages; "
                f"run from the folder that holds it, or give the file's path: "
                f"{kind.flag} path/to/{module_name.replace('.', '/')}.py:{ref.rpartition(':')[2]}"
            ) from e
        raise kind.error(f"{kind.name} {ref!r}: importing module {module_name!r} failed: "
                         f"{type(e).__name__}: {e}") from e
    except (Exception, SystemExit) as e:  # the module's own error (a syntax error, a failing top-level line, sys.exit())
        raise kind.error(f"{kind.name} {ref!r}: importing module {module_name!r} failed: "
                         f"{type(e).__name__}: {e}") from e
