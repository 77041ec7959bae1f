"""Every error the runtime raises on purpose, each worded for the user, with its exit code.

Each class is a :class:`~rldsl.errors.UserError`: a command prints its message without a
traceback (unless ``--traceback``) and exits with the class's ``exit_code``: 2 for bad input
(caught before or while setting a run up: config, model folder, data file, reward name, grid),
1 for a run that failed on good input (a reward function raising, a dead worker, a weight
sync). The language's errors (:class:`~rldsl.errors.SpecError`, ``TranslateError``) live in
``rldsl.errors``; docs/errors.md lists every one with its message, cause and fix.
"""
from __future__ import annotations

from ..errors import EXIT_BAD_INPUT, EXIT_FAILED, UserError


class ConfigError(UserError, ValueError):
    """A problem with the run configuration, worded for the user (no traceback needed)."""

    exit_code = EXIT_BAD_INPUT


class RunError(ConfigError):
    """A problem with the run's inputs (model folder, run folder, engine choice)."""


class RewardSpecError(ConfigError):
    """A ``--reward`` text that names no reward that can be loaded (unknown name, a module or
    file that cannot be imported, a missing function, a bad option or weight)."""


class DataError(UserError, ValueError):
    """A dataset file that cannot be read as prompts (names the file and the row)."""

    exit_code = EXIT_BAD_INPUT


class GridError(UserError, ValueError):
    """A malformed ablation grid (``--vary``, the grid file, a study folder)."""

    exit_code = EXIT_BAD_INPUT


class VLLMUnavailableError(UserError, ImportError):
    """vLLM cannot be imported (not installed, or no usable build on this machine)."""

    exit_code = EXIT_BAD_INPUT


class RewardError(UserError, RuntimeError):
    """A reward function failed on one sample (names the reward, the sample and the cause)."""

    exit_code = EXIT_FAILED


class NothingTrained(UserError, RuntimeError):
    """A run that ended without one optimizer step: every update of every step was skipped
    (float16: each scaled gradient overflowed); its records and checkpoint are written."""

    exit_code = EXIT_FAILED


class WorkerError(UserError, RuntimeError):
    """A Ray actor died, failed or timed out; the message names it ("rollout worker 1 died: ...")."""

    exit_code = EXIT_FAILED


class TeacherError(UserError, RuntimeError):
    """A distillation teacher failed during a run: its server is down or answered outside the
    protocol (another number of logprobs than asked), or its Ray actor died for good."""

    exit_code = EXIT_FAILED


class WeightSyncError(UserError, RuntimeError):
    """Pushing weights into the vLLM engine failed."""

    exit_code = EXIT_FAILED


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A vLLM worker did not answer in time; the engine is unusable afterwards."""


class CheckpointWriteError(UserError, RuntimeError):
    """A checkpoint could not be written (a full disk, a read-only folder); its partial folder is
    removed, the previous checkpoints stay whole (the message names the newest and how to resume)."""

    exit_code = EXIT_FAILED


class EnvironmentFailed(UserError, RuntimeError):
    """A multi-turn environment's ``reset`` or ``step`` raised, or answered something that is not
    a step result (a broken environment class, not a bad tool call: those become text the model sees)."""

    exit_code = EXIT_FAILED


class RequestRefused(Exception):
    """Not a run error: a request of an agent (``rollout.agent``) that the policy's endpoint
    answers with an HTTP error -- the agent sees it as the ``openai`` client's exception
    (docs/agents.md, "When something goes wrong"); the run goes on."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        """The OpenAI-style error body."""
        return {"error": {"message": self.message, "type": "invalid_request_error" if self.status < 500
                          else "server_error", "param": self.param, "code": self.code}}


class TinkerRefused(Exception):
    """Not a run error: a request to ``rldsl serve-tinker`` that the server answers with an HTTP
    4xx (an unknown route, loss or spec, a malformed protobuf, a datum whose targets and inputs
    differ in length, a sample past the context, a wrong key): the Tinker client shows the
    message at once (a 5xx it would retry); the server keeps serving (docs/tinker.md)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class EpisodeRefused(Exception):
    """Not a run error: raised by an agent before its episode began, when its environment had no
    room for it (an OpenEnv server at its session limit): the episode did not happen, and the
    runner that runs such agents starts it again once there is room (``EnvironmentRunner``,
    rollout/agents/environments.py).
    ``limit``: the sessions the environment said it allows at once (None when it did not say)."""

    def __init__(self, message: str, limit: int | None = None) -> None:
        super().__init__(message)
        self.limit = limit


class RewardTimeout(TimeoutError):
    """Not a run error: one sample's reward call ran past ``reward.timeout_s`` and its worker
    process was killed (rewards/deadline.py); the sample is skipped and counted, the run goes on."""


class RewardWorkerError(RuntimeError):
    """Not a run error: one sample's reward could not be computed in a worker process (it could
    not start, could not load the reward, or died); that sample's error, as ``reward.on_error`` says."""
