"""A multi-turn verifiers 0.4 environment with a tool, for the tests (nothing downloaded): the
task's ``vf.Toolset`` (an MCP server verifiers starts per rollout) offers ``calculator``; the
task's own ``@vf.reward`` scores the final reply."""
from __future__ import annotations

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is `calculator`, as the tool model learned it
    @vf.tool
    def calculator(self, expression: str) -> str:
        """Evaluate a sum of integers such as 12+34."""
        try:
            return str(sum(int(t) for t in expression.split("+")))
        except ValueError:
            return "error: only sums of integers"


class CalcData(vf.TaskData):
    answer: str = ""


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 for the sum as the final reply; 0.5 when the calculator was called; else 0.125."""
        if trace.last_reply.strip() == self.data.answer:
            return 1.0
        called = any(getattr(m, "tool_calls", None) for m in trace.messages)
        return 0.5 if called else 0.125


class CalcConfig(vf.TasksetConfig):
    num_tasks: int = 6
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self) -> list[CalcTask]:
        return [CalcTask(CalcData(prompt=f"{a}+{a + 10}=", answer=str(2 * a + 10)), self.config.task)
                for a in range(10, 10 + self.config.num_tasks)]


if __name__ == "__main__":  # verifiers starts the tool server as `python -m vf_sum_tools`
    CalcToolset.run()

__all__ = ["CalcTaskset"]
