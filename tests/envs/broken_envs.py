"""A small correct environment and copies of it, each broken in one way ``check`` must name.

Run as a script: ``python tests/envs/broken_envs.py NAME check ...`` (NAME from ``ENVS``).
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import Field, field_validator

from atroposlib.envs import (
    BaseEnv,
    BaseEnvConfig,
    ScoredDataGroup,
    eval_completion,
    group_from_samples,
    sample_chat_group,
)

PROMPT = [{"role": "user", "content": "Say something."}]


class EchoConfig(BaseEnvConfig):
    reply_tokens: int = Field(default=6, ge=1, description="max_tokens of a reply")


class Echo(BaseEnv):
    """Scores a reply 1 when its length is even: a mix within most groups."""

    name = "echo"
    env_config_cls = EchoConfig

    async def setup(self) -> None:
        self.n = 0

    async def get_next_item(self) -> dict[str, Any]:
        self.n += 1
        return {"id": self.n}

    async def collect_trajectories(self, item: Any) -> tuple[ScoredDataGroup | None, list]:
        samples = await sample_chat_group(
            self, PROMPT, n=self.config.group_size, max_tokens=self.config.reply_tokens,
            temperature=1.0,
        )  # fmt: skip
        return group_from_samples(samples, [float(len(s.text) % 2) for s in samples]), []

    async def _one(self) -> dict[str, Any]:
        text, _ = await eval_completion(self, PROMPT, max_tokens=4, temperature=0.0)
        return {"text": text, "score": float(len(text) % 2)}

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return await self.run_eval(
            [self._one() for _ in range(50)],
            lambda samples: {"eval/odd": sum(s["score"] for s in samples) / len(samples)},
        )


class PromptTrained(Echo):
    async def collect_trajectories(self, item: Any) -> tuple[ScoredDataGroup | None, list]:
        group, backlog = await super().collect_trajectories(item)
        group["masks"] = [list(tokens) for tokens in group["tokens"]]  # forgot to mask
        return group, backlog


class WrongSize(Echo):
    async def collect_trajectories(self, item: Any) -> tuple[ScoredDataGroup | None, list]:
        group, backlog = await super().collect_trajectories(item)
        for key in ("tokens", "masks", "scores", "messages", "inference_logprobs"):
            group[key] = group[key][:-1]  # dropped a reply, said nothing
        return group, backlog


class BadLengths(Echo):
    async def collect_trajectories(self, item: Any) -> tuple[ScoredDataGroup | None, list]:
        group, backlog = await super().collect_trajectories(item)
        group["masks"][1] = group["masks"][1][:-2]
        return group, backlog


class EvalFails(Echo):
    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return {"eval/x": self.eval_table["missing"]}  # type: ignore[attr-defined]


class EvalEmpty(Echo):
    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return {}


class DriftingConfig(EchoConfig):
    @field_validator("reply_tokens")
    @classmethod
    def _grow(cls, value: int) -> int:
        return value + 1  # each read adds one: YAML gives back another value


class BadConfig(Echo):
    env_config_cls = DriftingConfig

    @classmethod
    def config_init(cls) -> tuple[DriftingConfig, Any]:
        config, servers = super().config_init()
        return DriftingConfig(**config.model_dump()), servers


ENVS: dict[str, type[BaseEnv]] = {
    cls.__name__: cls
    for cls in (Echo, PromptTrained, WrongSize, BadLengths, EvalFails, EvalEmpty, BadConfig)
}

if __name__ == "__main__":
    ENVS[sys.argv.pop(1)].cli()
