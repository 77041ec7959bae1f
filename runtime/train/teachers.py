"""Where a distillation spec's teacher runs, and what it returns over a rollout.

Three places, one answer (:class:`TeacherForward`): the teacher's logprob of each sampled
token [B, Tr] and, for a top-k divergence, its k largest logprobs and their ids [B, Tr, k].

- ``teacher.path``: the model in the trainer's process (the trainer runs it: ``trainer.py``);
- ``teacher.path`` + ``teacher.actor=true``: the same forward (:func:`teacher_topk`) on a Ray
  actor of its own (:class:`TeacherActor`; a local Ray on 127.0.0.1 when none runs), so its
  weights and compute live outside the trainer's process;
- ``teacher.url``: an OpenAI-compatible server that returns prompt logprobs
  (:class:`TeacherServer`): each row's prompt + response token ids are sent as a token-id prompt
  to ``/v1/completions`` with ``prompt_logprobs=k`` (vLLM's extension: at each prompt position
  the logprob of the token there and of the k most likely ones, with their ranks), ``max_tokens=1``.

- ``teacher.self``: the policy itself, no gradient (its forward in the trainer, under no_grad,
  before the step's update); ``teacher.ema``: a frozen copy of the policy updated after each
  optimizer step as ema = decay*ema + (1-decay)*policy (:func:`ema_update`), saved in checkpoints.

With ``teacher.context_key`` the teacher (any of them) scores the same sampled response tokens
after a privileged prompt: each row's prompt with a data column in it (data/datasets.py
``with_context``), carried by the batch as ``teacher_prompt_ids`` (:func:`privileged`).

A divergence over the whole vocabulary (``distill jsd``) reads the teacher's last hidden states
[B, Tr, H_t] and LM head in the trainer, chunk by chunk against the student's (train/divergence.py):
the actor returns the hidden states with the logprobs, and its LM head (V x H_t, the one piece of
the teacher the trainer holds: :class:`TeacherHead`) is copied to the trainer once, at the first
such step. A server returns logprobs only, so ``jsd`` needs ``teacher.path`` (in process or on an
actor); and vLLM computes prompt logprobs from the raw logits (temperature 1): a server teacher
needs rollout temperature 1 (0 scores at 1) -- both checked by resolve.check_teacher before any
model loads. ``teacher_of`` builds the teacher when the trainer
is built, and checks a server there (``check_server``): it answers, serves the policy's tokenizer
and returns k logprobs per position.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor, nn

from ..batch import RolloutBatch, model_inputs
from ..config import RunConfig
from ..errors import ConfigError, TeacherError
from ..rewards.remote import Http, check_url, post_json
from ..models.loading import autocast_dtype, head_weights, load_policy, master_dtype
from .divergence import chunked_generalized_jsd
from .logprobs import TRANSFORM_FIELDS, logit_transform, token_topk


@dataclass(frozen=True)
class TeacherForward:
    """The teacher's numbers over a rollout (no grad, at the rollout temperature)."""

    logprobs: Tensor                 # [B, Tr] of the sampled tokens
    topk_logprobs: Tensor | None     # [B, Tr, J] its J largest logprobs at each position
    topk_ids: Tensor | None          # [B, Tr, J] their token ids
    hidden: Tensor | None = None     # [B, Tr, H_t] its last hidden states (a JSD over the vocabulary)


class RemoteTeacher(Protocol):
    """A teacher outside the trainer's process (:class:`TeacherActor`, :class:`TeacherServer`)."""

    def topk(self, batch: RolloutBatch, k: int, temperature: float, group_size: int | None,
             hidden: bool = False) -> tuple[Tensor, ...]:
        """(logprobs [b, Tr], top-k logprobs [b, Tr, k], their ids [b, Tr, k]) over ``batch``, and
        with ``hidden`` the teacher's last hidden states [b, Tr, H_t] (an actor only)."""
        ...


