"""``rldsl ablate``: ablation studies as one command (the "Tricks or Traps" method).

``grid.py`` turns BASE and the ``--vary`` axes into variant specs, ``runner.py`` runs each
variant x seed as an ``rldsl run`` process (locally or on Ray, resumable), ``report.py``
writes ``report.md``, ``results.csv`` and the figures, ``command.py`` runs the
``rldsl ablate`` command (declared in rldsl/runtime/cli.py).
"""
from .command import ablate
from ..errors import GridError
from .grid import build_study, parse_vary
from .report import run_numbers, write_report

__all__ = ["ablate", "GridError", "build_study", "parse_vary", "run_numbers", "write_report"]
