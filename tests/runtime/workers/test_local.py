"""The trainer in the calling process (workers/local_trainers.py)."""
from __future__ import annotations

import torch

from rldsl.runtime.workers.local_trainers import LocalTrainers

from test_batch import make  # tests/runtime is on sys.path (its conftest)


class Recording:
    """A trainer whose policy lives on ``device``; estimate records what it was handed."""

    def __init__(self, device: str):
        self.policy = torch.nn.Linear(2, 2, device=device)
        self.seen: list[torch.device] = []

    def estimate(self, rollout, rewards):
        self.seen += [rollout.response_ids.device, rollout.prompt_mask.device, rollout.logprobs.device,
                      rewards.device]
        return "estimated"


def test_estimate_hands_the_trainer_the_rollout_on_the_policys_device() -> None:
    # engines return CPU tensors; a policy on a GPU failed at its first forward before the move
    # (meta stands in for the other device here: no GPU needed to see the batch follow the policy)
    trainer = Recording("meta")
    assert LocalTrainers(trainer).estimate(make(3, 2), torch.ones(4)) == "estimated"
    assert trainer.seen == [torch.device("meta")] * 4
    on_cpu = Recording("cpu")
    batch = make(3, 2)
    LocalTrainers(on_cpu).estimate(batch, torch.ones(4))
    assert on_cpu.seen == [torch.device("cpu")] * 4