class TeacherHead(nn.Module):
    """A remote teacher's LM head in the trainer's process: the linear layer (frozen) and the
    config numbers of its logit transform (logprobs.logit_transform reads them), all that the
    vocabulary JSD needs of the teacher beside its hidden states (vocabulary_jsd)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, config: dict[str, float]) -> None:
        super().__init__()
        self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                                 device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)
            if bias is not None:
                self.lm_head.bias.copy_(bias)
        self.lm_head.requires_grad_(False)
        self.config = SimpleNamespace(**config)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def head_parts(model: nn.Module) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    """(weight [V, H], bias [V] or None, the config numbers of its logit transform) of ``model``'s
    LM head, on the CPU: what :class:`TeacherHead` is made of."""
    head = model.get_output_embeddings()
    numbers = {a: getattr(model.config, a) for a in TRANSFORM_FIELDS
               if getattr(model.config, a, None) is not None}
    bias = head.bias.detach().cpu() if getattr(head, "bias", None) is not None else None
    return head.weight.detach().cpu(), bias, numbers


def privileged(batch: RolloutBatch) -> RolloutBatch:
    """The batch the teacher scores: each row's privileged prompt (``teacher_prompt_ids``,
    left padded) before the same response tokens; ``batch`` itself when it has none. The
    response columns are unchanged, so the teacher's [B, Tr] numbers line up with the policy's."""
    rows = batch.teacher_prompt_ids
    if not rows:
        return batch
    if len(rows) != len(batch):
        raise ValueError(f"{len(rows)} teacher prompts for {len(batch)} rows")
    Tp = max(len(r) for r in rows)
    dev = batch.prompt_ids.device
    ids = torch.zeros(len(rows), Tp, dtype=batch.prompt_ids.dtype, device=dev)
    mask = torch.zeros(len(rows), Tp, dtype=batch.prompt_mask.dtype, device=dev)
    for i, r in enumerate(rows):
        if r:
            ids[i, Tp - len(r):] = torch.tensor(r, dtype=ids.dtype, device=dev)
            mask[i, Tp - len(r):] = 1
    return dataclasses.replace(batch, prompt_ids=ids, prompt_mask=mask, teacher_prompt_ids=[])


def ema_copy(policy: nn.Module) -> nn.Module:
    """The EMA teacher at the start (``teacher.ema``): a frozen copy of ``policy``, eval mode."""
    ema = copy.deepcopy(policy).eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    return ema


@torch.no_grad()
def ema_update(ema: nn.Module, policy: nn.Module, decay: float) -> None:
    """ema = decay * ema + (1 - decay) * policy, parameter by parameter (the buffers copied)."""
    for e, p in zip(ema.parameters(), policy.parameters(), strict=True):
        e.mul_(decay).add_(p.detach().to(e.dtype), alpha=1.0 - decay)
    for e, b in zip(ema.buffers(), policy.buffers(), strict=True):
        e.copy_(b)


def teacher_topk(model: nn.Module, batch: RolloutBatch, k: int, *, temperature: float, chunk: int,
                 group_size: int | None, autocast: Any, hidden: bool = False) -> tuple[Tensor, ...]:
    """The teacher's no-grad forward over ``batch``: (logprobs [b, Tr], top-k logprobs [b, Tr, k],
    their ids [b, Tr, k]) and with ``hidden`` its last hidden states, last (logprobs.token_topk)."""
    ids, attn, _ = model_inputs(batch)
    with torch.no_grad(), autocast:
        return token_topk(model, ids, attn, batch.response_ids.shape[1], k, chunk_size=chunk,
                          group_size=group_size, temperature=temperature, return_hidden=hidden)


class TeacherModel:
    """The teacher folder loaded for scoring, in the process that holds it (a Ray actor)."""

    def __init__(self, path: str, dtype: str, device: str, chunk: int, autocast_dtype: str | None) -> None:
        self.model = load_policy(Path(path), master_dtype(dtype)).to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.chunk = chunk
        self.autocast_dtype = getattr(torch, autocast_dtype) if autocast_dtype else None

    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    def head(self) -> tuple[Tensor, Tensor | None, dict[str, float]]:
        return head_parts(self.model)

    def topk(self, batch: RolloutBatch, k: int, temperature: float, group_size: int | None,
             hidden: bool = False) -> tuple[Tensor, ...]:
        device = next(self.model.parameters()).device
        autocast = (torch.autocast(device_type=device.type, dtype=self.autocast_dtype)
                    if self.autocast_dtype is not None else contextlib.nullcontext())
        out = teacher_topk(self.model, batch.to(device), k, temperature=temperature, chunk=self.chunk,
                           group_size=group_size, autocast=autocast, hidden=hidden)
        return tuple(t.cpu() for t in out)


class TeacherActor:
    """:class:`TeacherModel` on a Ray actor of its own, started on first use (in a one-process
    run a local Ray on 127.0.0.1 is started). A call whose actor died is made again on the
    restarted actor, ``max_restarts`` times; then the run stops with a :class:`TeacherError`."""

    def __init__(self, path: str, *, dtype: str, device: str, chunk: int, autocast_dtype: str | None,
                 num_cpus: float, num_gpus: float, max_restarts: int, start_timeout_s: float) -> None:
        self.path = path
        self.args = (path, dtype, device, chunk, autocast_dtype)
        self.num_cpus, self.num_gpus = float(num_cpus), float(num_gpus)
        self.max_restarts, self.start_timeout_s = int(max_restarts), float(start_timeout_s)
        self._actor: Any = None
        self._head: TeacherHead | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"TeacherActor({self.path!r})"

    def _started(self) -> Any:
        with self._lock:
            if self._actor is None:
                import ray

                if not ray.is_initialized():
                    ray.init(address="local", num_cpus=max(1, math.ceil(self.num_cpus)), include_dashboard=False,
                             log_to_driver=False, _node_ip_address="127.0.0.1")
                actor = ray.remote(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=self.max_restarts,
                                   max_task_retries=self.max_restarts)(TeacherModel).remote(*self.args)
                try:  # placed, and the model loaded
                    ray.get(actor.vocab_size.remote(), timeout=self.start_timeout_s)
                except ray.exceptions.GetTimeoutError:
                    ray.kill(actor)
                    raise TeacherError(
                        f"the teacher actor for teacher.path={self.path} did not start within "
                        f"{self.start_timeout_s:g} s (teacher.timeout_s; it reserves num_cpus={self.num_cpus:g}, "
                        f"num_gpus={self.num_gpus:g}: does the cluster have them free?)") from None
                except ray.exceptions.RayActorError as e:
                    raise TeacherError(f"the teacher actor for teacher.path={self.path} failed to start: "
                                       f"{str(e).splitlines()[0]}") from None
                self._actor = actor
            return self._actor

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        actor = self._started()
        try:  # a death is retried by Ray on the restarted actor, max_restarts times
            return ray.get(getattr(actor, method).remote(*args))
        except ray.exceptions.RayActorError as e:
            raise TeacherError(f"the teacher actor for teacher.path={self.path} died and its "
                               f"teacher.max_restarts={self.max_restarts} restarts are spent: "
                               f"{str(e).splitlines()[0]}") from None

    def topk(self, batch: RolloutBatch, k: int, temperature: float, group_size: int | None,
             hidden: bool = False) -> tuple[Tensor, ...]:
        out = self._call("topk", batch.to("cpu"), k, temperature, group_size, hidden)
        device = batch.response_ids.device
        return tuple(t.to(device) for t in out)

    def head(self, device: torch.device | str) -> TeacherHead:
        """The teacher's LM head in this process, on ``device`` (copied from the actor once)."""
        if self._head is None:
            self._head = TeacherHead(*self._call("head"))
        return self._head.to(device)

    def close(self) -> None:
        """Stop the actor (it is also stopped with the Ray cluster)."""
        if self._actor is not None:
            import ray

            ray.kill(self._actor)
            self._actor = None
        self._head = None


