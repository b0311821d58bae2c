"""``CountingEnv`` whose ``evaluate()`` asks its inference server which weights it serves.

Each ``evaluate()`` call ``k`` reports ``eval/run = k`` and ``eval/served_version``: the
``policy_version`` its first inference server reported while the evaluation ran (what a real
evaluation would measure). ``--env.eval_seconds`` makes it last that long (to sync the server
in the middle of one). For the tests of evaluations pinned to a policy version.
"""

import asyncio

import httpx
from pydantic import Field

from atroposlib.envs.server_handling.server_baseline import server_root
from tests.envs.counting_env import CountingConfig, CountingEnv


class VersionEvalConfig(CountingConfig):
    eval_seconds: float = Field(default=0.0, description="Seconds each evaluate() lasts")
    eval_until_change: float = Field(
        default=0.0,
        description="Each evaluate() lasts until the server's version changes, at most this "
        "many seconds (after eval_seconds)",
    )
    eval_marker: str = Field(default="", description="File to append a line to as each starts")


class VersionEvalEnv(CountingEnv):
    name = "version_eval"
    env_config_cls = VersionEvalConfig

    @classmethod
    def config_init(cls):
        config, servers = super().config_init()
        return VersionEvalConfig(**config.model_dump()), servers

    async def setup(self):
        await super().setup()
        self.evals = 0

    async def evaluate(self, *args, **kwargs):
        self.evals += 1
        root = server_root(self.server.servers[0].config.base_url)
        async with httpx.AsyncClient() as client:
            version = (await client.get(f"{root}/policy_version")).json()["policy_version"]
            if self.config.eval_marker:
                with open(self.config.eval_marker, "a") as f:
                    f.write(f"{self.config.wandb_name} {version}\n")
            await asyncio.sleep(self.config.eval_seconds)
            deadline = asyncio.get_running_loop().time() + self.config.eval_until_change
            while asyncio.get_running_loop().time() < deadline:
                now = (await client.get(f"{root}/policy_version")).json()["policy_version"]
                if now != version:
                    break
                await asyncio.sleep(0.1)
        await self.evaluate_log({"eval/run": self.evals, "eval/served_version": version})


if __name__ == "__main__":
    VersionEvalEnv.cli()
