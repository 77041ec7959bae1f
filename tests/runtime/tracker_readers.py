"""Read back what each tracker stored locally (test helpers, not the product): W&B's offline
run log, Trackio's SQLite store, MLflow's file store, TensorBoard's event files, and the run's
own metrics.jsonl to compare them with."""
from __future__ import annotations

import json
import sqlite3
import struct
from pathlib import Path

import pytest

from rldsl.runtime.records.metrics import read_metrics
from rldsl.runtime.records.trackers import TrackerNames, numeric

_BLOCK = 32768
_HEADER = 7  # ":W&B" + 2 magic bytes + 1 version byte at the start of a .wandb file


def wandb_records(path: Path) -> list:
    """The protobuf Records of a W&B run log (.wandb): a LevelDB-style log of 32 KiB blocks,
    each record chunk [crc32c 4][length 2, little endian][type 1: full/first/middle/last][data]."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", f"{path} is not a W&B run log"
    out, pos, pending = [], _HEADER, b""
    while pos + 7 <= len(raw):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < 7:  # the block's tail is padding
            pos += left_in_block
            continue
        length, kind = struct.unpack_from("<HB", raw, pos + 4)
        data = raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def wandb_history(run_dir: Path) -> tuple[dict[int, dict[str, float]], dict[str, object], set[str]]:
    """(step -> logged values, config, run ids) over every offline run log in ``run_dir/wandb``.

    W&B's service writes an offline run's records to its ``.wandb`` file after ``run.finish()``
    has returned (measured: 7 bytes, the header, right after finish; 2 KB a moment later): a
    reader right after a run in the same process saw a resumed run's steps missing on a busy
    machine (KeyError: 3). ``wandb.teardown()`` returns once the service has written and closed
    every run's file -- what a process's exit does (W&B's atexit hook), so ``rldsl run`` loses
    nothing."""
    import wandb

    wandb.teardown()
    history: dict[int, dict[str, float]] = {}
    config: dict[str, object] = {}
    ids: set[str] = set()
    for log in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime):
        for record in wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                step = int(items.pop("_step"))
                history.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
            elif kind == "config":
                for i in record.config.update:
                    config[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
            elif kind == "run":
                ids.add(record.run.run_id)
                for i in record.run.config.update:
                    config[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return history, config, ids


def trackio_history(store: Path, project: str) -> tuple[dict[int, dict[str, float]], dict, set[str]]:
    """(step -> values, config, run ids) of a Trackio project's local SQLite store."""
    db = sqlite3.connect(store / f"{project}.db")
    try:
        history: dict[int, dict[str, float]] = {}
        ids = set()
        for run_id, step, metrics in db.execute("select run_id, step, metrics from metrics order by id"):
            ids.add(run_id)
            history.setdefault(step, {}).update(json.loads(metrics))
        config = {}
        for (text,) in db.execute("select config from configs"):
            config.update(json.loads(text))
        return history, config, ids
    finally:
        db.close()


def mlflow_history(run_dir: Path, run_id: str) -> tuple[dict[int, dict[str, float]], dict, str]:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    history: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run_id, key):
            history.setdefault(m.step, {})[key] = m.value
    spec = Path(client.download_artifacts(run_id, "spec.rl", str(run_dir / "dl"))).read_text()
    return history, run.data.params, spec


def tensorboard_history(run_dir: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    history: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            history.setdefault(e.step, {})[tag] = e.value
    return history


def jsonl_history(run_dir: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: numeric(r) for r in read_metrics(run_dir / "metrics.jsonl")}


def assert_same(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], rel: float = 1e-9):
    assert sorted(got) == sorted(want)
    for step, values in want.items():
        assert got[step].keys() >= values.keys(), f"step {step}: missing {values.keys() - got[step].keys()}"
        for key, value in values.items():
            assert got[step][key] == pytest.approx(value, rel=rel, abs=1e-12), (step, key)


def renamed(history: dict[int, dict[str, float]], tracker: str) -> dict[int, dict[str, float]]:
    """``history`` under ``tracker``'s name rule (what that tracker stores)."""
    rule = TrackerNames(tracker)
    return {s: {rule(k): v for k, v in values.items()} for s, values in history.items()}
