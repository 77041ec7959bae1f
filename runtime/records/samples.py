"""``samples.jsonl``: what the model saw and said, a few groups per step.

One JSON line per sample of the first ``log.samples_per_step`` prompt groups of every step:
``step``, ``group``, ``prompt`` (the text the engine tokenized: after the chat template and
system prompt), ``completion``, ``reward``, ``advantage`` (the mean of the sample's
per-token advantages over its loss mask; sequence-level algorithms have one value per
sample), ``finish_reason``, ``response_length`` (tokens) and ``rewards``, each reward term's
value by its label (null where it failed); a spec reading the reference model's reward adds
``ref_reward`` (the row's prompt's; null where every reference answer's reward failed) and the
reference's terms to ``rewards`` as ``ref/<term>``; a spec reading the policy's probability of the
reference answer adds ``answer_prob`` and ``bare_answer_prob``; a tree's rows (``sampling tree``) add ``tree``:
``{"parent": row, "split": position}``, the row of the group it forked from (-1: sampled from the
prompt) and the response position where its own tokens start (its fork point). ``rldsl samples RUN
[--step N]`` prints them as a table (:func:`read_samples`). A resumed run drops the
records after its checkpoint's step (:func:`truncate_samples`), as for the metrics.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rldsl.inputs import INPUTS
from rldsl.lazy_torch import torch  # imported at the first tensor operation: `rldsl run` checks first

from ..batch import RolloutBatch
from .run_dir import SAMPLES_FILE, write_text_atomic


def sample_rows(step: int, batch: RolloutBatch, rewards: torch.Tensor, advantages: torch.Tensor | None,
                mask: torch.Tensor | None, groups: int, ages: list[int | None] | None = None) -> list[dict[str, Any]]:
    """The records of the first ``groups`` prompt groups of a step's batch. ``advantages``
    None (the Ray trainers keep them on the ranks): the records' advantage is null. ``ages``
    (``sampling replay``, ``StepRollout.replay_ages``): each group's age in policy versions, None
    for a fresh one; a replayed group's rows say ``"replayed": true, "age": k``, the others
    ``"replayed": false``."""
    G = batch.group_size
    n = min(groups, len(batch) // G) * G
    lengths = batch.response_mask[:n].long().sum(-1).tolist()
    if advantages is None or mask is None:
        adv: list[float | None] = [None] * n
    else:
        m = mask[:n].float()
        adv = ((advantages[:n].float() * m).sum(-1) / m.sum(-1).clamp_min(1)).tolist()
    reference_inputs = [k for k in batch.inputs if INPUTS[k].source in ("reference_rollout", "answer")]
    out = []
    for i in range(n):
        out.append({"step": step, "group": i // G, "prompt": batch.prompts[i],
                    "completion": batch.completions[i], "reward": _number(rewards[i]),
                    "advantage": adv[i], "finish_reason": batch.finish_reason[i],
                    "response_length": lengths[i]})
        if ages is not None:  # sampling replay: a group kept from an earlier step, and how old
            age = ages[i // G]
            out[-1].update({"replayed": True, "age": age} if age is not None else {"replayed": False})
        if batch.tree:  # sampling tree: the row (of its group) it forked from and where (rollout/tree.py)
            parent, split = batch.tree[i]
            out[-1]["tree"] = {"parent": parent, "split": split}
        if batch.images and batch.images[i]:  # the row's images: where they are, not their pixels
            out[-1]["images"] = list(batch.images[i])
        if batch.reward_terms:  # each term's value (its label: rewards/<term>/mean in the metrics)
            out[-1]["rewards"] = {k: _number(v[i]) for k, v in batch.reward_terms.items()}
        # the reference model's reward of the row's prompt (ref_reward); the policy's probability of the
        # reference answer after the row's reasoning and alone (answer_prob, bare_answer_prob)
        for name in reference_inputs:
            out[-1][name] = _number(batch.inputs[name][i])
        if batch.episodes:  # a multi-turn episode: its messages (roles, tool calls, results)
            episode = batch.episodes[i]
            out[-1]["messages"] = episode_messages(episode.messages)
            out[-1]["env_reward"] = episode.env_reward
            attn = batch.attention[i]
            out[-1]["trained_tokens"] = lengths[i]  # the loss mask: the model's own tokens
            out[-1]["environment_tokens"] = int(attn.sum()) - lengths[i]  # tool results, turn markers
            agent = episode.agent
            if agent is not None:  # rollout.agent: its calls (ids sampled = trained) and its row
                p_ids = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
                r_attn = batch.response_attention[i].bool() if batch.response_attention is not None \
                    else batch.response_mask[i].bool()
                n_resp = int(r_attn.sum())
                out[-1]["agent"] = {"row": agent.row, "padding": agent.padding, "error": episode.error,
                                    "calls": agent.calls, "prefix_breaks": agent.prefix_breaks, "rows": agent.rows,
                                    # the row as trained: its ids, and 1 where the loss is taken
                                    "ids": p_ids + batch.response_ids[i, :n_resp].tolist(),
                                    "trained": [0] * len(p_ids) + batch.response_mask[i, :n_resp].long().tolist()}
    return out


def _number(x: torch.Tensor) -> float | None:
    """A sample's value; None where its reward failed (NaN)."""
    r = float(x)
    return r if math.isfinite(r) else None


def episode_messages(messages: list[dict]) -> list[dict]:
    """An episode's messages for samples.jsonl: each with ``trained`` -- true for the assistant's
    turns (their sampled tokens carry loss mask 1), false for what the environment added (the
    prompt, tool results: mask 0, no logprob)."""
    return [{**m, "trained": m.get("role") == "assistant"} for m in messages]


def append_samples(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    """Append records to ``<run>/samples.jsonl``."""
    if rows:
        with (Path(run_dir) / SAMPLES_FILE).open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def truncate_samples(run_dir: Path, step: int) -> None:
    """Keep the records of steps <= ``step`` (a run resumed from that step's checkpoint
    writes the later steps again); lines cut by a crash are dropped."""
    path = Path(run_dir) / SAMPLES_FILE
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if int(json.loads(line)["step"]) <= step:
                keep.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    write_text_atomic(path, "".join(keep))


def read_samples(run: Path, step: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """(the step, its records) from a run folder or a samples.jsonl file; the last step by default."""
    path = Path(run)
    if path.is_dir():
        path = path / SAMPLES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (samples are written from log.samples_per_step)")
    by_step: dict[int, list[dict[str, Any]]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step.setdefault(int(rec["step"]), []).append(rec)
    if not by_step:
        raise ValueError(f"{path}: no samples")
    if step is None:
        step = max(by_step)
    if step not in by_step:
        raise ValueError(f"{path}: no samples of step {step} (steps {min(by_step)}..{max(by_step)})")
    return step, by_step[step]
