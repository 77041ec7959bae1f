"""The distributed runtime on a local Ray cluster (CPU, gloo): FSDP2 trainer ranks compute
exactly what one trainer computes, checkpoints move between world sizes, faults name the
worker and leave a resumable run folder.

Setup: a tiny random Llama (hidden 32, 2 layers) with the toy tokenizer, the built-in task,
P = 4 prompts x G = 4, and ``mixed_reward`` below (a mix of 0 / 0.5 / 1, so advantages are
not all zero). The losses run eagerly (RLDSL_COMPILE=0): with torch.compile every actor
process would compile the loss again (tens of seconds each on 2 cores), and compiled ==
eager is tested in tests/components; the driver's choice is passed to the actors, so both
sides of every comparison run the same code.
"""
from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rldsl.runtime.records import checkpoint as ckpt
from rldsl.runtime.run import loop
from rldsl.runtime.run import step as run_step
from rldsl.runtime.config import RunConfig, load_config
from rldsl.runtime.errors import WorkerError
from rldsl.runtime.records.metrics import read_metrics
from rldsl.runtime.records.run_dir import load_run_config
from rldsl.runtime.records.metrics import TIMED
from local_ray import local_ray

ray = pytest.importorskip("ray")

HERE = Path(__file__).parent
TOL = 1e-5


