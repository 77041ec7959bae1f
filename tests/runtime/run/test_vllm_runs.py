"""``rldsl run ... --set rollout.engine=vllm`` against a real vLLM (the CPU build, in .venv-vllm).

The policy is a random-init float32 Llama with the toy tokenizer and head dim 64 (vLLM's CPU
attention refuses the embedded model's 24; ``rldsl run`` without ``model.path`` trains the
head-dim-32 variant of it, runtime/toy/model.py), on the built-in task with P = 4 prompts x
G = 4 and ``reward_helpers:parity`` (mixed rewards from any model). Losses run eagerly
(RLDSL_COMPILE=0). Every run builds its own engine (about a minute each).

- in one process (no Ray), LoRA, grpo_tis (it reads the engine's logprobs): after each
  step's sync the engine's weights, read back through vLLM's kernels, equal the trainer's
  merged weights; the correction sees logprobs equal to the trainer's (ratio 1);
- SIGKILL of a real `rldsl run` after its checkpoints, then `rldsl run --resume`: the
  metrics and final weights equal the uninterrupted run's, as with the HF engine;
- with a Ray rollout worker (vLLM inside the actor): three steps, and after each one the
  actor's engine holds exactly the weights of that step's checkpoint;
- ``sampling replay``, with and without an agent (``rollout.agent``): kept groups replayed with
  vLLM's recorded logprobs as their behaviour policy, and a resume equal to its uninterrupted twin.
Run alone: ``make test-vllm`` (or ``.venv-vllm/bin/python -m pytest -m vllm``).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rldsl.runtime.records import checkpoint as ckpt
from rldsl.runtime.records.checkpoint import read_weights
from rldsl.runtime.run import loop
from rldsl.runtime.run import schedule
from rldsl.runtime.config import RunConfig, load_config
from rldsl.runtime.models.lora import merged_weights
from rldsl.runtime.records.metrics import read_metrics
from rldsl.runtime.records.metrics import TIMED

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TIMING = TIMED
#: Settings every run here shares; the engine gets a small KV cache and no torch.compile.
COMMON = ["rollout.engine=vllm", "rollout.prompts_per_step=4", "rollout.n=4", "train.steps=3",
          "eval.every=0", "data.eval_size=0", "checkpoint.keep_last=0", "log.progress=false",
          "reward.name=reward_helpers:parity", "rollout.vllm.gpu_memory_utilization=0.1",
          "rollout.vllm.max_model_len=64"]


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """hidden 128, 2 heads of 64, 2 layers, random init (std 0.1), with the toy tokenizer."""
    from transformers import LlamaForCausalLM
    from rldsl.runtime.toy import build_tokenizer, tiny_config
    tok = build_tokenizer()
    config = tiny_config(tok, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=256)
    config.initializer_range = 0.1
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("vllm-run-model")
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def config(model_dir: Path, out: Path, *extra: str) -> RunConfig:
    return load_config(None, [f"model.path={model_dir}", f"out={out}", *COMMON, *extra])


def cli_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    sets = [f"model.path={model_dir}", f"out={out}", *COMMON, *extra]
    return [a for s in sets for a in ("--set", s)]


def steps_of(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


def max_difference(engine: dict[str, torch.Tensor], trainer: dict[str, torch.Tensor]) -> float:
    """Largest |engine - trainer| over every tensor vLLM computes with (it keeps one tensor
    for a tied embedding / LM head pair and computes the rotary tables itself)."""
    trainer = {k: v for k, v in trainer.items() if "rotary_emb" not in k}
    trainer.setdefault("lm_head.weight", trainer["model.embed_tokens.weight"])  # tied: saved once
    assert set(engine) <= set(trainer), sorted(set(engine) - set(trainer))
    assert set(trainer) - set(engine) <= {"lm_head.weight"}, sorted(set(trainer) - set(engine))
    return max((engine[k] - trainer[k].float()).abs().max().item() for k in engine)


LORA = ("model.lora.rank=4", "model.lora.alpha=8", "checkpoint.every=1")


@pytest.fixture(scope="module")
def lora_run(vllm_model_dir, tmp_path_factory):
    """(run folder, max |engine - trainer| after each step's sync): an uninterrupted 3-step
    in-process run, LoRA, grpo_tis. Also the reference of the resume test."""
    diffs: list[float] = []
    with pytest.MonkeyPatch.context() as mp:
        real_step = schedule.train_step

        def checked_step(s, step, producer=None):
            m = real_step(s, step, producer)  # ends with the weight sync
            diffs.append(max_difference(s.rollouts.engine.read_weights(), merged_weights(s.trainers.policy)))
            return m

        mp.setattr(schedule, "train_step", checked_step)
        run = loop.train("grpo_tis", config(vllm_model_dir, tmp_path_factory.mktemp("lora") / "run", *LORA))
    return run, diffs


def test_in_process_lora_run_syncs_exact_weights_each_step(lora_run):
    run, diffs = lora_run
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert any(r["optimizer_steps"] > 0 for r in recs)
    assert diffs == [0.0, 0.0, 0.0]
    for r in recs:  # the engine's logprobs are the trainer's (float32): importance ratio 1
        assert r["correction/is_mean"] == pytest.approx(1.0, abs=1e-4)
        assert r["correction/rejected_fraction"] == 0.0
    assert ckpt.latest_checkpoint(run).name == "step-3"


def test_killed_run_resumes_exactly(lora_run, vllm_model_dir, tmp_path):
    """SIGKILL a real `rldsl run` (vLLM engine, the settings of ``lora_run``) after a
    checkpoint; --resume finishes it with the metrics and weights of the uninterrupted run."""
    import psutil
    full, _ = lora_run
    env = dict(os.environ)
    rldsl_bin = [sys.executable, "-m", "rldsl.cli"]
    cut = tmp_path / "cut"
    # the run hangs in the reward of step 3 (after 2 steps x 16 samples): killed there, not raced
    proc = subprocess.Popen(rldsl_bin + ["run", "grpo_tis"] + cli_args(vllm_model_dir, cut, *LORA),
                            env={**env, "RLDSL_TEST_HOLD_REWARD_AFTER": "32"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list = []
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        children = psutil.Process(proc.pid).children(recursive=True) or children  # vLLM's processes
        if ckpt.latest_checkpoint(cut) is not None and len(steps_of(cut)) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    assert any(_name(p).startswith("VLLM") for p in children), "no vLLM process under the run"
    proc.kill()
    proc.wait()
    # vLLM's processes watch their parent and exit on their own, but not always promptly
    # (once the EngineCore still ran 60 s later on this loaded 2-core machine): clean up
    _, alive = psutil.wait_procs(children, timeout=30)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    assert len(steps_of(cut)) == 2
    res = subprocess.run(rldsl_bin + ["run", "--resume", str(cut)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert without_timing(steps_of(cut)) == without_timing(steps_of(full))
    a = read_weights(ckpt.latest_checkpoint(full) / "policy")
    b = read_weights(ckpt.latest_checkpoint(cut) / "policy")
    assert a.keys() == b.keys() and any(".lora_B." in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _name(process) -> str:
    import psutil
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return ""


def test_ray_rollout_worker_run_syncs_exact_weights_each_step(vllm_model_dir, tmp_path, monkeypatch):
    import ray
    real_save = schedule.save
    diffs: list[float] = []

    def checked_save(s, step, producer=None):
        path = real_save(s, step, producer)  # after the step's sync
        engine = ray.get(s.rollouts.actors[0].engine_weights.remote())
        diffs.append(max_difference(engine, read_weights(path / "policy")))
        return path

    monkeypatch.setattr(schedule, "save", checked_save)
    run = loop.train("grpo", config(vllm_model_dir, tmp_path / "run", "distributed.rollout_workers=1",
                                    "checkpoint.every=1", "distributed.sync_timeout=300",
                                    "distributed.collective_timeout=300"))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert any(r["optimizer_steps"] > 0 for r in recs)
    assert all(r["time/sync_s"] > 0 for r in recs)
    assert diffs == [0.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def eos_first_tool_model(tmp_path_factory):
    """A Llama (head dim 64) with the tool tokenizer and chat template whose every next token is
    EOS: the attention and MLP outputs are zeroed, so the last hidden state is the embedding, whose
    first coordinate is large; only the (untied) EOS row of the head reads it. Each turn of an
    episode is then [EOS], whatever the weights after a small update: a multi-turn episode on vLLM
    whose turns are known."""
    from transformers import LlamaForCausalLM
    from rldsl.runtime.toy.tool_model import build_tool_tokenizer, tool_model_config
    tok = build_tool_tokenizer()
    config = tool_model_config(tok, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=256)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 20.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.eos_token_id, 0] = 50.0
    path = tmp_path_factory.mktemp("vllm-episode-model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_multi_turn_episodes_on_vllm(eos_first_tool_model, tmp_path):
    """--env episode_helpers:Nudge on the vLLM engine: three assistant turns (each the model's EOS),
    the environment's messages between them as the template renders them, the environment's
    reward; token in, token out: the episode's ids decode to the template's rendering."""
    import json

    from transformers import AutoTokenizer
    run = loop.train("grpo", load_config(None, [
        f"model.path={eos_first_tool_model}", f"out={tmp_path / 'run'}", *COMMON, "rollout.vllm.max_model_len=128",
        "rollout.env=episode_helpers:Nudge", "reward.name=env", "rollout.max_turns=4", "train.steps=2",
        "rollout.max_new_tokens=4", "log.samples_per_step=2", "train.lr=1e-6", "data.task=addition"]))
    steps = steps_of(run)
    assert [r["step"] for r in steps] == [1, 2] and all(r["reward_mean"] == 1.0 for r in steps)
    tok = AutoTokenizer.from_pretrained(eos_first_tool_model)
    for s in (json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()):
        assert s["finish_reason"] == "stop" and s["env_reward"] == 1.0
        assert [m["role"] for m in s["messages"]] == ["user", "assistant", "user", "assistant", "user", "assistant"]
        assert s["trained_tokens"] == 3  # three EOS tokens, one per turn
        rendered = tok.apply_chat_template([{k: v for k, v in m.items() if k != "trained"} for m in s["messages"]],
                                           tokenize=False)
        assert s["environment_tokens"] == len(tok(rendered, add_special_tokens=False)["input_ids"]) \
            - len(tok(s["prompt"], add_special_tokens=False)["input_ids"]) - 3 - 1  # minus the closing "\n"


def test_reference_reward_with_the_policy_on_vllm(vllm_model_dir, tmp_path, monkeypatch):
    """contrastive_rewards (reads ref_reward) with rollout.engine=vllm, reward.reference=policy_base,
    2 reference answers per prompt, 2 steps: the policy samples on vLLM, the reference on an HF
    engine of the folder in this process, on the same prompts each step; its answers are the base
    model's (a fresh HF engine gives the same ones); samples.jsonl holds both rewards per row
    (ref_reward its prompt's mean reference reward) and the metrics both per term."""
    from reward_helpers import assert_reference_records

    from rldsl.runtime.models.loading import load_policy, load_tokenizer
    from rldsl.runtime.rollout.engines.hf import HFEngine
    from rldsl.runtime.rollout.engines.vllm import VLLMEngine
    from rldsl.runtime.workers.local import LocalRollouts

    calls = []
    generate = LocalRollouts.generate

    def spy(self, prompts, answers, params, reward_prompts=None, score=True):
        out = generate(self, prompts, answers, params, reward_prompts, score)
        calls.append((self.engine, list(prompts), params, out))
        return out

    monkeypatch.setattr(LocalRollouts, "generate", spy)
    spec = str(Path(__file__).resolve().parents[3] / "algorithms" / "examples" / "contrastive_rewards.rl")
    run = loop.train(spec, config(vllm_model_dir, tmp_path / "run", "train.steps=2", "log.samples_per_step=4",
                                  "reward.reference=policy_base", "reward.reference_samples=2"))
    policy = [c for c in calls if isinstance(c[0], VLLMEngine)]
    reference = [c for c in calls if isinstance(c[0], HFEngine)]
    assert len(policy) == 2 and len(reference) == 2 and len(calls) == 4
    base = HFEngine(load_policy(vllm_model_dir, "float32"), load_tokenizer(vllm_model_dir))
    for p, (_, prompts, params, got) in zip(policy, reference):
        assert prompts == p[1] and params.n == 2 and params.temperature == p[2].temperature
        assert base.generate(prompts, params).completions == got.batch.completions
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2]
    assert_reference_records(run, reference, recs)


REPLAY_SPEC = '''algorithm grpo_replay extends grpo
  "GRPO whose non-informative groups are replaced by the newest kept ones."
  sampling      replay(capacity=8, priority=newest, max_age=2)
'''


def test_replay_on_vllm_trains_on_kept_groups_and_resumes_as_its_twin(vllm_model_dir, tmp_path):
    """sampling replay with rollout.engine=vllm, 4 steps: groups sampled on vLLM are kept and
    replayed (replay/fraction > 0) with the engine's recorded logprobs as their behaviour
    policy: their ratio stats and the loss are finite, and a group replayed in the step that
    sampled it (priority=newest) has ratio 1 on every token: its recorded logprobs are vLLM's of
    its own tokens, which the trainer's float32 policy matches. A run stopped after the step-2 checkpoint
    and resumed draws and trains what its uninterrupted twin does (the buffer is in the checkpoint)."""
    import math

    from rldsl.runtime.records.metrics import LOSS
    from rldsl.runtime.rollout.replay import AGE, FRACTION

    spec = tmp_path / "replay.rl"
    spec.write_text(REPLAY_SPEC, encoding="utf-8")
    sets = ("train.steps=4", "checkpoint.every=2", "rollout.n=2")  # pairs: often equal, replaced
    full = loop.train(str(spec), config(vllm_model_dir, tmp_path / "full", *sets))
    records = steps_of(full)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    replayed = [r for r in records if r[FRACTION] > 0]
    assert replayed, [r[FRACTION] for r in records]
    for r in replayed:
        stats = [r[f"replay/ratio_{k}"] for k in ("mean", "min", "max")]
        assert all(math.isfinite(x) and x > 0 for x in stats), stats
        if r[AGE] == 0:  # groups of this very step: mu is the trainer's policy (float32), ratio 1
            assert stats == pytest.approx([1.0] * 3, abs=1e-4), stats
    assert all(math.isfinite(r[LOSS]) for r in records)
    cut = loop.train(str(spec), config(vllm_model_dir, tmp_path / "cut", *sets), stop_after=2)
    assert ckpt.latest_checkpoint(cut).name == "step-2"
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(cut)).extra["replay"]["entries"]
    loop.train(str(spec), resume=cut)
    assert without_timing(steps_of(cut)) == without_timing(records)
    a = read_weights(ckpt.latest_checkpoint(full) / "policy")
    b = read_weights(ckpt.latest_checkpoint(cut) / "policy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rows(batch, rows) -> list[tuple[list[int], list[int], list[int], list[float]]]:
    """(prompt ids, response ids, loss mask, behaviour logprobs) of each of ``rows`` up to its
    attention's end (batches pad their responses to different widths)."""
    out = []
    for i in rows:
        n = int(batch.response_attention[i].sum())
        out.append((batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist(), batch.response_ids[i, :n].tolist(),
                    batch.response_mask[i, :n].tolist(), batch.logprobs[i, :n].tolist()))
    return out


def test_an_agents_replay_on_vllm_trains_recorded_episodes_and_resumes_as_its_twin(vllm_model_dir, tmp_path,
                                                                                   monkeypatch):
    """sampling replay with rollout.engine=vllm and an agent (agent_helpers:odd_answers_break: an
    episode makes two rows when its row's answer is odd, one otherwise; its reward from the first
    reply), 4 steps: groups of episodes sampled through the endpoint on vLLM are kept and replayed;
    a replayed episode's rows are its recorded ones (ids, masks, vLLM's logprobs as behaviour
    policy, rewards) then padding, and a group replayed in the step that sampled it has ratio 1;
    the loss is finite. The run resumed from its step-2 checkpoint (its folder copied, the step-4
    checkpoint removed: one engine start fewer) samples and trains as the uninterrupted one."""
    import math
    import shutil

    from rldsl.runtime.records.metrics import AGENT_ROWS_PER_EPISODE, LOSS
    from rldsl.runtime.rollout.replay import AGE, FRACTION, ReplayBuffer

    steps: list[tuple] = []  # (fresh groups, the batch trained, replay metrics), one per step
    real = ReplayBuffer.step

    def spy(self, made, version, informative, P, generator, now=None, ahead=False):
        out, m = real(self, made, version, informative, P, generator, now, ahead)
        steps.append((made, out, m))
        return out, m

    monkeypatch.setattr(ReplayBuffer, "step", spy)
    spec = tmp_path / "replay.rl"
    spec.write_text(REPLAY_SPEC, encoding="utf-8")
    sets = ("train.steps=4", "checkpoint.every=2", "rollout.n=2", "rollout.prompts_per_step=3", "reward.name=env",
            "rollout.agent=agent_helpers:odd_answers_break", "rollout.agent_concurrency=1", "log.samples_per_step=3")
    full = loop.train(str(spec), config(vllm_model_dir, tmp_path / "full", *sets))
    records = steps_of(full)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and len(steps) == 4
    assert max(r[AGENT_ROWS_PER_EPISODE] for r in records) > 1.0, "episodes of two rows"
    assert any(r[FRACTION] > 0 for r in records), [r[FRACTION] for r in records]
    assert all(math.isfinite(r[LOSS]) for r in records)
    ages: list[int] = []  # of the replayed groups compared with their recordings
    own_step = False
    for at, (made, out, m) in enumerate(steps):
        G = out.batch.group_size
        for g, age in enumerate(out.replay_ages):
            if age is None:
                continue
            source = steps[at - age][0]  # the step that sampled the group (its fresh groups)
            k = source.batch.group_size
            s = source.prompt_ids.index(out.prompt_ids[g])
            mine = range(g * G, (g + 1) * G)
            own = [i for i in mine if not out.batch.episodes[i].agent.padding]
            recorded = [i for i in range(s * k, (s + 1) * k) if not source.batch.episodes[i].agent.padding]
            assert _rows(out.batch, own) == _rows(source.batch, recorded)  # vLLM's logprobs, exactly
            assert bool(out.batch.replayed[list(mine)].all())
            assert all(not any(out.batch.response_mask[i].tolist()) for i in mine if i not in own)
            assert set(out.scored[list(mine)].tolist()) <= set(source.scored[s * k:(s + 1) * k].tolist())
            ages.append(age)
        if m[FRACTION] > 0:
            stats = [records[at][f"replay/ratio_{x}"] for x in ("mean", "min", "max")]
            assert all(math.isfinite(x) and x > 0 for x in stats), stats
            if m[AGE] == 0:  # groups of this very step: mu is vLLM's logprobs of the trained policy
                assert stats == pytest.approx([1.0] * 3, abs=1e-4), stats
                own_step = True
    assert own_step and 0 in ages and max(ages) > 0, ages  # replayed in their own step and in later ones
    cut = tmp_path / "cut"  # the run as it stood after its step-2 checkpoint
    shutil.copytree(full, cut)
    shutil.rmtree(ckpt.latest_checkpoint(cut))
    assert ckpt.latest_checkpoint(cut).name == "step-2"
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(cut)).extra["replay"]["entries"]
    loop.train(str(spec), resume=cut)
    assert without_timing(steps_of(cut)) == without_timing(records)
    assert (cut / "samples.jsonl").read_text() == (full / "samples.jsonl").read_text()
    a = read_weights(ckpt.latest_checkpoint(full) / "policy")
    b = read_weights(ckpt.latest_checkpoint(cut) / "policy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
