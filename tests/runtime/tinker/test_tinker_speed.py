"""What makes the service's step cheap (docs/tinker.md, "Speed"), with its results unchanged: the
sampler's logprobs are its own sampling loop's (no second forward scores the completions) and
equal the trainer's to float rounding, prompt logprobs included; ``forward_backward`` runs a
group's samples in ``rldsl run``'s layout (the shared prefix once, packed rows), with the
logprobs and gradients of every row scored alone."""
from __future__ import annotations

import pytest
import torch

from rldsl.runtime.models.loading import backbone, load_tokenizer
from rldsl.runtime.tinker.sampler import SampleJob, sample
from rldsl.runtime.tinker.trainer import LoraSpec, TrainedModel, target_logprobs

from tinker_helpers import NAME

pytest.importorskip("peft")


@pytest.fixture()
def trained(tinker_home) -> tuple[TrainedModel, object]:
    """A training model whose adapters moved away from their start (B != 0) on the attention and
    MLP layers, and its tokenizer."""
    model = TrainedModel("m", NAME, tinker_home / NAME, LoraSpec(rank=4, seed=0, train_unembed=False))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.params:
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    model.snapshot(1)
    return model, load_tokenizer(tinker_home / NAME)


def test_sampling_runs_no_scoring_forward_and_its_logprobs_are_the_trainers(trained):
    """The sampler runs the plain model with the snapshot's adapters merged (as rldsl run's engine)."""
    model, tok = trained
    engine = model.sampling_model(1)
    assert engine is not model.policy and not any(".lora_" in n for n, _ in engine.named_parameters())
    calls: list[int] = []
    hook = backbone(engine).register_forward_hook(lambda m, args, kwargs, out: calls.append(1), with_kwargs=True)
    prompts = [tok.encode("Count: 1 2"), tok.encode("The sum of 12 and 30 is"), tok.encode("a b")]
    jobs = [SampleJob(prompt=p, num_samples=3, max_tokens=6, stop_tokens=(), prompt_logprobs=True) for p in prompts]
    try:
        sample(engine, tok, jobs)
    finally:
        hook.remove()
    # one prefill, then one forward per further token: nothing scores the completions again
    assert len(calls) == 6
    rows, sampled = [], []
    for j in jobs:
        assert len(j.result) == 3
        for s in j.result:
            assert len(s.tokens) == len(s.logprobs) == 6
            full = j.prompt + s.tokens
            rows.append((full[:-1], full[1:]))
            sampled.append(s.logprobs)
    forward = target_logprobs(model.policy, rows, grad=False)  # the trainer's, LoRA layers unmerged
    diffs = []
    for lp, s in zip(forward, sampled):
        torch.testing.assert_close(torch.tensor(s), lp[-len(s):], atol=1e-4, rtol=0)
        diffs.append(torch.tensor(s) - lp[-len(s):])
    assert abs(float(torch.cat(diffs).mean())) < 1e-6  # the cookbook's kl_sample_train_v1
    for j in jobs:  # the prompt's logprobs, from the prefill (NaN first: no context)
        ref = target_logprobs(model.policy, [(j.prompt[:-1], j.prompt[1:])], grad=False)[0]
        assert j.prompt_result is not None and len(j.prompt_result) == len(j.prompt)
        torch.testing.assert_close(torch.tensor(j.prompt_result[1:]), ref, atol=1e-4, rtol=0)


def _backbone_tokens(model) -> tuple[list[int], object]:
    fed: list[int] = []

    def count(module, args, kwargs, out):
        ids = kwargs.get("input_ids")
        fed.append(int(ids.numel()) if ids is not None else 0)
    return fed, backbone(model).register_forward_hook(count, with_kwargs=True)


