"""Rewards scored outside the training process: reward servers and LLM judges over HTTP.

Both are *batch* reward terms: :class:`RewardFn` hands them all B samples of a step at once
(``score_batch``), and they send them concurrently -- never one sample at a time over the
network. Each answer is a float, or the exception of that one sample (a judge that gave no
score; a server that returned ``null`` or a non-number for it), which ``reward.on_error``
then raises or skips like a raising reward function. Faults of the server itself (down,
time-outs after every retry, a wrong number of scores, a body that is not the protocol) are
a :class:`RewardError` naming the server whatever ``on_error`` says: skipping every sample
of every step would train on nothing.

Reward server protocol (``--reward http://HOST:PORT/PATH``; ``rldsl serve-reward`` serves it)::

    POST PATH   {"prompts": [str], "completions": [str], "answers": [str],
                 "finish_reasons": ["stop" | "length"],
                 "query": [prompt + completion], "labels": [answer]}
    200         {"rewards": [number | null, ...]}     (same length; "scores" is accepted too)
                optional "errors": [str | null, ...]  (why a sample's reward is null)

``query`` / ``labels`` / ``rewards`` are the names of OpenRLHF's ``--remote_rm_url``
protocol, so a server written for it answers ours unchanged.

LLM judge (``--reward judge:URL``): any OpenAI-compatible chat endpoint (``vllm serve``, a
hosted API). URL is the API base (``http://127.0.0.1:8000/v1``) or the full
``.../chat/completions`` address. The judge is asked with a prompt template (a text file
with ``{prompt}``, ``{completion}`` and ``{answer}`` fields; a built-in one by default) and
its reply is read for ``Score: X``; the reward is X / ``scale``.
"""
from __future__ import annotations

import json
import math
import os
import re
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

from ..errors import RewardError, RewardSpecError
from .values import reward_value

Score = float | BaseException  # one sample's reward, or why it has none


# ----------------------------------------------------------------------------- transport
@dataclass(frozen=True)
class Http:
    """How a batch term talks to its server: per-request time-out, retries with exponential
    back-off (connection errors, time-outs and 5xx answers; a 4xx is not retried), and how
    many requests run at once."""

    timeout: float = 60.0
    retries: int = 3
    backoff: float = 0.5
    concurrency: int = 8

    def __post_init__(self) -> None:
        if not (self.timeout > 0 and self.retries >= 0 and self.backoff >= 0 and self.concurrency >= 1):
            raise ValueError("timeout must be > 0, retries >= 0, backoff >= 0 and concurrency >= 1")


def check_url(url: str, what: str) -> tuple[str, int]:
    """(host, port) of an http(s) URL, or a ValueError that says what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} {url!r} is not an http:// or https:// address")
    if parts.query or parts.fragment:
        raise ValueError(f"{what} {url!r}: no query string or fragment; give options as name(key=value)")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def check_reachable(url: str, what: str, timeout: float) -> None:
    """A TCP connection to the server opens, or a RewardSpecError naming it (checked at start-up,
    so a server that is not running fails the run before the model loads, exit code 2)."""
    host, port = check_url(url, what)
    try:
        with socket.create_connection((host, port), timeout=min(timeout, 10.0)):
            pass
    except OSError as e:
        raise RewardSpecError(f"{what} {url} is not reachable ({e.strerror or e}): is it running?"
                          + (" Start one with `rldsl serve-reward module:function --port "
                             f"{port}`." if what == "reward server" else "")) from None


def post_json(url: str, body: dict[str, Any], http: Http, what: str,
              headers: dict[str, str] | None = None, error: type[Exception] = RewardError) -> Any:
    """POST ``body`` as JSON and return the decoded answer, retrying as ``http`` says; a failure
    is an ``error`` (a :class:`RewardError` unless told) naming ``what`` and the URL."""
    data = json.dumps(body).encode()
    request_headers = {"Content-Type": "application/json", **(headers or {})}
    last = ""
    for attempt in range(http.retries + 1):
        if attempt:
            time.sleep(http.backoff * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data=data, headers=request_headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=http.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            last = f"HTTP {e.code} {e.reason}: {detail}"
            if e.code < 500:
                break  # the request is wrong: sending it again gives the same answer
            continue
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            last = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
            continue
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise error(f"{what} {url} answered with something that is not JSON: "
                              f"{raw[:200]!r}") from None
    tries = attempt + 1
    raise error(f"{what} {url} failed after {tries} tr{'y' if tries == 1 else 'ies'}: {last}")


# --------------------------------------------------------------------------- reward server
class ServerReward:
    """``http://HOST:PORT/PATH``: a reward server, sent the batch in chunks of ``batch_size``
    samples, ``concurrency`` requests at a time."""

    def __init__(self, url: str, *, batch_size: int = 64, timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.5, concurrency: int = 8, check: bool = True) -> None:
        check_url(url, "reward server")
        if batch_size < 1:
            raise ValueError(f"reward server {url}: batch_size must be >= 1, got {batch_size}")
        self.url, self.batch_size = url, int(batch_size)
        self.http = Http(float(timeout), int(retries), float(backoff), int(concurrency))
        if check:
            check_reachable(url, "reward server", self.http.timeout)

    def __repr__(self) -> str:
        return f"ServerReward({self.url!r})"

    def _request(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str],
                 finish_reasons: Sequence[str]) -> list[Score]:
        body = {"prompts": list(prompts), "completions": list(completions), "answers": list(answers),
                "finish_reasons": list(finish_reasons),
                "query": [p + c for p, c in zip(prompts, completions)], "labels": list(answers)}
        answer = post_json(self.url, body, self.http, "reward server")
        scores = answer.get("rewards", answer.get("scores")) if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            raise RewardError(f"reward server {self.url} answered without a 'rewards' list: "
                              f"{json.dumps(answer)[:200]}")
        if len(scores) != len(completions):
            raise RewardError(f"reward server {self.url} returned {len(scores)} rewards for "
                              f"{len(completions)} samples")
        errors = answer.get("errors") if isinstance(answer.get("errors"), list) else []
        out: list[Score] = []
        for i, value in enumerate(scores):
            if value is None and i < len(errors) and errors[i]:
                out.append(RuntimeError(f"the server says: {errors[i]}"))
            else:
                try:
                    out.append(reward_value(value, f"reward server {self.url}"))
                except ValueError as e:
                    out.append(e)
        return out

    def score_batch(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str],
                    finish_reasons: Sequence[str]) -> list[Score]:
        n, k = len(completions), self.batch_size
        chunks = [slice(i, min(i + k, n)) for i in range(0, n, k)]
        with ThreadPoolExecutor(max_workers=min(self.http.concurrency, max(len(chunks), 1))) as pool:
            parts = pool.map(lambda s: self._request(prompts[s], completions[s], answers[s],
                                                     finish_reasons[s]), chunks)
            return [score for part in parts for score in part]

    def __call__(self, prompt: str, completion: str, answer: str, finish_reason: str = "stop") -> float:
        score = self.score_batch([prompt], [completion], [answer], [finish_reason])[0]
        if isinstance(score, BaseException):
            raise score
        return score


# ------------------------------------------------------------------------------- LLM judge
DEFAULT_JUDGE_TEMPLATE = """\
You are grading an answer to a task.

