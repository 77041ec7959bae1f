"""A single-turn verifiers 0.4 environment for the tests (nothing downloaded): the model is
asked a sum and its reply is scored by the task's own ``@vf.reward``."""
from __future__ import annotations

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the last reply is the sum, else 0.25 for any reply (so rewards are told apart
        from rldsl's own)."""
        return 1.0 if trace.last_reply.strip() == self.data.answer else 0.25


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 6


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        return [SumTask(SumData(prompt=f"{a}+{a + 1}=", answer=str(2 * a + 1)), self.config.task)
                for a in range(1, self.config.num_tasks + 1)]


__all__ = ["SumTaskset"]
