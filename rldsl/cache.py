"""The user's rldsl cache folder: ``$RLDSL_CACHE``, else ``$XDG_CACHE_HOME/rldsl``, else
``~/.cache/rldsl``. The spec grammar's tables (rldsl/parse_tables.py) and the runtime's warm-start
models (runtime/toy) are kept there; every entry is named by a hash of what made it."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

#: the environment variable that names the cache folder
CACHE_ENV = "RLDSL_CACHE"


def cache_dir() -> Path:
    """``$RLDSL_CACHE``, else ``$XDG_CACHE_HOME/rldsl``, else ``~/.cache/rldsl``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "rldsl"
    return Path.home() / ".cache" / "rldsl"


def publish(target: Path, write: Callable[[Path], None], done: str) -> Path:
    """Make the cache entry ``target`` whole or not at all: ``write(folder)`` fills a temporary
    folder beside it (its last file ``done``), which is then renamed to ``target``. When another
    process published it first, its copy is kept. Returns ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first: keep its copy
            if not (target / done).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
