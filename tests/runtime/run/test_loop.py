"""End-to-end runs of the one-machine runtime with a tiny random model (fast) and the demo (slow)."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import rldsl
from rldsl.cli import app
from rldsl.runtime.records import checkpoint as ckpt
from rldsl.runtime.run import folder, loop
from rldsl.runtime.run import schedule
from rldsl.runtime.config import load_config
from rldsl.runtime.errors import RunError
from rldsl.runtime.records.metrics import read_metrics
from small_run import small_run, steps_of, without_timing

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(rldsl.library()))
def test_every_library_algorithm_trains(name, model_dir, tmp_path):
    over = {}
    if rldsl.load(name).uses_teacher:  # a distillation spec: the embedded warm model teaches
        from rldsl.runtime.toy import warm_start
        over["teacher.path"] = warm_start()
    run = loop.train(name, small_run(model_dir, tmp_path / "run", **over))
    recs = steps_of(run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    updated = [r for r in recs if r.get("optimizer_steps", 0) > 0]
    assert updated, f"{name}: no optimizer step in 3 steps"
    for r in updated:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert 0.0 <= r["clip_fraction"] <= 1.0
    algo = rldsl.load(name)
    if algo.uses_critic:
        assert all(math.isfinite(r["value_loss"]) for r in updated)
    if algo.kl_in == "loss":
        assert all(math.isfinite(r["kl"]) for r in updated)
    if algo["sampling"].component == "dynamic":
        assert all(r["sampling_rounds"] >= 1 for r in recs)
    if any(v.component == "pass_rate_cap" for v in algo["filter"]):
        assert all("retired_prompts" in r for r in recs)
    if "rollout_logprobs" in algo.needs():  # the engine's logprobs reach estimate() and loss()
        for r in recs:  # the HF engine's logprobs equal the trainer's: weights 1, nothing rejected
            assert r["correction/is_mean"] == pytest.approx(1.0, abs=1e-4)
            assert r["correction/rejected_fraction"] == 0.0 and abs(r["correction/mismatch_kl"]) < 1e-4
    # the run folder is complete and loadable
    assert (run / "config.json").is_file() and (run / "spec.rl").read_text() == algo.source
    last = ckpt.latest_checkpoint(run)
    assert last is not None and last.name == "step-3"
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(last / "policy")


def _params(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(ckpt.latest_checkpoint(run) / "policy" / "model.safetensors"))


@pytest.mark.slow
def test_interrupted_and_resumed_equals_uninterrupted(model_dir, tmp_path):
    cfg = small_run(model_dir, tmp_path / "full", **{"train.steps": 6, "checkpoint.every": 2})
    full = loop.train("grpo", cfg)
    cfg2 = small_run(model_dir, tmp_path / "cut", **{"train.steps": 6, "checkpoint.every": 2})
    cut = loop.train("grpo", cfg2, stop_after=3)
    assert ckpt.latest_checkpoint(cut).name == "step-3"
    assert len(steps_of(cut)) == 3
    loop.train("grpo", resume=cut)
    assert without_timing(steps_of(cut)) == without_timing(steps_of(full))
    a, b = _params(full), _params(cut)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# SIGKILL of a real `rldsl run` and --resume: tests/faults/test_kill_resume.py, at every phase of a
# step (injected, not raced), the weights bit for bit the uninterrupted run's


@pytest.mark.slow
def test_metrics_read_by_progress_summary_and_plot_are_the_ones_a_run_writes(model_dir, tmp_path):
    """One spelling per metric: every name of metrics.METRICS is written by a step, and the
    progress line, the summary, the plot, the study report and the ablation runner read
    them through that table (a producer renaming one fails here)."""
    from rldsl.runtime.records import metrics
    from rldsl.runtime.records import plot
    from rldsl.runtime.ablate.report import FIGURES, run_numbers
    from rldsl.runtime.ablate.launch import cell_state
    run = loop.train("lite_ppo", small_run(model_dir, tmp_path / "run", **{"eval.every": 1}))
    records = read_metrics(run / "metrics.jsonl")
    written = set().union(*records)
    assert set(metrics.METRICS) <= written and set(metrics.KEY_METRICS) == set(metrics.METRICS)
    assert {key for _, _, lines in plot.PANELS for key, _ in lines} <= written
    drawn = {line[1] for _title, _unit, lines in plot.collect_panels(["r"], [records]) for line in lines}
    assert drawn == set(FIGURES) == {metrics.metric_by_concept(c).concept for c in FIGURES}
    n = run_numbers(records, 3, threshold=0.0)
    assert None not in (n.final_acc, n.final_sampled_acc, n.final_reward, n.final_response_length,
                        n.final_entropy, n.final_clip_fraction)
    assert n.final_acc == records[-1][metrics.GREEDY_ACC]
    assert cell_state(run, 3) == ("done", 3)  # the runner's reader sees the last step


@pytest.mark.slow
def test_user_model_jsonl_and_module_reward(model_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [{"question": f"{a}+{b}=", "solution": str(a + b)} for a in range(10, 30) for b in range(3)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = small_run(model_dir, tmp_path / "run", **{
        "data.path": data, "data.prompt_key": "question", "data.answer_key": "solution",
        "reward.name": "reward_helpers:answer_prefix=0.5,reward_helpers:parity=0.5",
        "rollout.max_new_tokens": 4, "data.eval_size": 6, "eval.every": 3})
    run = loop.train("dr_grpo", cfg)
    recs = steps_of(run)
    assert len(recs) == 3
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in recs)
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval/greedy_acc" in r]
    assert evals and evals[-1]["step"] == 3
    saved = json.loads((run / "config.json").read_text())
    assert saved["data"]["prompt_key"] == "question"


# ----------------------------------------------------------------------------- bad input

runner = CliRunner()


def test_missing_model_folder_is_a_clear_error(tmp_path):
    res = runner.invoke(app, ["run", "grpo", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "r")])
    assert res.exit_code == 2
    assert "model folder not found" in res.output and "Traceback" not in res.output


def test_a_resume_refuses_a_metrics_file_or_spec_that_is_not_utf8_before_any_model_loads(model_dir, tmp_path):
    """metrics.jsonl is ASCII JSON; a byte that is not UTF-8 (the file changed by something else) was
    a UnicodeDecodeError after the model loaded (exit 1); now open_run refuses it, naming the line."""
    run = tmp_path / "run"
    folder.open_run("lite_ppo", small_run(model_dir, run))  # the folder a new run writes before any model loads
    (run / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 0.5}\n{"step": 2, "note": "caf\xe9"}\n')
    with pytest.raises(RunError, match=r"metrics\.jsonl:2:25: not UTF-8 text \(byte 0xe9\)"):
        folder.open_run("lite_ppo", resume=run)
    (run / "metrics.jsonl").unlink()
    (run / "spec.rl").write_bytes((run / "spec.rl").read_bytes() + b"# caf\xe9\n")
    with pytest.raises(RunError, match=r"spec\.rl:\d+:6: not UTF-8 text \(byte 0xe9\)"):
        folder.open_run("lite_ppo", resume=run)


def test_out_naming_a_file_or_a_folder_that_cannot_be_written_is_refused(model_dir, tmp_path):
    (tmp_path / "afile").write_text("a user's file")
    for out in (tmp_path / "afile", tmp_path / "afile" / "run"):
        with pytest.raises(RunError, match="afile is a file, not a folder"):
            folder.open_run("lite_ppo", small_run(model_dir, out))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):
        pytest.skip("this user writes into a read-only folder (root)")
    with pytest.raises(RunError, match=f"--out {locked / 'run'}: {locked} is not writable"):
        folder.open_run("lite_ppo", small_run(model_dir, locked / "run"))


def test_out_in_a_folder_that_takes_no_new_folders_is_refused_as_root_too(model_dir):
    """os.access says a folder is writable to root, and /proc's permissions say so to anyone, yet
    no folder can be made there: --out /proc/x passed the check and failed as a FileNotFoundError
    (exit 1); the check now makes (and removes) a folder there to find out."""
    if not Path("/proc").is_dir():
        pytest.skip("no /proc on this system")
    with pytest.raises(RunError, match="--out /proc/rldsl-run: /proc is not writable"):
        folder.open_run("lite_ppo", small_run(model_dir, Path("/proc/rldsl-run")))


def test_dataset_rows_without_fields(model_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": "2+2="}) + "\n")
    res = runner.invoke(app, ["run", "grpo", "--model", str(model_dir), "--data", str(data),
                              "--out", str(tmp_path / "r"), "--set", "log.progress=false"])
    assert res.exit_code != 0
    assert "bad.jsonl" in res.output and "2" in res.output and "answer" in res.output
    assert "Traceback" not in res.output


@pytest.mark.slow
def test_reward_that_raises_stops_the_run_with_the_sample(model_dir, tmp_path):
    cfg = small_run(model_dir, tmp_path / "run", **{"reward.name": "reward_helpers:explode",
                                                       "rollout.temperature": 3.0})
    from rldsl.runtime.errors import RewardError
    with pytest.raises(RewardError) as e:
        loop.train("grpo", cfg)
    msg = str(e.value)
    assert "explode" in msg and "sample" in msg and "ZeroDivisionError" in msg and "completion" in msg


@pytest.mark.slow
def test_reward_errors_skipped_when_configured(model_dir, tmp_path):
    cfg = small_run(model_dir, tmp_path / "run", **{"reward.name": "reward_helpers:explode",
                                                       "reward.on_error": "skip",
                                                       "rollout.temperature": 3.0})
    run = loop.train("grpo", cfg)
    recs = steps_of(run)
    assert sum(r["reward_errors"] for r in recs) > 0
    assert sum(r["nonfinite_rewards"] for r in recs) == sum(r["reward_errors"] for r in recs)
    assert all(math.isfinite(r["reward_mean"]) for r in recs if r["reward_errors"] < 16)


@pytest.mark.slow
def test_a_reward_call_past_reward_timeout_s_is_skipped_and_counted_and_the_run_goes_on(model_dir, tmp_path,
                                                                                         monkeypatch):
    """The run's first reward call hangs (reward_helpers.hangs_once): with reward.timeout_s=1 its
    process is killed, that sample is skipped (on_error is 'raise': a timeout still skips) and
    counted in reward_timeouts, and every step trains."""
    monkeypatch.setenv("RLDSL_TEST_HANG_ONCE", str(tmp_path / "hung"))
    cfg = small_run(model_dir, tmp_path / "run", **{"reward.name": "reward_helpers:hangs_once",
                                                       "reward.timeout_s": 1.0, "reward.on_error": "raise"})
    recs = steps_of(loop.train("grpo", cfg))
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [r["reward_timeouts"] for r in recs] == [1.0, 0.0, 0.0]
    assert [r["reward_errors"] for r in recs] == [1.0, 0.0, 0.0]
    assert (tmp_path / "hung").exists()


@pytest.mark.slow
def test_nan_loss_skips_the_step_and_keeps_weights(model_dir, tmp_path, monkeypatch):
    real = rldsl.CompiledAlgorithm.loss
    calls = {"n": 0}

    def poisoned(self, *a, **k):
        out = real(self, *a, **k)
        calls["n"] += 1
        if calls["n"] == 2:  # the second update
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(rldsl.CompiledAlgorithm, "loss", poisoned)
    snapshots = []
    real_step = schedule.train_step

    def spy(s, step, producer=None):
        before = {k: v.clone() for k, v in s.trainers.policy.state_dict().items()}
        m = real_step(s, step, producer)
        snapshots.append((m, before, {k: v.clone() for k, v in s.trainers.policy.state_dict().items()}))
        return m

    monkeypatch.setattr(schedule, "train_step", spy)
    loop.train("lite_ppo", small_run(model_dir, tmp_path / "run"))
    m, before, after = snapshots[1]
    assert m["skipped_nonfinite"] == 1.0 and m["optimizer_steps"] == 0.0
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())


@pytest.fixture
def ctrl_c_delivered():
    """Ctrl-C as a terminal delivers it: Python's own SIGINT handler, whatever this process
    inherited. A test process started as a background job of a non-interactive shell (``cmd &``
    in a script) has SIGINT ignored, and the run rightly leaves an ignored SIGINT ignored -- the
    Ctrl-C tests would then test nothing of Ctrl-C."""
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, inherited)


@pytest.mark.slow
@pytest.mark.usefixtures("ctrl_c_delivered")
def test_ctrl_c_finishes_the_step_then_writes_a_checkpoint(model_dir, tmp_path, monkeypatch):
    """Ctrl-C during step 3 (a real SIGINT): the step is finished, logged and saved as step-3 —
    a checkpoint taken mid-step would hold a half-applied step."""
    real_step = schedule.train_step

    def interrupt(s, step, producer=None):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(s, step, producer)

    monkeypatch.setattr(schedule, "train_step", interrupt)
    cfg = small_run(model_dir, tmp_path / "run", **{"train.steps": 5})
    with pytest.raises(KeyboardInterrupt):
        loop.train("lite_ppo", cfg)
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step-3"
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]  # eval.every=0: no evaluation record at step 0


@pytest.mark.slow
@pytest.mark.usefixtures("ctrl_c_delivered")
def test_a_second_ctrl_c_stops_mid_step_without_a_checkpoint(model_dir, tmp_path, monkeypatch):
    real_step = schedule.train_step

    def interrupt(s, step, producer=None):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next line
        return real_step(s, step, producer)

    monkeypatch.setattr(schedule, "train_step", interrupt)
    cfg = small_run(model_dir, tmp_path / "run", **{"train.steps": 5, "checkpoint.every": 1})
    with pytest.raises(KeyboardInterrupt):
        loop.train("lite_ppo", cfg)
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step-2"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


@pytest.mark.slow
@pytest.mark.usefixtures("ctrl_c_delivered")
def test_ctrl_c_names_the_resume_command_once(model_dir, tmp_path, monkeypatch):
    real_step = schedule.train_step

    def interrupt(s, step, producer=None):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during step 3: it finishes, step-3 is saved
        return real_step(s, step, producer)

    monkeypatch.setattr(schedule, "train_step", interrupt)
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", "lite_ppo", "--model", str(model_dir), "--out", str(run),
                                   "--set", "rollout.prompts_per_step=4", "--set", "rollout.n=4",
                                   "--set", "train.steps=5", "--set", "eval.every=0", "--set", "data.eval_size=8",
                                   "--set", "log.progress=false", "--reward", "reward_helpers:parity"])
    assert res.exit_code == 130, res.output
    assert res.output.count("--resume") == 1, res.output
    assert res.output.endswith(f"interrupted; continue from checkpoint step-3 with:\nrldsl run --resume {run}\n")


@pytest.mark.slow
def test_eval_every_0_switches_evaluation_off_and_n_at_least_steps_evaluates_at_both_ends(model_dir, tmp_path):
    off = loop.train("lite_ppo", small_run(model_dir, tmp_path / "off", **{"eval.every": 0}))
    assert [r for r in read_metrics(off / "metrics.jsonl") if any(k.startswith("eval/") for k in r)] == []
    ends = loop.train("lite_ppo", small_run(model_dir, tmp_path / "ends", **{"eval.every": 3}))
    assert [r["step"] for r in read_metrics(ends / "metrics.jsonl") if "eval/greedy_acc" in r] == [0, 3]


@pytest.mark.slow
def test_a_run_whose_every_reward_is_skipped_stops_after_max_skipped_steps(model_dir, tmp_path):
    run = tmp_path / "run"
    (tmp_path / "down.py").write_text("def down(prompt, completion, answer):\n    raise ConnectionError('API down')\n")
    res = CliRunner().invoke(app, ["run", "lite_ppo", "--model", str(model_dir), "--out", str(run),
                                   "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=2",
                                   "--set", "train.steps=8", "--set", "eval.every=0", "--set", "log.progress=false",
                                   "--set", "reward.on_error=skip", "--set", "reward.max_skipped_steps=2",
                                   "--reward", f"{tmp_path / 'down.py'}:down"])
    assert res.exit_code == 1, res.output
    assert "error: the reward failed on every sample of 2 steps in a row (steps 1-2; " in res.output
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("timeout_s", ["0", "30"])  # called in the run's process / in a worker process
def test_a_reward_that_calls_sys_exit_fails_the_run_saying_so(model_dir, tmp_path, timeout_s):
    """A reward's sys.exit(0) ended `rldsl run` with exit code 0, no message and no step trained
    (the reward wrapper and the CLI caught Exception only): it is the reward's error, exit 1."""
    (tmp_path / "bye.py").write_text("import sys\n\ndef bye(prompt, completion, answer):\n    sys.exit(0)\n")
    res = CliRunner().invoke(app, ["run", "lite_ppo", "--model", str(model_dir), "--out", str(tmp_path / "run"),
                                   "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=2",
                                   "--set", "train.steps=2", "--set", "eval.every=0", "--set", "log.progress=false",
                                   "--set", f"reward.timeout_s={timeout_s}", "--reward", f"{tmp_path / 'bye.py'}:bye"])
    assert res.exit_code == 1, res.output
    assert "failed on sample 0: RuntimeError: the function called sys.exit(0)" in res.output