class TeacherServer:
    """A teacher behind an OpenAI-compatible ``/v1/completions`` that returns prompt logprobs
    (vLLM). Rows go ``rows_per_request`` at a time, one request each, several at once."""

    def __init__(self, url: str, *, model: str | None, timeout_s: float, rows_per_request: int,
                 vocab_size: int | None = None) -> None:
        check_url(url, "teacher.url")
        base = url.rstrip("/")
        self.url = base
        self.completions = base if base.endswith("/completions") else base + "/completions"
        self.api = self.completions[: -len("/completions")]
        self.http = Http(timeout=timeout_s, retries=2, backoff=0.5, concurrency=4)
        self.model = model
        self.rows_per_request = int(rows_per_request)
        self.vocab_size = vocab_size

    def __repr__(self) -> str:
        return f"TeacherServer({self.url!r})"

    def _get(self, path: str) -> Any:
        try:
            with urllib.request.urlopen(self.api + path, timeout=min(self.http.timeout, 30.0)) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise TeacherError(f"teacher.url={self.url}: GET {path} answered HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise TeacherError(f"teacher.url={self.url} is not reachable ({reason}): is the server "
                               "running? (vLLM: `vllm serve TEACHER --max-logprobs K`)") from None

    def model_name(self) -> str:
        if self.model is None:
            data = self._get("/models").get("data") or []
            if not data:
                raise TeacherError(f"teacher.url={self.url}: /models lists no model")
            self.model = str(data[0]["id"])
        return self.model

    def _post(self, body: dict[str, Any]) -> Any:
        return post_json(self.completions, {"model": self.model_name(), **body}, self.http, "teacher.url",
                         error=TeacherError)

    def tokenize(self, text: str) -> list[int]:
        """The server's token ids of ``text`` (vLLM's ``/tokenize``, no special tokens added)."""
        root = self.api[: -len("/v1")] if self.api.endswith("/v1") else self.api
        out = post_json(root + "/tokenize", {"model": self.model_name(), "prompt": text,
                                             "add_special_tokens": False}, self.http, "teacher.url",
                        error=TeacherError)
        return [int(t) for t in out["tokens"]]

    def score_rows(self, rows: Sequence[Sequence[int]], starts: Sequence[int], k: int
                   ) -> list[tuple[list[float], list[list[float]], list[list[int]]]]:
        """Per row: the teacher's logprob of each token from ``starts[i]`` on, and its k largest
        logprobs with their ids there (from ``prompt_logprobs``; the first token has none)."""
        chunks = [list(range(i, min(i + self.rows_per_request, len(rows))))
                  for i in range(0, len(rows), self.rows_per_request)]

        def one(idx: list[int]) -> list[tuple[list[float], list[list[float]], list[list[int]]]]:
            answer = self._post({"prompt": [list(map(int, rows[i])) for i in idx], "max_tokens": 1,
                                 "temperature": 1.0, "prompt_logprobs": k})
            choices = answer.get("choices") if isinstance(answer, dict) else None
            if not isinstance(choices, list) or len(choices) != len(idx):
                raise TeacherError(f"teacher.url={self.url} answered {len(choices) if isinstance(choices, list) else 'no'} "
                                   f"choices for {len(idx)} prompts")
            by_index = sorted(choices, key=lambda c: c.get("index", 0))
            return [self._parse(by_index[j].get("prompt_logprobs"), rows[i], starts[i], k)
                    for j, i in enumerate(idx)]

        with ThreadPoolExecutor(max_workers=self.http.concurrency) as pool:
            parts = list(pool.map(one, chunks))
        return [r for part in parts for r in part]

    def _parse(self, entries: Any, row: Sequence[int], start: int, k: int
               ) -> tuple[list[float], list[list[float]], list[list[int]]]:
        if not isinstance(entries, list) or len(entries) != len(row):
            n = len(entries) if isinstance(entries, list) else "no"
            raise TeacherError(f"teacher.url={self.url} returned {n} prompt logprobs for a prompt of "
                               f"{len(row)} tokens: the server must return prompt_logprobs (vLLM's "
                               "/v1/completions does)")
        lp, top, ids = [], [], []
        for t in range(start, len(row)):
            entry = entries[t]
            if not isinstance(entry, dict) or str(int(row[t])) not in entry:
                raise TeacherError(f"teacher.url={self.url} returned no logprob of the prompt's token "
                                   f"{int(row[t])} at position {t}")
            cand = sorted(((float(v["logprob"]), int(tok)) for tok, v in entry.items()
                           if int(v.get("rank", 0) or 0) <= k), reverse=True)[:k]
            if len(cand) < k:
                raise TeacherError(f"teacher.url={self.url} returned {len(cand)} top logprobs at a position "
                                   f"and the spec asks for k={k}: raise the server's limit (vLLM "
                                   f"--max-logprobs) or lower k")
            if self.vocab_size is not None and any(i >= self.vocab_size for _, i in cand):
                raise TeacherError(f"teacher.url={self.url} returned token id {max(i for _, i in cand)}, beyond "
                                   f"the policy's vocabulary of {self.vocab_size}: it serves another model")
            lp.append(float(entry[str(int(row[t]))]["logprob"]))
            top.append([c[0] for c in cand])
            ids.append([c[1] for c in cand])
        return lp, top, ids

    def topk(self, batch: RolloutBatch, k: int, temperature: float, group_size: int | None,
             hidden: bool = False) -> tuple[Tensor, ...]:
        del group_size  # the server caches prompts itself
        if hidden:  # resolve.check_teacher refuses a JSD over the vocabulary with a server
            raise TeacherError("teacher.url returns logprobs only, not the teacher's hidden states")
        if temperature != 1.0:
            raise TeacherError(f"teacher.url scores at temperature 1 and the rollout is scored at {temperature:g}")
        B, Tr = batch.response_ids.shape
        rows, starts, lengths = [], [], []
        resp_attn = batch.attention
        for i in range(B):
            prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
            n = int(resp_attn[i].sum())
            rows.append(prompt + batch.response_ids[i, :n].tolist())
            starts.append(len(prompt))
            lengths.append(n)
        scored = self.score_rows(rows, starts, k)
        dev = batch.response_ids.device
        lp = torch.zeros(B, Tr, device=dev)
        top = torch.full((B, Tr, k), -math.inf, device=dev)
        ids = torch.zeros(B, Tr, k, dtype=torch.long, device=dev)
        for i, (l, t, d) in enumerate(scored):
            n = lengths[i]
            if n == 0:
                continue
            lp[i, :n] = torch.tensor(l)
            if k:
                top[i, :n] = torch.tensor(t)
                ids[i, :n] = torch.tensor(d)
        return lp, top, ids


