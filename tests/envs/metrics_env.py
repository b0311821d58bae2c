"""``CountingEnv`` that reports metrics through ``BaseEnv``'s helpers, for the W&B tests.

Each rollout of item ``i`` buffers ``train/item`` values ``i``, ``i + 1`` and ``i + 2``
(``log_train_metric``: their mean is ``i + 1``). Each ``evaluate()`` call ``k`` (1, 2, ...)
reports ``eval/run = k`` through ``evaluate_log``. Run with the repository on ``PYTHONPATH``
(``tests.envs.helpers.start_env`` does).
"""

from tests.envs.counting_env import CountingEnv


class MetricsEnv(CountingEnv):
    name = "metrics"

    async def setup(self):
        await super().setup()
        self.evals = 0

    async def collect_trajectories(self, item):
        group, backlog = await super().collect_trajectories(item)
        self.log_train_metric("train/item", item)
        self.log_train_metric("train/item", [item + 1, item + 2])
        return group, backlog

    async def evaluate(self, *args, **kwargs):
        self.evals += 1
        await self.evaluate_log({"eval/run": self.evals, "eval/note": "not a number"})


if __name__ == "__main__":
    MetricsEnv.cli()
