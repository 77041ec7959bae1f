"""The state behind ``rldsl serve-tinker``: the served base models, sessions, training models,
samplers, and the futures every call answers with.

All model work runs on one worker thread, one job at a time (the device is one): a job is a
training model's call (executed in ``seq_id`` order among that model's queued calls; the client
submits them in that order) or a batch of sampling requests (every ``asample`` waiting for the
same sampler is gathered into one :func:`sampler.sample` call, and those queued while it runs
join it; with ``engine="vllm"``, into one vLLM ``generate`` call: vllm_sampler.py). The HTTP
handlers only read and check requests (a malformed one is a 4xx at once) and queue jobs.
"""
from __future__ import annotations

import heapq
import json
import itertools
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..errors import TinkerRefused
from ..models.loading import load_policy, load_tokenizer, model_context
from . import losses, wire
from .sampler import SampleJob, read_job, sample
from .trainer import LoraSpec, TrainedModel, saved_lora
from .vllm_sampler import VLLMSampling

log = logging.getLogger("rldsl.tinker")
#: a sampling batch stays open while its requests arrive less than this apart, at most GATHER_MAX_S
GATHER_GAP_S, GATHER_MAX_S = 0.005, 0.05


@dataclass
class Future:
    """A call's answer: JSON (``body``) or protobuf (``proto``), or a refusal, once ``done``.

    A waiting ``retrieve_future`` registers a callback (:meth:`on_done`) that the worker calls
    when it finishes the job, instead of checking ``done`` on a timer: the answer leaves as soon
    as it exists, and no waiting request takes CPU from the job it waits for."""

    done: threading.Event = field(default_factory=threading.Event)
    body: dict[str, Any] | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"
    _waiters: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def finish(self) -> None:
        """Mark the answer ready and call the waiters (on the worker's thread)."""
        with self._lock:
            self.done.set()
            waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()

    def on_done(self, wake: Callable[[], None]) -> None:
        """``wake()`` once the answer is ready: now if it is, else from :meth:`finish`'s thread."""
        with self._lock:
            if not self.done.is_set():
                self._waiters.append(wake)
                return
        wake()


@dataclass(order=True)
class _Job:
    order: tuple[int, int]  # (seq_id, arrival) within its model; (0, arrival) for the rest
    model_id: str = field(compare=False)
    run: Callable[[], Any] = field(compare=False)
    future: Future = field(compare=False)
    sample: SampleJob | None = field(compare=False, default=None)
    sampler: str | None = field(compare=False, default=None)


@dataclass
class Sampler:
    base: str
    model_id: str | None  # None: the base model itself
    version: int | None
    path: str | None


def _vocab_size(path: Path, tokenizer: Any) -> int:
    """The model's vocabulary (config.json's ``vocab_size``; the tokenizer's when it has none)."""
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    return int(config.get("vocab_size") or len(tokenizer))