def test_forward_backward_shares_a_groups_prefix_and_equals_each_row_alone(trained):
    model, tok = trained
    prompts = [tok.encode("The sum of 12 and 30 is"), tok.encode("Count: 1 2 3 4")]
    tails = [[11, 12], [13, 14, 15, 16, 17], [18], [19, 20, 21], [22, 23, 24, 25, 26, 27, 28]]
    rows = [((p + t)[:-1], (p + t)[1:]) for p in prompts for t in tails]  # 2 groups of 5 samples

    def grads(lps):
        for p in model.params:
            p.grad = None
        model.backward(sum((i + 1) * lp.sum() for i, lp in enumerate(lps)))  # the prefixes' targets too
        return [p.grad.clone() for p in model.params]
    model.logprobs(rows[:2], grad=False)  # the packed layout's once-per-model check (train/packing.py)
    fed, hook = _backbone_tokens(model.policy)
    try:
        together = model.logprobs(rows, grad=True)
    finally:
        hook.remove()
    padded = len(rows) * (max(len(x) for x, _ in rows) + 1 - 1)  # every row in full, padded
    assert sum(fed) < padded * 0.75, (fed, padded)
    g_together = grads(together)
    alone = [model.logprobs([r], grad=True)[0] for r in rows]
    g_alone = grads(alone)
    for a, b in zip(together, alone):
        assert a.shape == b.shape == (len(a),)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(g_together, g_alone):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_loss_without_gradient_on_the_prefixes_runs_no_prefix_forward_or_backward(trained):
    """The prefixes' own targets come from the shared-prefix forward's own prompt pass, without a
    graph: no forward of the prefixes alone, and a loss that gives them no gradient (a recipe's:
    advantages 0 on the prompt) runs no backward for them; its gradients equal each row scored
    alone."""
    model, tok = trained
    prompt = tok.encode("The sum of 12 and 30 is")
    rows = [((prompt + t)[:-1], (prompt + t)[1:]) for t in ([11, 12], [13, 14, 15], [16], [17, 18, 19, 20])]
    c = len(prompt) - 1  # the prompt's own targets: positions 0 .. c - 1

    def grads(lps):
        for p in model.params:
            p.grad = None
        model.backward(sum((i + 1) * lp[c:].sum() for i, lp in enumerate(lps)))
        return [p.grad.clone() for p in model.params]
    graphs: list[bool] = []  # per forward through the model's body: whether it kept a graph
    backwards: list[int] = []  # per backward through it

    def graph(module, args, out):
        hidden = out[0]
        graphs.append(hidden.requires_grad)
        if hidden.requires_grad:
            hidden.register_hook(lambda g: backwards.append(1))
    model.logprobs(rows[:2], grad=False)  # the packed layout's once-per-model check (train/packing.py)
    hook = backbone(model.policy).register_forward_hook(graph)
    try:
        together = model.logprobs(rows, grad=True)
        g_together = grads(together)
    finally:
        hook.remove()
    # the shared-prefix forward alone (its prompt pass, then the responses on its cache), with its
    # graph, each pass's backward once: no forward of the prefixes' own
    assert graphs == [True, True] and len(backwards) == 2, (graphs, backwards)
    g_alone = grads([model.logprobs([r], grad=True)[0] for r in rows])
    for a, b in zip(g_together, g_alone):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_samples_sharing_their_first_tokens_run_one_forward_and_one_backward(trained):
    """A group's samples that begin with the same tokens put sampled tokens (with advantages, so
    a gradient) into the shared prefix: their logprobs and gradients come from the one shared
    forward's graph, no second forward or backward of the prefixes, equal to each row alone."""
    model, tok = trained
    prompt = tok.encode("The sum of 12 and 30 is")
    rows = [((prompt + t)[:-1], (prompt + t)[1:]) for t in ([11, 12, 5], [11, 12, 6, 7], [11, 12], [11, 12, 9])]
    c = len(prompt) - 1  # the prompt's own targets; the shared sampled tokens 11, 12 come after

    def grads(lps):
        for p in model.params:
            p.grad = None
        model.backward(sum((i + 1) * lp[c:].sum() for i, lp in enumerate(lps)))
        return [p.grad.clone() for p in model.params]
    graphs: list[bool] = []
    backwards: list[int] = []

    def graph(module, args, out):
        graphs.append(out[0].requires_grad)
        if out[0].requires_grad:
            out[0].register_hook(lambda g: backwards.append(1))
    model.logprobs(rows[:2], grad=False)  # the packed layout's once-per-model check (train/packing.py)
    hook = backbone(model.policy).register_forward_hook(graph)
    try:
        g_together = grads(model.logprobs(rows, grad=True))
    finally:
        hook.remove()
    assert graphs == [True, True] and len(backwards) == 2, (graphs, backwards)
    g_alone = grads([model.logprobs([r], grad=True)[0] for r in rows])
    for a, b in zip(g_together, g_alone):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_held_retrieve_future_wakes_when_its_job_finishes_without_a_timer(monkeypatch):
    """``retrieve_future`` holds a pending request until the worker finishes its job: woken by the
    job's end (no sleep loop taking CPU from the job), or answered at the hold's end."""
    import asyncio
    import threading
    import time

    from rldsl.runtime.tinker.server import hold_until_done
    from rldsl.runtime.tinker.service import Future
    sleeps: list[float] = []
    real_sleep = asyncio.sleep
    here = threading.current_thread()

    async def counted(delay, *a, **k):
        # this thread's loops only: a tinker client left by an earlier test (its session heartbeat
        # sleeps 10 s in a thread of its own) calls the same patched function
        if threading.current_thread() is here:
            sleeps.append(delay)
        return await real_sleep(delay, *a, **k)
    monkeypatch.setattr(asyncio, "sleep", counted)

    async def held(fut: Future, hold_s: float, finish_after: float | None) -> float:
        start = time.monotonic()
        if finish_after is not None:
            threading.Timer(finish_after, fut.finish).start()
        await hold_until_done(fut, hold_s)
        return time.monotonic() - start
    woken = Future()
    assert asyncio.run(held(woken, 60.0, 0.2)) < 30 and woken.done.is_set()
    pending = Future()
    assert asyncio.run(held(pending, 0.1, None)) >= 0.1 and not pending.done.is_set()
    done = Future()
    done.finish()
    assert asyncio.run(held(done, 60.0, None)) < 30
    assert sleeps == []


