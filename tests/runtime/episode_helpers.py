"""Environments for the episode tests (loaded by `module:Class`; this folder is on sys.path)."""
from __future__ import annotations

from rldsl.runtime.rollout.episodes.env import StepResult, ToolEnv
from rldsl.runtime.toy.calculator import calculator


class Nudge:
    """Answers every assistant turn with a user message; ends after the third turn with reward 1."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message: dict):
        self.turns += 1
        if self.turns == 3:
            return [], 1.0, True
        return [{"role": "user", "content": f"again {self.turns}"}], None, False


class CalcEnv(ToolEnv):
    """The calculator tool environment, plus a reward at the end: 1 when the final answer is the
    row's answer."""

    def __init__(self) -> None:
        super().__init__([calculator])
        self.answer = ""

    def reset(self, row: dict) -> list[dict]:
        self.answer = row["answer"]
        return super().reset(row)

    def step(self, assistant_message: dict) -> StepResult:
        result = super().step(assistant_message)
        if result.done:
            result.reward = float((assistant_message.get("content") or "").strip() == self.answer)
        return result


class StepRaises:
    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message: dict):
        raise KeyError("the world broke")


class StepAnswersNonsense(StepRaises):
    def step(self, assistant_message: dict):
        return "not a step result"


class StepRewardsText(StepRaises):
    def step(self, assistant_message: dict):
        return [], "1.0", True  # text that reads as a number: still not a score


class NeedsArguments:
    def __init__(self, level: int) -> None:
        self.level = level

    def reset(self, row: dict) -> list[dict]:
        return []

    def step(self, assistant_message: dict):
        return [], None, True


class NoStep:
    def reset(self, row: dict) -> list[dict]:
        return []


not_a_class = 42


class TurnRewards(Nudge):
    """Nudge with a reward per turn: 0.5 for the first, none for the second, 2.0 for the third."""

    def step(self, assistant_message: dict):
        messages, _, done = super().step(assistant_message)
        return messages, {1: 0.5, 2: None, 3: 2.0}[self.turns], done


class CalcSteps(CalcEnv):
    """CalcEnv with a step reward of 0.25 for every turn that calls a tool (the end-of-episode
    reward as CalcEnv's)."""

    def step(self, assistant_message: dict) -> StepResult:
        result = super().step(assistant_message)
        if not result.done:
            result.reward = 0.25
        return result
