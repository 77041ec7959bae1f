"""A verifiers 0.4 environment that fails, for the tests: task 0's rubric raises, task 1's
never returns."""
from __future__ import annotations

import asyncio

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.idx == 0:
            raise ValueError("the rubric broke")
        await asyncio.Event().wait()  # never set
        return 1.0


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self) -> list[BrokenTask]:
        return [BrokenTask(vf.TaskData(prompt="1+2="), self.config.task),
                BrokenTask(vf.TaskData(prompt="2+3="), self.config.task)]


__all__ = ["BrokenTaskset"]
