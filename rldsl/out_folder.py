"""The one rule of every command's ``--out DIR`` (``rldsl run``, ``export``, ``translate``): checked
before anything loads, so that a folder that cannot be written fails in a sentence, not in a
``FileExistsError`` after a model loaded, and a folder that holds a user's files is never written
over (``rldsl translate --out DIR`` replaced an existing ``DIR/spec.rl`` and ``DIR/run.toml``).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import UserError

__all__ = ["check_out_folder"]


def check_out_folder(folder: str | os.PathLike[str], error: type[UserError], *, empty: bool = True) -> Path:
    """``folder`` as a Path, or ``error``: it names a file (or lies under one), the folder it would
    be made in is not writable, or (``empty``) it exists and is not empty. ``empty=False`` lets a
    folder with files through: ``rldsl run`` refuses only a folder that holds a run, by its own
    records."""
    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise error(f"--out {out} is a file, not a folder: choose another --out")
    if empty and out.is_dir() and any(out.iterdir()):
        raise error(f"--out {out} exists and is not empty: choose another --out")
    base = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not base.is_dir():
        raise error(f"--out {out}: {base} is a file, not a folder: choose another --out")
    why = cannot_make_folders_in(base)
    if why is not None:
        raise error(f"--out {out}: {base} is not writable ({why}): choose another --out")
    return out


def cannot_make_folders_in(base: Path) -> str | None:
    """Why no folder can be made in ``base``, or None: found by making (and removing) an empty one.
    ``os.access`` cannot tell: it says yes to root everywhere, and to a folder such as ``/proc``
    that takes no new entries, so ``--out /proc/x`` failed as a FileNotFoundError after the
    checks (exit 1)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rldsl-out-", dir=base))
    except OSError as e:
        return e.strerror or type(e).__name__
    return None
