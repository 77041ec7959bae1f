"""The weight-sync interface (workers/sync/): the kind a run sends is chosen once from its config,
each kind's weights load themselves into an engine (so no receiver asks a value what it is, and a
new kind needs no change on either side), a snapshot survives the trainer's next update, and the
transports on Ray are given to both sides when they are made."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import torch

from rldsl.runtime.config import load_config
from rldsl.runtime.models.lora import LoraAdapter
from rldsl.runtime.workers.local import LocalRollouts
from rldsl.runtime.workers.local_trainers import LocalTrainers
from rldsl.runtime.workers.sync.adapter import Adapter, AdapterKind
from rldsl.runtime.workers.sync.base import kind_of
from rldsl.runtime.workers.sync.full_state import FullState, FullStateKind

RUNTIME = Path(__file__).resolve().parents[3] / "runtime"


class Engine:
    """An engine that records what it was asked to load."""

    def __init__(self):
        self.calls: list[tuple] = []

    def update_weights(self, named):
        self.calls.append(("update_weights", [name for name, _ in named]))

    def load_adapter(self, adapter, version):
        self.calls.append(("load_adapter", sorted(adapter.tensors), version))


def test_the_kind_is_the_configs_adapters_alone_only_with_lora_and_sync_adapter():
    assert isinstance(kind_of(load_config(None, [])), FullStateKind)
    assert isinstance(kind_of(load_config(None, ["model.lora.rank=4"])), FullStateKind)  # merged
    kind = kind_of(load_config(None, ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.sync=adapter"]))
    assert kind == AdapterKind(4, 8.0) and kind.adapters


def test_each_kind_loads_itself_into_the_engine():
    engine = Engine()
    rollouts = LocalRollouts(engine, reward=None)
    rollouts.load_weights(FullState({"w": torch.ones(2)}), 1)
    rollouts.load_weights(Adapter(LoraAdapter({"m.lora_A.default.weight": torch.ones(1, 2)}, 1, 1.0)), 2)

    class Halved:  # a kind the receiver has never heard of: it loads itself
        def snapshot(self):
            return self

        def load_into(self, engine, version):
            engine.update_weights([("half", torch.zeros(1))])

    rollouts.load_weights(Halved(), 3)
    assert engine.calls == [("update_weights", ["w"]), ("load_adapter", ["m.lora_A.default.weight"], 2),
                            ("update_weights", ["half"])]


def test_a_snapshot_of_the_full_state_survives_the_next_update():
    policy = torch.nn.Linear(2, 2, bias=False)
    trainers = LocalTrainers(SimpleNamespace(policy=policy))
    live = trainers.weights()
    kept = live.snapshot()
    assert trainers.sync_bytes == 16 and kept.nbytes == 16
    with torch.no_grad():
        policy.weight.add_(1.0)
    assert torch.equal(live.tensors["weight"], policy.weight)  # views of the live parameters
    assert torch.equal(kept.tensors["weight"] + 1.0, policy.weight)  # the snapshot did not move


def test_no_receiver_probes_the_type_of_the_weights():
    """workers/ and models/ never ask a weights value what it is (the issue's count: 3 before)."""
    probe = re.compile(r"(isinstance|hasattr)\((self\.)?(weights|state)\b")
    found = [f"{p.relative_to(RUNTIME)}:{i}" for folder in ("workers", "models") for p in (RUNTIME / folder).rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]
    assert found == []
