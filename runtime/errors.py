"""Every exception the runtime raises on purpose, each worded for the user.

``rldsl run`` shows these messages without a traceback: a :class:`ConfigError` (and its
:class:`RunError`) exits with code 2 (bad input), the others with code 1 (a failed run).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A problem with the run configuration, worded for the user (no traceback needed)."""


class RunError(ConfigError):
    """A problem with the run's inputs (model folder, run folder, engine choice)."""


class DataError(ValueError):
    """A dataset file that cannot be read as prompts (names the file and the row)."""


class RewardError(RuntimeError):
    """A reward function failed on one sample (names the reward, the sample and the cause)."""


class WorkerError(RuntimeError):
    """A Ray actor died, failed or timed out; the message names it ("rollout worker 1 died: ...")."""


class VLLMUnavailableError(ImportError):
    """vLLM cannot be imported (not installed, or no usable build on this machine)."""


class WeightSyncError(RuntimeError):
    """Pushing weights into the vLLM engine failed."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A vLLM worker did not answer in time; the engine is unusable afterwards."""