def mixed_reward(prompt: str, completion: str, answer: str) -> float:
    """0, 0.5 or 1 from the completion's characters: mixed rewards from any model."""
    return (sum(map(ord, completion)) % 3) / 2


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module (runs reuse it; each run kills its own actors)."""
    with local_ray(4):
        yield


def config(model_dir: Path, out: Path, trainers: int = 1, workers: int = 0, **over) -> RunConfig:
    sets = [f"model.path={model_dir}", f"out={out}", "rollout.prompts_per_step=4", "rollout.n=4",
            "train.steps=4", "data.eval_size=0", "checkpoint.every=1", "checkpoint.keep_last=0",
            "log.progress=false", f"reward.name={__name__}:mixed_reward",
            f"distributed.trainers={trainers}", f"distributed.rollout_workers={workers}",
            "distributed.sync_timeout=120", "distributed.collective_timeout=120"]
    return load_config(None, sets + [f"{k}={v}" for k, v in over.items()])


def steps_of(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]


def params(run: Path, step: int, what: str = "policy") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(run / "checkpoints" / f"step-{step}" / what / "model.safetensors"))


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= TOL, f"parameters differ by {worst:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("spec,over", [
    ("grpo", {}),  # KL to a sharded reference model, seq_mean_token_mean
    # critic (GAE), 3 minibatches of one group each: every step one rank has no group and
    # runs a zero-weighted copy; P = 3 groups split 2 + 1 when scoring
    ("ppo", {"rollout.prompts_per_step": 3, "train.minibatches": 3}),
    # token-budget micro-batches on both sides (the ranks get different numbers of them)
    ("grpo", {"train.max_tokens_per_microbatch": 24}),
    ("ppo", {"train.max_tokens_per_microbatch": 24, "train.minibatches": 2}),
    # packed forwards on both sides (the ranks' groups balanced by tokens, as always)
    ("grpo", {"train.packing": True}),
])
def test_two_trainer_ranks_match_one_trainer(spec, over, ray_cluster, model_dir, tmp_path):
    one = loop.train(spec, config(model_dir, tmp_path / "one", **{"train.steps": 3, **over}))
    two = loop.train(spec, config(model_dir, tmp_path / "two", trainers=2, workers=1,
                                  **{"train.steps": 3, **over}))
    a, b = steps_of(one), steps_of(two)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert any(r["optimizer_steps"] > 0 for r in a)
    for ra, rb in zip(a, b):
        assert ra["reward_mean"] == rb["reward_mean"]  # the same samples
        for k in ("loss", "pg_loss", "grad_norm", "clip_fraction", "adv_std", "kl", "value_loss"):
            if k in ra:
                assert math.isclose(ra[k], rb[k], rel_tol=1e-4, abs_tol=TOL), (k, ra[k], rb[k])
        assert rb["time/sync_s"] > 0
        assert rb["perf/logprobs_tokens"] == ra["perf/logprobs_tokens"]  # every rank's tokens
        if "perf/token_imbalance" in ra:  # (absent when the update had nothing to learn)
            assert rb["perf/token_imbalance"] >= 1.0 == ra["perf/token_imbalance"]
    for step in (1, 2, 3):
        assert_close(params(one, step), params(two, step))
    if spec == "ppo":
        assert_close(params(one, 3, "critic"), params(two, 3, "critic"))
    # the same checkpoint format: optimizer state keyed by parameter index, same shapes
    oa = torch.load(one / "checkpoints/step-3/optimizer.pt", weights_only=True)
    ob = torch.load(two / "checkpoints/step-3/optimizer.pt", weights_only=True)
    assert oa["policy"]["param_groups"][0]["params"] == ob["policy"]["param_groups"][0]["params"]
    assert oa["scheduler"] == ob["scheduler"]
    for i, st in oa["policy"]["state"].items():
        for k, v in st.items():
            assert torch.allclose(v, ob["policy"]["state"][i][k], atol=TOL), (i, k)


@pytest.mark.slow
def test_a_loss_reading_the_whole_batch_is_the_same_on_two_ranks_and_micro_batches(ray_cluster, model_dir, tmp_path):
    """A trust region whose bound is a cumulative sum over the batch's sorted tokens (a batch_*
    statistic inside loss()): one rank, one micro-batch == two FSDP ranks, each with token-budget
    micro-batches (docs/formulas.md, "The batch"). Per rank, the bound would differ."""
    spec = str(Path(__file__).resolve().parents[2] / "specs" / "formula" / "order_budget_trust_region.rl")
    one = loop.train(spec, config(model_dir, tmp_path / "one", **{"train.steps": 2, "train.lr": 3e-3, "train.ppo_epochs": 2}))
    two = loop.train(spec, config(model_dir, tmp_path / "two", trainers=2, workers=1,
                                  **{"train.steps": 2, "train.lr": 3e-3, "train.ppo_epochs": 2,
                                     "train.max_tokens_per_microbatch": 24}))
    a, b = steps_of(one), steps_of(two)
    assert [r["step"] for r in b] == [1, 2] and any(r["optimizer_steps"] > 0 for r in a)
    for ra, rb in zip(a, b):
        assert ra["reward_mean"] == rb["reward_mean"]
        for k in ("loss", "pg_loss", "grad_norm", "clip_fraction"):
            if k in ra:
                assert math.isclose(ra[k], rb[k], rel_tol=1e-4, abs_tol=TOL), (k, ra[k], rb[k])
    for step in (1, 2):
        assert_close(params(one, step), params(two, step))


@pytest.mark.slow
def test_two_trainer_run_resumes_on_one_trainer(ray_cluster, model_dir, tmp_path):
    full = loop.train("lite_ppo", config(model_dir, tmp_path / "full"))
    cut = loop.train("lite_ppo", config(model_dir, tmp_path / "cut", trainers=2, workers=1),
                     stop_after=2)
    assert ckpt.latest_checkpoint(cut).name == "step-2"
    resumed = load_config(None, flags={"distributed.trainers": 1, "distributed.rollout_workers": 0},
                          base=load_run_config(cut))
    loop.train(None, resumed, resume=cut)
    assert [r["step"] for r in steps_of(cut)] == [1, 2, 3, 4]
    assert load_run_config(cut).distributed.trainers == 1  # config.json shows what ran
    assert_close(params(full, 4), params(cut, 4))
    for ra, rb in zip(steps_of(full), steps_of(cut)):
        assert math.isclose(ra.get("loss", 0.0), rb.get("loss", 0.0), abs_tol=TOL)


# a dead rollout worker whose restarts are spent (the message names it, the resume hint works):
# tests/faults/test_ray_workers.py; a run resumed on another topology: below


@pytest.mark.slow
def test_a_call_past_its_timeout_names_the_worker(ray_cluster):
    from rldsl.runtime.workers.ray_cluster import RayCluster
    cluster = RayCluster(RunConfig(), cpus_needed=1)  # Ray is up already: reused, not owned
    assert not cluster.owns
    slow = ray.remote(lambda s: time.sleep(s)).remote(30)  # a lambda: pickled by value
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"the weight sync timed out after 0.5 s \(still waiting "
                                          r"for rollout worker 3\)"):
        cluster.wait([("rollout worker 3", slow)], 0.5, "the weight sync")
    assert time.monotonic() - t0 < 10
    ray.cancel(slow, force=True)
    cluster.close()
    assert ray.is_initialized()  # a cluster the run did not start is left running


def test_cli_flags_select_the_distributed_runtime(tmp_path):
    from rldsl.runtime.cli import build_run_config
    _, cfg = build_run_config("lite_ppo", flags={"distributed.trainers": 2,
                                                 "distributed.rollout_workers": 1,
                                                 "distributed.gpus_per_worker": 0.5,
                                                 "distributed.ray_address": "auto"})
    d = cfg.distributed
    assert (d.trainers, d.rollout_workers, d.gpus_per_worker, d.ray_address) == (2, 1, 0.5, "auto")
    assert d.uses_ray and not RunConfig().distributed.uses_ray
    assert load_config(None, ["distributed.rollout_workers=1"]).distributed.uses_ray


@pytest.mark.slow
def test_one_trainer_run_never_imports_ray(model_dir, tmp_path):
    code = ("import sys\n"
            "from rldsl.runtime.run import loop\n"
            "from rldsl.runtime.config import load_config\n"
            f"cfg = load_config(None, ['model.path={model_dir}', 'out={tmp_path / 'run'}', "
            "'rollout.prompts_per_step=2', 'rollout.n=2', 'train.steps=1', 'data.eval_size=0', "
            "'log.progress=false'])\n"
            "loop.train('lite_ppo', cfg)\n"
            "assert 'ray' not in sys.modules, 'ray was imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


# ----------------------------------------------------------------------------- LoRA

LORA = {"model.lora.rank": 4, "model.lora.alpha": 8, "train.lr": 1e-2}


@pytest.mark.slow
def test_lora_on_two_trainer_ranks_matches_one_process(ray_cluster, model_dir, tmp_path):
    """FSDP2 over the peft model: only adapters train, the KL reference is the policy with
    adapters off, the rollout actor's engine holds the merged weights (no LoRA names) equal to
    the one-process trainer's ``merged_weights``, and checkpoints equal the one-process ones."""
    pytest.importorskip("peft")
    from rldsl.runtime.run.build import build_run
    from rldsl.runtime.models.lora import merged_weights

    over = {**LORA, "checkpoint.every": 0}
    runs = {}
    for name, (trainers, workers) in {"one": (1, 0), "two": (2, 1)}.items():
        out = tmp_path / name
        out.mkdir()
        s = build_run("grpo", config(model_dir, out, trainers, workers, **over), out)
        try:
            metrics = [run_step.train_step(s, step) for step in range(2)]
            if name == "one":
                weights = merged_weights(s.trainers.trainer.policy)
                state = {k: v.detach().clone() for k, v in s.trainers.trainer.policy.state_dict().items()}
            else:
                weights = ray.get(s.rollouts.actors[0].engine_weights.remote())
                state = s.trainers.checkpoint_state().policy.state_dict()
        finally:
            s.close()
        runs[name] = (metrics, weights, state)
    (m1, merged, state1), (m2, engine, state2) = runs["one"], runs["two"]
    assert any(r["optimizer_steps"] > 0 for r in m1) and all("kl" in r for r in m2)
    for ra, rb in zip(m1, m2):
        assert ra["reward_mean"] == rb["reward_mean"]
        for k in ("loss", "pg_loss", "grad_norm", "kl"):
            assert math.isclose(ra[k], rb[k], rel_tol=1e-4, abs_tol=TOL), (k, ra[k], rb[k])
    # the gathered state holds base and adapter tensors under peft's names; only adapters moved
    assert state1.keys() == state2.keys() and any(".lora_A." in k for k in state2)
    from safetensors.torch import load_file
    base = load_file(str(model_dir / "model.safetensors"))
    for k, v in state2.items():
        if ".lora_" not in k and k.replace(".base_layer.", ".") in base:
            assert torch.equal(v, base[k.replace(".base_layer.", ".")]), k
    assert_close(state1, state2)
    # the engine: plain names, merged weights, equal to the one-process merge
    assert engine.keys() == merged.keys() and not any("lora" in k or "base_layer" in k for k in engine)
    worst = max((engine[k] - merged[k]).abs().max().item() for k in merged)
    assert worst <= 1e-6, f"engine weights differ from the one-process merge by {worst:.3g}"
    assert any(not torch.equal(engine[k], base[k]) for k in base if k in engine)  # adapters count


