"""Fixtures of the ``rldsl serve-tinker`` tests: a folder laid out as the Tinker client and the
cookbook resolve names offline (``Qwen/Qwen3-8B-Base``: the real-shaped Qwen fixture, so the
cookbook picks its ``role_colon`` renderer; ``openai/gsm8k``: a few rows in GSM8K's layout), and
servers started in this process on a free 127.0.0.1 port."""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Callable, Iterator

import pytest

from rldsl.runtime.rewards.server import BackgroundServer
from rldsl.runtime.tinker.server import make_app
from rldsl.runtime.tinker.service import Service

from tinker_helpers import KEY, NAME


def _gsm8k(folder: Path) -> None:
    import pandas as pd
    rows = [{"question": f"What is {a} plus {b}?", "answer": f"{a} plus {b} is {a + b}.\n#### {a + b}"}
            for a in range(1, 9) for b in range(1, 5)]
    (folder / "main").mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(folder / "main" / "train-00000-of-00001.parquet")
    pd.DataFrame(rows[:8]).to_parquet(folder / "main" / "test-00000-of-00001.parquet")
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
                                      "    path: main/train-*\n  - split: test\n    path: main/test-*\n---\n")


@pytest.fixture(scope="session")
def tinker_home(tmp_path_factory, real_model) -> Path:
    """The folder the clients run in: ``Qwen/Qwen3-8B-Base`` (a model folder) and ``openai/gsm8k``."""
    home = tmp_path_factory.mktemp("tinker-home")
    shutil.copytree(real_model("qwen2.5"), home / NAME)
    _gsm8k(home / "openai" / "gsm8k")
    return home


@pytest.fixture()
def start_server(tinker_home, tmp_path) -> Callable[..., contextlib.AbstractContextManager[str]]:
    """``with start_server() as url:`` a server for ``Qwen/Qwen3-8B-Base`` (``api_key=``: the one key;
    ``root=``: its states folder, default this test's)."""

    @contextlib.contextmanager
    def start(api_key: str | None = None, root: Path | None = None) -> Iterator[str]:
        service = Service({NAME: tinker_home / NAME}, root or tmp_path / "states")
        try:
            with BackgroundServer(make_app(service, api_key)) as url:
                yield url
        finally:
            service.close()
    return start


@pytest.fixture()
def client(start_server, monkeypatch, tinker_home) -> Iterator[tuple[object, str]]:
    """(a ``tinker.ServiceClient`` on a fresh server, its url); the tokenizer resolves offline."""
    tinker = pytest.importorskip("tinker")
    monkeypatch.chdir(tinker_home)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with start_server() as url:
        yield tinker.ServiceClient(base_url=url, api_key=KEY), url
