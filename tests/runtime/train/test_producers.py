"""The runtime's producers (runtime/train/inputs.py): the trainer passes an optional input exactly
when the algorithm reads it, one producer per input, and rollout-made inputs ride along the batch."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rldsl
from rldsl import inputs as table
from rldsl.runtime.batch import RolloutBatch
from rldsl.runtime.config import RunConfig
from rldsl.runtime.train import inputs as producers
from rldsl.runtime.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]


def test_wanted_is_what_the_call_always_takes_and_what_the_algorithm_reads():
    grpo = rldsl.load("grpo")
    vespo_is = rldsl.load(str(ROOT / "algorithms" / "examples" / "vespo_is.rl"))
    always_loss = [i.name for i in table.of_stage("loss") if "loss" in i.always]
    assert producers.wanted("loss", grpo) == always_loss
    assert producers.wanted("loss", vespo_is) == always_loss + [table.INPUTS["rollout_logprobs"].name]
    assert not producers.reads_engine(grpo) and producers.reads_engine(vespo_is)
    assert producers.reads_engine(rldsl.load("grpo_tis"))
    gdpo = rldsl.load("gdpo")
    assert [p.make for p in producers.rollout_producers(gdpo)] == [producers.per_function_rewards]
    assert producers.rollout_producers(grpo) == []


def test_rollout_inputs_are_selected_and_concatenated_by_rows():
    B, T = 4, 3
    b = RolloutBatch(torch.zeros(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.long),
                     torch.zeros(B, T, dtype=torch.long), torch.ones(B, T), torch.zeros(B, T),
                     ["stop"] * B, ["p"] * B, ["c"] * B, 2,
                     inputs={"reward_components": torch.arange(8.0).view(B, 2),
                             "reward_weights": torch.tensor([1.0, 0.5])})
    sub = b.select(torch.tensor([2, 3]))
    assert sub.inputs["reward_components"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert sub.inputs["reward_weights"].tolist() == [1.0, 0.5]  # [K]: not a row tensor
    both = RolloutBatch.concat([sub, b.select(torch.tensor([0, 1]))], pad_id=0)
    assert both.inputs["reward_components"][:, 0].tolist() == [4.0, 6.0, 0.0, 2.0]
    assert both.inputs["reward_weights"].tolist() == [1.0, 0.5]



@pytest.mark.parametrize("spec", ["grpo_plain", "vespo_is"])
def test_the_trainer_passes_the_engine_logprobs_only_to_a_spec_that_reads_them(rollout, spec, monkeypatch):
    model, batch = rollout
    if spec == "vespo_is":
        algo = rldsl.load(str(ROOT / "algorithms" / "examples" / "vespo_is.rl"))
    else:
        algo = rldsl.loads("algorithm g extends grpo\n  kl none\n", "g.rl")
    fn = rldsl.compile(algo, compile=False)
    cfg = RunConfig()
    cfg.rollout.temperature = 1.0
    cfg.train.skip_zero_advantage = False
    trainer = Trainer.from_config(cfg, fn, model)
    # an engine that differs from the trainer: its logprobs are those of another policy
    batch.logprobs = batch.logprobs - 0.3 * batch.response_mask
    seen: list[dict] = []
    real = fn.loss

    def spy(*args, **kw):
        seen.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(fn, "loss", spy)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    tb = trainer.estimate(batch, rewards)
    metrics = trainer.update(tb)
    assert seen and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    key = table.INPUTS["rollout_logprobs"].name
    if spec == "vespo_is":
        tr = seen[0][key].shape[1]
        assert torch.equal(seen[0][key], batch.logprobs[:, :tr])
    else:
        assert key not in seen[0]
