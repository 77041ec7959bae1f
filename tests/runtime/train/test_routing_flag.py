"""``rollout.routing_replay`` reaches the trainer as a constructor argument (train/parts.py hands
it over with the other parts), not as an attribute set on a trainer already made."""
from __future__ import annotations

import copy

import torch

import rldsl
from rldsl.runtime.config import load_config
from rldsl.runtime.train.parts import trainer_parts
from rldsl.runtime.train.trainer import Trainer


def test_the_routing_replay_flag_is_given_to_the_trainer_at_construction(tiny_model):
    fn = rldsl.compile(rldsl.load("dapo"), compile=False)  # no reference model needed
    for replay in (True, False):
        cfg = load_config(None, [f"rollout.routing_replay={str(replay).lower()}"])
        assert trainer_parts(cfg, fn, copy.deepcopy(tiny_model))["routing_replay"] is replay
    made = Trainer(fn, tiny_model, optimizer=torch.optim.SGD(tiny_model.parameters(), lr=0.1), routing_replay=True)
    assert made.routing_replay is True
    assert Trainer(fn, tiny_model, optimizer=torch.optim.SGD(tiny_model.parameters(), lr=0.1)).routing_replay is False