def check_server(server: TeacherServer, tokenizer: Any, k: int, spec: str) -> None:
    """A ``teacher.url`` server answers, serves the policy's tokenizer (a probe text spanning its
    vocabulary tokenizes to the same ids there, vLLM's ``/tokenize``) and returns ``k`` top prompt
    logprobs (vLLM refuses more than ``--max-logprobs``); else a ConfigError with the reason."""
    try:
        server.model_name()
        probe = probe_text(tokenizer)
        theirs, ours = server.tokenize(probe), tokenizer(probe, add_special_tokens=False)["input_ids"]
    except TeacherError as e:
        raise ConfigError(str(e)) from None
    if theirs != ours:
        at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        raise ConfigError(f"teacher.url={server.url} serves {server.model!r} with another tokenizer than the "
                          f"policy's: {probe!r} is {len(theirs)} tokens there and {len(ours)} here (first "
                          f"difference at token {at}): a teacher scores the policy's token ids, so both need "
                          "one vocabulary")
    try:
        server.score_rows([ours[:4]], [1], k)
    except TeacherError as e:
        raise ConfigError(f"{spec}: the teacher server does not return top-{k} prompt logprobs: {e}") from None


def teacher_of(cfg: RunConfig, policy: nn.Module, tokenizer: Any, k: int, chunk: int,
               spec: str) -> "nn.Module | RemoteTeacher | None":
    """The teacher of the run config's ``teacher`` section, None without one:

    - ``teacher.path``: the model (frozen, eval mode) on the trainer's device, in
      ``model.dtype``'s master dtype (its forwards run under the trainer's autocast);
    - with ``teacher.actor``: that model on a Ray actor of its own (started on first use);
    - ``teacher.url``: the server's client, checked (``check_server``) against the policy's
      ``tokenizer`` and the top-``k`` of ``spec``; ids beyond ``policy``'s vocabulary are refused.

    - ``teacher.self``: ``policy`` itself (its forwards run without gradient);
    - ``teacher.ema``: a frozen copy of ``policy`` (:func:`ema_copy`; the trainer updates it).

    resolve.check_teacher has checked the keys and the folder before any model loaded."""
    t = cfg.teacher
    if t.self:
        return policy
    if t.ema is not None:
        return ema_copy(policy)
    if t.url is not None:
        server = TeacherServer(t.url, model=t.model, timeout_s=t.timeout_s, rows_per_request=t.rows_per_request,
                               vocab_size=int(policy.get_output_embeddings().weight.shape[0]))
        if tokenizer is not None:
            check_server(server, tokenizer, k, spec)
        return server
    if t.path is None:
        return None
    if t.actor:
        compute = autocast_dtype(cfg.model.dtype)
        return TeacherActor(t.path, dtype=cfg.model.dtype, device="cuda" if t.num_gpus > 0 else "cpu", chunk=chunk,
                            autocast_dtype=str(compute).removeprefix("torch.") if compute else None,
                            num_cpus=t.num_cpus, num_gpus=t.num_gpus, max_restarts=t.max_restarts,
                            start_timeout_s=t.timeout_s)
    teacher = load_policy(Path(t.path), master_dtype(cfg.model.dtype)).to(cfg.device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def vocabulary_jsd(policy: nn.Module, teacher: nn.Module, hidden: Tensor, teacher_hidden: Tensor, beta: float,
                   temperature: float, chunk: int) -> Tensor:
    """The ``jsd`` component's divergence [N] of the policy (its last hidden states ``hidden``
    [N, H], with gradient) from the in-process teacher (``teacher_hidden`` [N, H_t]) through both
    LM heads, C = ``chunk`` tokens at a time (train/divergence.py)."""
    (s_weight, s_bias), t_head = head_weights(policy), teacher.get_output_embeddings()
    return chunked_generalized_jsd(hidden, s_weight, s_bias, teacher_hidden, t_head.weight, t_head.bias,
                                   beta, student_tf=logit_transform(policy, temperature),
                                   teacher_tf=logit_transform(teacher, temperature), chunk=chunk)


def probe_text(tokenizer: Any) -> str:
    """A text that spans the tokenizer's vocabulary: the decoded text of up to 64 token ids spread
    over it (special tokens left out)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    V = len(tokenizer)
    step = max(1, V // 64)
    ids = [i for i in range(0, V, step) if i not in special][:64]
    return "".join(tokenizer.decode([i]) for i in ids) + " 12+34=46"