class Service:
    """Everything ``rldsl serve-tinker`` serves, for ``models``: NAME -> local HF folder."""

    def __init__(self, models: dict[str, Path], root: Path, threads: int = 1, engine: str = "hf",
                 vllm_memory: float = 0.1) -> None:
        self.models, self.root = models, root
        # torch's intra-op threads, as a run's `threads` (1 by default): on a busy CPU two threads
        # made the tiny model's matmuls ~50x slower than one
        torch.set_num_threads(threads)
        self.tokenizers = {name: load_tokenizer(path) for name, path in models.items()}
        self.contexts = {name: model_context(path) for name, path in models.items()}
        self.vocab = {name: _vocab_size(path, self.tokenizers[name]) for name, path in models.items()}
        self.sessions: set[str] = set()
        self.trained: dict[str, TrainedModel] = {}
        self.metas: dict[str, tuple[str, LoraSpec]] = {}
        self.samplers: dict[str, Sampler] = {}
        self.bases: dict[str, Any] = {}
        self.futures: dict[str, Future] = {}
        self._queues: dict[str, list[_Job]] = {}
        self._arrival = itertools.count()
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(6)  # ids of one server run, unlike another's
        self._lock = threading.Condition()
        self._stop = False
        # --engine vllm: every asample on vLLM (vllm_sampler.py), the engines started here, before the port opens
        self.vllm: VLLMSampling | None = None
        if engine == "vllm":
            self.vllm = VLLMSampling(models, self.tokenizers, self.contexts, vllm_memory)
        self.worker = threading.Thread(target=self._work, name="tinker-worker", daemon=True)
        self.worker.start()

    # ------------------------------------------------------------------ futures and the worker
    def request_id(self) -> str:
        """A new request id: this server run's random prefix and a counter. Not ``uuid4`` per
        request: its ``os.urandom`` releases the interpreter lock, and the event loop, asking
        for it back while the worker's Python runs (sampling the step's first requests), waited
        ~0.8 ms a request -- ~0.08 s of the 100 ``asample`` calls of a step at ``math_rl``'s shape."""
        return f"{self._id_prefix}-{next(self._ids)}"

    def submit(self, model_id: str, run: Callable[[], Any], seq_id: int = 0,
               job: SampleJob | None = None, sampler: str | None = None) -> str:
        request_id = self.request_id()
        future = Future()
        with self._lock:
            self.futures[request_id] = future
            heapq.heappush(self._queues.setdefault(model_id, []),
                           _Job((seq_id, next(self._arrival)), model_id, run, future, job, sampler))
            self._lock.notify()
        return request_id

    def _next(self) -> list[_Job] | None:
        with self._lock:
            while not self._stop and not any(self._queues.values()):
                self._lock.wait()
            if self._stop:
                return None
            # the queue whose head arrived first
            key = min((q[0].order[1], k) for k, q in self._queues.items() if q)[1]
            queue = self._queues[key]
            first = heapq.heappop(queue)
            if first.sample is None:
                return [first]
            self._gather(queue, first.sampler)
            batch = [first] + [j for j in queue if j.sample is not None and j.sampler == first.sampler]
            self._queues[key] = [j for j in queue if j not in batch]
            heapq.heapify(self._queues[key])
            return batch

    def _gather(self, queue: list[_Job], sampler: str | None) -> None:
        """Hold a sampling batch open while requests for its sampler keep arriving (a quiet gap of
        GATHER_GAP_S ends it, GATHER_MAX_S at most): a recipe sends its requests one by one, and the
        first would otherwise be sampled alone (called with the lock held; waiting releases it)."""
        start = last = time.monotonic()
        seen = sum(j.sampler == sampler for j in queue)
        while time.monotonic() - last < GATHER_GAP_S and time.monotonic() - start < GATHER_MAX_S:
            self._lock.wait(GATHER_GAP_S)
            now = sum(j.sampler == sampler for j in queue)
            if now > seen:
                seen, last = now, time.monotonic()

    def _work(self) -> None:
        while (batch := self._next()) is not None:
            try:
                if batch[0].sample is not None:
                    self._sample_batch(batch)
                else:
                    self._finish(batch[0].future, batch[0].run)
            except Exception as e:  # a bug or a failed computation: the client sees it, the server goes on
                log.exception("tinker job failed")
                for j in batch:
                    if not j.future.done.is_set():
                        j.future.error, j.future.category = f"{type(e).__name__}: {e}", "server"
                        j.future.finish()

    @staticmethod
    def _finish(future: Future, run: Callable[[], Any]) -> None:
        try:
            result = run()
        except TinkerRefused as e:
            future.error = e.message
        else:
            if isinstance(result, bytes):
                future.proto = result
            else:
                future.body = result
        future.finish()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self.worker.join(timeout=30)
        if self.vllm is not None:
            self.vllm.close()

    # ------------------------------------------------------------------ sessions and models
    def new_session(self) -> str:
        sid = f"session-{uuid.uuid4().hex[:12]}"
        self.sessions.add(sid)
        return sid

    def base_path(self, name: str) -> Path:
        if name not in self.models:
            raise TinkerRefused(400, f"base model {name!r} is not served here; served: {sorted(self.models)}")
        return self.models[name]

    def create_model(self, base: str, lora: LoraSpec) -> tuple[str, str]:
        """(request id, model id) of a new training model (built on the worker)."""
        path = self.base_path(base)
        model_id = f"model-{uuid.uuid4().hex[:12]}"
        self.metas[model_id] = (base, lora)

        def run() -> dict[str, Any]:
            self.trained[model_id] = TrainedModel(model_id, base, path, lora)
            return {"model_id": model_id, "type": "create_model"}
        return self.submit(model_id, run), model_id  # seq 0: ahead of the model's own calls

    def meta(self, model_id: str) -> tuple[str, LoraSpec]:
        """(base model name, LoRA config) of a model created here; 404 for another id."""
        if model_id not in self.metas:
            raise TinkerRefused(404, f"unknown model_id {model_id!r} (create_model returns them)")
        return self.metas[model_id]

    def model(self, model_id: str) -> TrainedModel:
        if model_id not in self.trained:
            raise TinkerRefused(404, f"unknown model_id {model_id!r}")
        return self.trained[model_id]

    # ------------------------------------------------------------------ training calls
    def forward_backward(self, request: wire.FwdBwdRequest) -> str:
        loss = losses.resolve_loss(request.loss_fn, request.config)  # a bad loss: 400 before queueing
        losses.check_inputs(loss, [d.inputs for d in request.data])
        denominator = request.config.get(losses.DENOMINATOR_KEY)
        if denominator is not None and not isinstance(denominator, float):
            raise TinkerRefused(400, f"loss_fn_config[{losses.DENOMINATOR_KEY!r}] must be a number")

        def run() -> bytes:
            trained = self.model(request.model_id)
            rows = [(d.tokens, d.targets.tolist()) for d in request.data]
            vocab = trained.policy.get_output_embeddings().weight.shape[0]
            every = np.concatenate([np.asarray(t, dtype=np.int64) for r in rows for t in r])  # one check, not per token
            if every.size and (every.min() < 0 or every.max() >= vocab):
                raise TinkerRefused(400, f"forward_backward: a token is outside the model's vocabulary of {vocab}")
            logprobs = trained.logprobs(rows, grad=not request.forward_only)
            reference = trained.reference_logprobs(rows) if loss.reference else None
            value, metrics = losses.compute(loss, logprobs, [d.inputs for d in request.data], denominator, reference)
            if not request.forward_only:
                trained.backward(value)
                trained.loss_metrics.append(dict(metrics))
            metrics["loss:sum"] = float(value.detach())
            outputs = [{"logprobs": lp.detach().numpy()} for lp in logprobs]
            return wire.forward_backward_output(outputs, metrics)
        return self.submit(request.model_id, run, request.seq_id)

    def optim_step(self, model_id: str, seq_id: int, adam: dict[str, Any]) -> str:
        return self.submit(model_id, lambda: {"metrics": self.model(model_id).optim_step(adam)}, seq_id)

    def _folder(self, model_id: str, kind: str, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise TinkerRefused(400, f"a checkpoint name must be a plain folder name, got {name!r}")
        return self.root / model_id / kind / name

    def save_weights(self, model_id: str, seq_id: int, name: str | None) -> str:
        def run() -> dict[str, Any]:
            trained = self.model(model_id)
            label = name or f"step-{trained.steps:06d}"
            trained.save(self._folder(model_id, "weights", label), self.tokenizers[trained.base_name])
            return {"path": f"tinker://{model_id}/weights/{label}", "type": "save_weights"}
        return self.submit(model_id, run, seq_id)

    def save_for_sampler(self, model_id: str, seq_id: int, name: str | None) -> str:
        def run() -> dict[str, Any]:
            trained = self.model(model_id)
            version = len(self.samplers) + 1
            trained.snapshot(version)
            label = name or f"sampler-{version:06d}"
            path = f"tinker://{model_id}/sampler_weights/{label}"
            sid = f"sampler-{uuid.uuid4().hex[:12]}"
            self.samplers[sid] = Sampler(trained.base_name, model_id, version, path)
            self.samplers[path] = self.samplers[sid]
            return {"path": path, "sampling_session_id": sid, "type": "save_weights_for_sampler"}
        return self.submit(model_id, run, seq_id)

    def _saved_folder(self, path: str) -> Path:
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or parts[1] != "weights":
            raise TinkerRefused(400, f"load_weights: {path!r} is not a tinker://MODEL/weights/NAME path "
                                     "that save_weights returned")
        folder = self.root / parts[0] / "weights" / parts[2]
        if not folder.is_dir():
            raise TinkerRefused(404, f"load_weights: no saved state {path!r} under {self.root}")
        return folder

    def load_weights(self, body: dict[str, Any]) -> tuple[str, str]:
        """(request id, model id): onto an existing model, or a new one (create-via-load)."""
        folder = self._saved_folder(str(body.get("path", "")))
        with_optimizer = bool(body.get("optimizer"))
        model_id = body.get("model_id")
        if model_id is None:
            base, lora = saved_lora(folder)
            self.base_path(base)
            if body.get("session_id") is None or body.get("model_seq_id") is None:
                raise TinkerRefused(400, "load_weights: give model_id, or session_id and model_seq_id")
            model_id = f"{body['session_id']}:train:{int(body['model_seq_id'])}"  # the id the client derives
            self.metas[model_id] = (base, lora)

            def create_and_load() -> dict[str, Any]:
                self.trained[model_id] = TrainedModel(model_id, base, self.models[base], lora)
                self.trained[model_id].load(folder, with_optimizer)
                return {"path": body["path"], "model_id": model_id, "type": "load_weights"}
            return self.submit(model_id, create_and_load, 0), model_id

        def run() -> dict[str, Any]:
            self.model(model_id).load(folder, with_optimizer)
            return {"path": body["path"], "model_id": model_id, "type": "load_weights"}
        return self.submit(model_id, run, int(body.get("seq_id") or 0)), model_id

    # ------------------------------------------------------------------ sampling
    def sampling_session(self, base: str | None, path: str | None) -> str:
        if path:
            if path not in self.samplers:
                raise TinkerRefused(404, f"unknown sampler path {path!r} (save_weights_for_sampler returns them)")
            sid = f"sampler-{uuid.uuid4().hex[:12]}"
            self.samplers[sid] = self.samplers[path]
            return sid
        if base is None:
            raise TinkerRefused(400, "create_sampling_session needs a base_model or a model_path")
        self.base_path(base)
        sid = f"sampler-{uuid.uuid4().hex[:12]}"
        self.samplers[sid] = Sampler(base, None, None, None)
        return sid

    def sampler(self, sid: str) -> Sampler:
        if sid not in self.samplers:
            raise TinkerRefused(404, f"unknown sampling session {sid!r}")
        return self.samplers[sid]

    def asample(self, sid: str, body: dict[str, Any]) -> tuple[str, int]:
        s = self.sampler(sid)
        prompt = wire.model_input_tokens(body.get("prompt"), "sample prompt")
        job = read_job(body, prompt, self.contexts[s.base], self.vocab[s.base])
        queue = s.model_id or f"base:{s.base}"
        return self.submit(queue, lambda: None, 0, job, sid), job.num_samples

    def _base_model(self, name: str) -> Any:
        if name not in self.bases:
            self.bases[name] = load_policy(self.models[name], "float32").eval()
        return self.bases[name]

    def _sample_batch(self, batch: list[_Job]) -> None:
        """Sample ``batch``; requests for the same sampler that arrive meanwhile join its loop
        (and are appended to ``batch``, so that a failure reaches them too); each request is
        answered as soon as its own samples are drawn."""
        s = self.samplers[batch[0].sampler]
        key = s.model_id or f"base:{s.base}"
        by_sample = {id(j.sample): j for j in batch}

        def join(group: tuple[Any, ...]) -> list[SampleJob]:
            with self._lock:
                arrived = self._joining(key, batch[0].sampler, group)
            batch.extend(arrived)
            by_sample.update({id(j.sample): j for j in arrived})
            return [j.sample for j in arrived if j.sample is not None]

        def done(job: SampleJob) -> None:
            j = by_sample[id(job)]
            j.future.proto = wire.sample_response(job.result, job.prompt_result)
            j.future.finish()
        jobs = [j.sample for j in batch if j.sample is not None]
        if self.vllm is not None:  # one generate call for the batch, on the sampler's weights
            self.vllm.sample(s.base, (s.model_id, s.version), self._sampler_weights(s), jobs, done)
            return
        model = self._base_model(s.base) if s.model_id is None else self.model(s.model_id).sampling_model(s.version)
        sample(model, self.tokenizers[s.base], jobs, join, done)

    def _sampler_weights(self, s: Sampler) -> Callable[[], dict[str, torch.Tensor]]:
        """What loads sampler ``s``'s weights into a vLLM engine: the base model's own, or its
        training model's version with the adapters merged."""
        if s.model_id is None:
            return lambda: dict(self._base_model(s.base).state_dict())
        return lambda: self.model(s.model_id).merged_state(s.version)

    def _joining(self, key: str, sampler: str | None, group: tuple[Any, ...]) -> list[_Job]:
        """The queued requests that may join a running sampling loop: those of ``group`` for the
        same sampler, taken off queue ``key``, unless another kind of job waits (the loop then
        ends with its own rows, and that job is not held back). Called with the lock held."""
        if any(j.sample is None for q in self._queues.values() for j in q) or any(
                q for k, q in self._queues.items() if k != key):
            return []
        queue = self._queues.get(key, [])
        arrived = [j for j in queue if j.sampler == sampler and j.sample is not None and j.sample.group() == group]
        if arrived:
            self._queues[key] = [j for j in queue if j not in arrived]
            heapq.heapify(self._queues[key])
        return arrived
