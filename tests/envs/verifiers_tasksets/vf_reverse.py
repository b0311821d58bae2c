"""A verifiers 0.4 taskset written for the tests: reverse a word (single turn).

Loaded by id (``--env.taskset vf-reverse``) with this folder on ``PYTHONPATH``, as an installed
environment package would be.
"""

import verifiers.v1 as vf

WORDS = ["apple", "pear", "fig", "plum", "kiwi", "lime"]


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 8)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = len(WORDS)


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        for word in WORDS[: self.config.num_tasks]:
            yield ReverseTask(
                ReverseData(prompt=f"Reverse the word {word}.", answer=word[::-1]),
                self.config.task,
            )


__all__ = ["ReverseTaskset"]
