"""A test environment written only against upstream's public API, so the same file runs with
our atroposlib and with upstream's 0.4.0.

Items are 0, 1, 2, ... (``--env.num_items`` of them, then ``get_next_item`` returns None;
``--env.cycle N`` makes them repeat, 0..N-1, and items below ``--env.flat_below`` score alike).
A group for item ``i`` has ``group_size`` sequences ``[1000 + i, 7, 8, s]`` with mask
``[-100, -100, 8, s]`` and distinct scores. Each rollout sleeps ``rollout_delay`` seconds and,
when ``start_log`` is set, appends ``i`` to that file as it starts (to count rollouts).
Runs without an inference server.
"""

import asyncio
import os
import sys

from pydantic import Field

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup


class CountingConfig(BaseEnvConfig):
    num_items: int = Field(default=1000000, description="Items to hand out, then None")
    rollout_delay: float = Field(default=0.0, description="Seconds each rollout sleeps")
    start_log: str = Field(default="", description="File to append started item ids to")
    fail_first_attempt: bool = Field(default=False, description="Every item's first rollout raises")
    cycle: int = Field(default=0, description="If > 0, items repeat: item i is i % cycle")
    flat_below: int = Field(default=0, description="Items below this score all alike (flat)")


class CountingEnv(BaseEnv):
    name = "counting"
    env_config_cls = CountingConfig

    @classmethod
    def config_init(cls):
        return (
            CountingConfig(
                tokenizer_name=os.environ.get("COUNTING_TOKENIZER", "gpt2"),
                group_size=2,
                use_wandb=False,
                wandb_name="counting",
                max_token_length=64,
                ensure_scores_are_not_same=True,
            ),
            [APIServerConfig(base_url="http://127.0.0.1:9/v1", api_key="x", health_check=False)],
        )

    async def setup(self):
        self.next_id = 0
        self.attempts = {}

    async def get_next_item(self):
        if self.next_id >= self.config.num_items:
            return None
        self.next_id += 1
        if self.config.cycle > 0:
            return (self.next_id - 1) % self.config.cycle
        return self.next_id - 1

    async def collect_trajectories(self, item):
        if self.config.start_log:
            with open(self.config.start_log, "a") as f:
                f.write(f"{item}\n")
        self.attempts[item] = self.attempts.get(item, 0) + 1
        if self.config.rollout_delay:
            await asyncio.sleep(self.config.rollout_delay)
        if self.config.fail_first_attempt and self.attempts[item] == 1:
            raise RuntimeError(f"first attempt of item {item} fails on purpose")
        group = ScoredDataGroup()
        group["tokens"] = [[1000 + item, 7, 8, s] for s in range(self.config.group_size)]
        group["masks"] = [[-100, -100, 8, s] for s in range(self.config.group_size)]
        group["scores"] = [float(s) for s in range(self.config.group_size)]
        if item < self.config.flat_below:
            group["scores"] = [1.0] * self.config.group_size
        return group, []

    async def evaluate(self, *args, **kwargs):
        return None


if __name__ == "__main__":
    sys.argv = [a for a in sys.argv]
    CountingEnv.cli()