def test_requests_arriving_while_a_loop_samples_join_it_and_keep_the_trainers_logprobs(trained):
    """Continuous batching: jobs handed over by ``join`` while a loop runs (one with a longer
    prompt than the running rows, one shorter: both caches left-padded) enter at its next token,
    every job is ``done`` once its own rows are, and each joined row's logprobs still equal the
    trainer's forward of the same tokens."""
    model, tok = trained
    engine = model.sampling_model(1)
    first = SampleJob(prompt=tok.encode("Count: 1 2"), num_samples=2, max_tokens=5, stop_tokens=())
    later = [SampleJob(prompt=tok.encode("The sum of 12 and 30 is"), num_samples=3, max_tokens=5, stop_tokens=(),
                       prompt_logprobs=True),
             SampleJob(prompt=tok.encode("a"), num_samples=1, max_tokens=5, stop_tokens=())]
    handed: list[list[SampleJob]] = [[later[0]], [], [later[1]]]
    asked: list[tuple] = []

    def join(group):
        asked.append(group)
        return handed.pop(0) if handed else []
    finished: list[SampleJob] = []
    fed, hook = _backbone_tokens(engine)
    try:
        sample(engine, tok, [first], join=join, done=finished.append)
    finally:
        hook.remove()
    assert asked and set(asked) == {first.group()}
    assert finished == [first, later[0], later[1]]  # each as soon as its own rows are drawn
    # one loop: 3 prefills (the first job, then each arrival, whose rows draw their first token
    # at the next step) and one forward per further token of the rows still running: the last
    # arrival's (after step 3) draws its 5th token at step 8
    decodes = [fed[1], *fed[3:5], *fed[6:]]
    assert len(fed) == 3 + 7 and decodes == [2, 5, 5, 6, 4, 1, 1], fed
    rows, sampled = [], []
    for j in [first] + later:
        assert len(j.result) == j.num_samples
        for s in j.result:
            assert len(s.tokens) == len(s.logprobs) == 5 and not s.stopped
            full = j.prompt + s.tokens
            rows.append((full[:-1], full[1:]))
            sampled.append(s.logprobs)
    forward = target_logprobs(model.policy, rows, grad=False)
    for lp, s in zip(forward, sampled):
        torch.testing.assert_close(torch.tensor(s), lp[-len(s):], atol=1e-4, rtol=0)
    ref = target_logprobs(model.policy, [(later[0].prompt[:-1], later[0].prompt[1:])], grad=False)[0]
    torch.testing.assert_close(torch.tensor(later[0].prompt_result[1:]), ref, atol=1e-4, rtol=0)


