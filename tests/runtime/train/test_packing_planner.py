"""The shared-prompt packing planner (train/packing.py ``_balanced_bins``): the same rows as
the plain implementation it replaced (kept here as the reference), at a fraction of its work."""
from __future__ import annotations

import heapq
import math
import random
import types

from rldsl.runtime.train import packing
from rldsl.runtime.train.packing import _balanced_bins, _shared_bins


def reference_balanced_bins(units, fed, prompt_len, G, cap):
    """The planner as first written: every try of k rows placed from scratch, k growing."""
    order = sorted(units, key=lambda b: (-fed[b], b))
    first = {b // G: b for b in units}
    k = max(1, math.ceil((sum(fed[b] for b in units) + sum(prompt_len[b] for b in first.values())) / cap))
    while True:
        rows = [{} for _ in range(k)]
        loads = [0] * k
        of_group = {}
        lightest = [(0, r) for r in range(k)]
        for b in order:
            g = b // G
            while lightest[0][0] != loads[lightest[0][1]]:
                heapq.heappop(lightest)
            r, add = lightest[0][1], prompt_len[b] + fed[b]
            held = min(of_group.get(g, ()), key=lambda r: (loads[r], r), default=None)
            if held is not None and loads[held] + fed[b] <= loads[r] + add:
                r, add = held, fed[b]
            else:
                of_group.setdefault(g, []).append(r)
            rows[r].setdefault(g, []).append(b)
            loads[r] += add
            heapq.heappush(lightest, (loads[r], r))
        if k >= len(units) or all(load <= cap or sum(map(len, row.values())) < 2
                                  for row, load in zip(rows, loads)):
            kept = [i for i in range(k) if rows[i]]
            return [rows[i] for i in kept], [loads[i] for i in kept]
        k = max(k + 1, math.ceil(sum(loads) / cap))


def random_batch(rng: random.Random):
    """Groups of G responses sharing a prompt length (0 included), responses of 0 or more fed
    tokens, some rows left out, a cap at the longest sequence or anywhere."""
    G, groups = rng.randint(1, 8), rng.randint(1, 30)
    prompt_len = [p for _ in range(groups) for p in [rng.randint(0, 30)] * G]
    fed = [rng.randint(0, rng.choice([1, 3, 10, 40])) for _ in range(G * groups)]
    units = [b for b in range(G * groups) if rng.random() < 0.9] or [0]
    longest = max(prompt_len[b] + fed[b] for b in units)
    cap = max(longest, 1) if rng.random() < 0.6 else rng.randint(1, 120)
    return units, fed, prompt_len, G, cap


def recipe_batch(rng: random.Random):
    """math_rl's shape: 100 prompts x 4 short answers (0-4 fed tokens), prompts of 8-14 tokens,
    the cap the longest sequence: one answer a row, the tries growing k one by one."""
    prompt_len = [p for _ in range(100) for p in [rng.randint(8, 14)] * 4]
    fed = [rng.randint(0, 4) for _ in range(400)]
    return list(range(400)), fed, prompt_len, 4, max(p + f for p, f in zip(prompt_len, fed)) + 1


def test_same_rows_as_the_reference_on_random_batches():
    rng = random.Random(59)
    for _ in range(1500):
        batch = random_batch(rng)
        assert _balanced_bins(*batch) == reference_balanced_bins(*batch), batch
    for _ in range(3):
        batch = recipe_batch(rng)
        assert _balanced_bins(*batch) == reference_balanced_bins(*batch)


def test_tries_share_their_work(monkeypatch):
    """At the recipe's shape the reference places all 400 answers in each of ~100-200 tries; the
    planner places each answer a few dozen times at most (counted as heap pushes, one a placement)."""
    pushes = 0

    def push(heap, item):
        nonlocal pushes
        pushes += 1
        heapq.heappush(heap, item)

    counting = types.SimpleNamespace(heappush=push, heappop=heapq.heappop, heapify=heapq.heapify)
    monkeypatch.setattr(packing, "heapq", counting)
    batch = recipe_batch(random.Random(1))
    rows, loads = _shared_bins(*batch)
    assert sum(loads) > 0
    assert pushes < 80 * len(batch[0]), pushes
