"""The spec warnings printed once at the start of `rldsl run`, checked against the run's config."""
from __future__ import annotations

from pathlib import Path


from rldsl.runtime.run import loop
from small_run import small_run


def _config(model_dir: Path, out: Path, *extra: str):
    """No step: the warnings print before the first."""
    return small_run(model_dir, out, "rollout.prompts_per_step=2", "rollout.n=8", "train.steps=0", "eval.samples=0",
                     "data.eval_size=2", *extra)


def test_run_start_prints_the_warnings_of_the_spec_and_of_the_config(model_dir, tmp_path, capsys):
    spec = tmp_path / "slips.rl"
    spec.write_text("algorithm slips extends dr_grpo\n"
                    "  kl            k3(beta=0.0, where=loss)\n"
                    "  correction    importance(level=token, high=2.0)\n")
    loop.train(str(spec), _config(model_dir, tmp_path / "run", "rollout.n=1",
                                  "rollout.max_new_tokens=8", "train.allow_zero_advantages=true"))
    out = capsys.readouterr().out
    assert f"{spec}:2:20: warning: kl k3(beta=0.0) multiplies the term by 0" in out
    # dr_grpo's constant 4096 is not this run's budget of 8 tokens; the line is in the parent
    assert "warning: aggregation token_sum_norm(max_tokens=4096) is not the run's generation budget " \
           "rollout.max_new_tokens=8" in out and "dr_grpo.rl:" in out
    assert "baseline group_mean compares the samples of a prompt's group, but rollout.n=1" in out
    assert "correction importance: rollout.engine=hf samples with the trainer's own logprobs" in out
    assert out.count("warning:") == 4, out


def test_a_clean_run_prints_no_warning(model_dir, tmp_path, capsys):
    loop.train("grpo", _config(model_dir, tmp_path / "run", "rollout.n=2"))
    assert "warning:" not in capsys.readouterr().out