Task:
{prompt}

Reference answer (may be empty):
{answer}

Answer to grade:
{completion}

Rate how correct and helpful the answer is on a scale from 0 to 10. Reply with one line of
reasoning, then a last line of the form "Score: N".
"""

_SCORE = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_FIELDS = ("prompt", "completion", "answer")


def read_judge_template(template: str | None) -> str:
    """The template's text (a file path, or None for the built-in one), checked to name only
    ``{prompt}``, ``{completion}`` and ``{answer}`` (``{{`` / ``}}`` for literal braces)."""
    if template is None:
        return DEFAULT_JUDGE_TEMPLATE
    path = Path(template)
    if not path.is_file():
        raise ValueError(f"judge template {template!r} is not a file (give a text file with "
                         "{prompt}, {completion} and {answer} fields)")
    text = path.read_text()
    try:
        text.format_map({f: "" for f in _FIELDS})
    except KeyError as e:
        raise ValueError(f"judge template {template}: unknown field {{{e.args[0]}}}; "
                         "the fields are {prompt}, {completion} and {answer}") from None
    except (ValueError, IndexError) as e:
        raise ValueError(f"judge template {template}: {e} (write literal braces as {{{{ and }}}})") from None
    return text


def parse_judge_score(reply: str) -> float | None:
    """The last ``Score: X`` in the judge's reply, or the reply itself if it is a number."""
    found = _SCORE.findall(reply)
    if found:
        return float(found[-1])
    try:
        value = float(reply.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class JudgeReward:
    """``judge:URL``: an LLM asked to grade each sample through an OpenAI-compatible chat API."""

    def __init__(self, url: str, *, model: str = "default", template: str | None = None,
                 scale: float = 10.0, max_tokens: int = 256, temperature: float = 0.0,
                 api_key_env: str = "OPENAI_API_KEY", timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.5, concurrency: int = 8, check: bool = True) -> None:
        check_url(url, "judge")
        self.url = url if url.rstrip("/").endswith("/chat/completions") else url.rstrip("/") + "/chat/completions"
        if not scale > 0:
            raise ValueError(f"judge {url}: scale must be > 0, got {scale}")
        self.model, self.scale = str(model), float(scale)
        self.max_tokens, self.temperature = int(max_tokens), float(temperature)
        self.template = read_judge_template(template)
        key = os.environ.get(str(api_key_env))
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = Http(float(timeout), int(retries), float(backoff), int(concurrency))
        if check:
            check_reachable(self.url, "judge", self.http.timeout)

    def __repr__(self) -> str:
        return f"JudgeReward({self.url!r}, model={self.model!r})"

    def _grade(self, prompt: str, completion: str, answer: str) -> Score:
        content = self.template.format_map({"prompt": prompt, "completion": completion, "answer": answer})
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": self.max_tokens, "temperature": self.temperature}
        reply = post_json(self.url, body, self.http, "judge", self.headers)
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RewardError(f"judge {self.url} answered without choices[0].message.content: "
                              f"{json.dumps(reply)[:200]}") from None
        score = parse_judge_score(text or "")
        if score is None:
            return ValueError(f"the judge's reply has no parsable 'Score: N': {(text or '')[:200]!r}")
        return score / self.scale

    def score_batch(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str],
                    finish_reasons: Sequence[str]) -> list[Score]:
        with ThreadPoolExecutor(max_workers=min(self.http.concurrency, max(len(completions), 1))) as pool:
            return list(pool.map(self._grade, prompts, completions, answers))

    def __call__(self, prompt: str, completion: str, answer: str, finish_reason: str = "stop") -> float:
        score = self._grade(prompt, completion, answer)
        if isinstance(score, BaseException):
            raise score
        return score