@pytest.mark.slow
def test_existing_run_folder_is_not_overwritten(model_dir, tmp_path):
    cfg = small_run(model_dir, tmp_path / "run")
    loop.train("lite_ppo", cfg)
    with pytest.raises(RunError, match="already holds a run"):
        loop.train("lite_ppo", cfg)


# ----------------------------------------------------------------------------- the demo

@pytest.mark.slow
@pytest.mark.compile  # the demo as a user runs it: compiled losses
def test_demo_learns(tmp_path):
    """`rldsl run algorithms/lite_ppo.rl` on the embedded default: held-out greedy accuracy +30 points."""
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "rldsl.cli", "run", str(REPO / "algorithms" / "lite_ppo.rl"),
                          "--out", str(tmp_path / "demo"), "--set", "log.progress=false"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "demo" / "metrics.jsonl") if "eval/greedy_acc" in r]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == 300
    assert 0.15 <= first["eval/greedy_acc"] <= 0.45
    assert last["eval/greedy_acc"] - first["eval/greedy_acc"] >= 0.30, (first, last)
    assert time.time() - t0 < 300


def test_a_warm_start_trains_with_the_runs_threads(monkeypatch):
    """The embedded model is warm-started while the run is planned, before build() sets torch's
    threads: it must train with `threads` (1) already, not torch's default of one per core (two
    spinning OpenMP threads on a loaded 2-core machine ran a 3-minute warm start for over an hour)."""
    from rldsl.runtime.data.sources import source_of
    from rldsl.runtime.run import sources
    from rldsl.runtime.toy import tool_warmup

    seen = []

    def fake(vllm):
        seen.append(torch.get_num_threads())
        return Path("unused"), "unused"

    monkeypatch.setattr(tool_warmup, "embedded_model", fake)  # the calculator task's warm start
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cfg = load_config(None, ["threads=1", "data.task=calculator"])
        sources.model_folder(cfg, source_of(cfg))
    finally:
        torch.set_num_threads(before)
    assert seen == [1]