@pytest.mark.slow
def test_lora_two_trainer_run_resumes_exactly(ray_cluster, model_dir, tmp_path):
    """Kill (stop) a LoRA run on two trainer ranks after step 2 and resume it there: the
    checkpoints (base + adapter tensors) and metrics equal an uninterrupted run's."""
    pytest.importorskip("peft")
    over = {**LORA, "checkpoint.every": 1, "train.steps": 3}
    full = loop.train("grpo", config(model_dir, tmp_path / "full", 2, 1, **over))
    cut = loop.train("grpo", config(model_dir, tmp_path / "cut", 2, 1, **over), stop_after=2)
    assert ckpt.latest_checkpoint(cut).name == "step-2"
    assert any(".lora_B." in k for k in params(cut, 2))
    loop.train(None, resume=cut)
    assert [r["step"] for r in steps_of(cut)] == [1, 2, 3]
    a, b = params(full, 3), params(cut, 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(TIMED)}
                        for r in rs]
    assert strip(steps_of(full)) == strip(steps_of(cut))


@pytest.mark.slow
def test_two_trainer_ranks_send_the_lora_adapters_alone_to_the_rollout_worker(ray_cluster, model_dir, tmp_path):
    """model.lora.sync='adapter': the ranks gather the adapters alone (``ShardedTrainer.full_adapter``),
    Ray's object store carries them to the rollout actor, whose hf engine copies them into LoRA layers
    of its own: the run equals the one-process merged run, sync/bytes is the adapters'."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from rldsl.runtime.run.build import build_run

    over = {**LORA, "checkpoint.every": 0}
    runs = {}
    for name, (trainers, workers, sync) in {"one": (1, 0, "merged"), "two": (2, 1, "adapter")}.items():
        out = tmp_path / name
        out.mkdir()
        s = build_run("grpo", config(model_dir, out, trainers, workers, **over, **{"model.lora.sync": sync}), out)
        try:
            metrics = [run_step.train_step(s, step) for step in range(2)]
            if name == "two":
                engine = ray.get(s.rollouts.actors[0].engine_weights.remote())
                state = s.trainers.checkpoint_state().policy.state_dict()
        finally:
            s.close()
        runs[name] = metrics
    merged, adapter = runs["one"], runs["two"]
    assert any(r["optimizer_steps"] > 0 for r in merged)
    for a, b in zip(merged, adapter):
        assert a["reward_mean"] == b["reward_mean"]
        for k in ("loss", "pg_loss", "grad_norm", "kl"):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=TOL), (k, a[k], b[k])
    # the engine: the folder's base weights and the trainers' adapters (peft's names), nothing merged
    lora = {k: v for k, v in state.items() if ".lora_" in k}
    assert lora and all(torch.equal(engine[k], v) for k, v in lora.items())
    assert any(float(v.abs().max()) > 0 for k, v in lora.items() if ".lora_B." in k)
    base = load_file(str(model_dir / "model.safetensors"))
    for k, v in base.items():
        wrapped = k.replace(".weight", ".base_layer.weight")  # a layer with adapters holds it as base_layer
        assert torch.equal(engine[wrapped if wrapped in engine else k], v), k
    nbytes = sum(v.numel() * v.element_size() for v in lora.values())
    assert [r["sync/bytes"] for r in adapter] == [float(nbytes)] * 2
    assert all(b["sync/bytes"] * 5 < a["sync/bytes"] for a, b in zip(merged, adapter))


@pytest.mark.slow
def test_async_rollouts_on_a_ray_rollout_worker_equal_the_one_process_run(ray_cluster, model_dir, tmp_path):
    """rollout.max_staleness=1 with the producer driving a Ray rollout actor: the same fixed
    schedule, so the same numbers as the one-process asynchronous run."""
    over = {"rollout.max_staleness": 1, "checkpoint.every": 0, "train.minibatches": 2}
    local = steps_of(loop.train("grpo_tis", config(model_dir, tmp_path / "local", **over)))
    remote = steps_of(loop.train("grpo_tis", config(model_dir, tmp_path / "ray", workers=1, **over)))
    assert [r["async/staleness_max"] for r in remote] == [0.0, 1.0, 1.0, 1.0]
    for a, b in zip(local, remote):
        assert a["reward_mean"] == b["reward_mean"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-7)
