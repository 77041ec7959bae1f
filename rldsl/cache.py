"""The user's rldsl cache folder: ``$RLDSL_CACHE``, else ``$XDG_CACHE_HOME/rldsl``, else
``~/.cache/rldsl``. The spec grammar's tables (rldsl/parse_tables.py) and the runtime's warm-start
models (runtime/toy) are kept there; every entry is named by a hash of what made it."""
from __future__ import annotations

import os
from pathlib import Path

#: the environment variable that names the cache folder
CACHE_ENV = "RLDSL_CACHE"


def cache_dir() -> Path:
    """``$RLDSL_CACHE``, else ``$XDG_CACHE_HOME/rldsl``, else ``~/.cache/rldsl``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "rldsl"
    return Path.home() / ".cache" / "rldsl"
