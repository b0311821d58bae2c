"""A verifiers 0.4 taskset written for the tests: add two numbers with a tool (multi-turn).

The task's ``vf.Toolset`` runs as an MCP server (``python -m vf_adder``) for each rollout; the
harness offers its ``add`` tool to the model and feeds the result back.
"""

import verifiers.v1 as vf

PAIRS = [(2, 3), (4, 4), (1, 6)]


class AdderToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is offered as plain "add"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class AdderData(vf.TaskData):
    answer: str


class AdderTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class AdderTask(vf.Task[AdderData, vf.State, AdderTaskConfig]):
    @classmethod
    def toolsets(cls, config: AdderTaskConfig) -> list[vf.Toolset]:
        return [AdderToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class AdderConfig(vf.TasksetConfig):
    task: AdderTaskConfig = AdderTaskConfig()


class AdderTaskset(vf.Taskset[AdderTask, AdderConfig]):
    def load(self):
        for a, b in PAIRS:
            yield AdderTask(
                AdderData(prompt=f"Use the add tool: {a} + {b}.", answer=str(a + b)),
                self.config.task,
            )


__all__ = ["AdderTaskset"]

if __name__ == "__main__":
    AdderToolset.run()