def test_the_service_lets_requests_join_a_running_loop_and_answers_each_when_drawn(tinker_home, tmp_path):
    """Requests for the same sampler queued while its loop runs join that loop (one
    ``_sample_batch``, not one per arrival); a seeded request never joins (its seed alone decides
    its samples), and neither does any request while another kind of job waits."""
    from rldsl.runtime.tinker.service import Service
    service = Service({NAME: tinker_home / NAME}, tmp_path / "states")
    try:
        sid = service.sampling_session(NAME, None)
        tok = load_tokenizer(tinker_home / NAME)

        def body(text: str, **params) -> dict:
            return {"prompt": {"chunks": [{"tokens": tok.encode(text)}]}, "num_samples": 1,
                    "sampling_params": {"max_tokens": 4, "stop": [], **params}}
        batches: list[list] = []
        real = service._sample_batch

        def counted(batch):  # each loop's batch: the requests that join it are appended to it
            batches.append(batch)
            return real(batch)
        service._sample_batch = counted
        engine = service._base_model(NAME)
        ids: list[str] = []
        calls = [0]
        arrivals: list = []

        def arrive(module, args, kwargs, out):  # at a loop's first decode step, more requests arrive
            calls[0] += 1
            if calls[0] == 2:
                ids.extend(arrivals.pop(0)())
        hook = backbone(engine).register_forward_hook(arrive, with_kwargs=True)

        def run(*arriving) -> None:
            calls[0] = 0
            arrivals.append(lambda: [submit() for submit in arriving])
            first = service.asample(sid, body("Count: 1 2"))[0]
            assert service.futures[first].done.wait(60)  # the others arrived before it was drawn
            ids.insert(0, first)
            for request_id in ids:
                assert service.futures[request_id].done.wait(60)
            assert all(service.futures[i].error is None for i in ids)
            ids.clear()
        try:
            run(lambda: service.asample(sid, body("The sum of 12 and 30 is"))[0],
                lambda: service.asample(sid, body("a b"))[0], lambda: service.asample(sid, body("a b", seed=3))[0])
            assert [len(b) for b in batches] == [3, 1], batches  # two joined the first; the seeded alone
            batches.clear()
            run(lambda: service.submit("another", lambda: {"ok": True}), lambda: service.asample(sid, body("a b"))[0])
            assert [len(b) for b in batches] == [1, 1], batches  # a job of another kind waited: no joining
        finally:
            hook.remove()
    finally:
        service.close()


def test_request_ids_draw_nothing_from_the_os_and_stay_unique(tinker_home, tmp_path, monkeypatch):
    """Every call's request id is this server run's random prefix and a counter: ``uuid4`` per
    request called ``os.urandom``, which releases the interpreter lock, and the event loop then
    waited for it (~1.6 ms an id while the worker samples: docs/tinker.md, "Speed")."""
    import os

    from rldsl.runtime.tinker.service import Service
    services = [Service({NAME: tinker_home / NAME}, tmp_path / f"states{i}") for i in range(2)]
    try:
        def drawn(n: int) -> bytes:
            raise AssertionError("os.urandom drawn for a request id")
        monkeypatch.setattr(os, "urandom", drawn)
        ids = {s: [s.submit("m", lambda i=i: {"i": i}) for i in range(200)] for s in services}
        monkeypatch.undo()
        assert len({i for batch in ids.values() for i in batch}) == 400  # two runs' ids never collide
        for s, batch in ids.items():
            assert all(s.futures[r].done.wait(30) for r in batch)
            assert [s.futures[r].body for r in batch] == [{"i": i} for i in range(200)]
    finally:
        for s in services:
            s.close()
