"""Drives ``VerifiersEnv`` through its library API (run by the tests with the verifiers 0.4
virtualenv's Python): setup, one group, the buffered metrics, an episode's policy span, an
evaluation; prints one JSON object.

Usage: python verifiers_driver.py BASE_URL TOKENIZER TASKSET [RENDERER_JSON]
"""

from __future__ import annotations

import asyncio
import json
import sys

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.verifiers_env import VerifiersEnv, episode_samples


async def main(base_url: str, tokenizer: str, taskset: str, renderer: str) -> dict:
    from verifiers.v1.episode import PolicySpan

    config, _ = VerifiersEnv.config_init()
    config = config.model_copy(
        update={
            "taskset": taskset,
            "harness": "null",
            "tokenizer_name": tokenizer,
            "group_size": 4,
            "eval_items": 2,
            "max_tokens_per_turn": 48,
            "renderer": json.loads(renderer) if renderer else {},
        }
    )
    server = APIServerConfig(
        model_name="tiny", base_url=base_url, api_key="x", server_type="vllm",
        tokenizer_name=tokenizer, timeout=120,
    )  # fmt: skip
    env = VerifiersEnv(config, [server])
    await env.setup()
    try:
        item = await env.get_next_item()
        group, _ = await env.collect_trajectories(item)
        metrics = {k: sum(v) / len(v) for k, v in env._wandb_logging.train_metrics.items()}
        episode = await env.play(env.train_tasks[0], 0.0)
        span = episode.run.work.policy
        seen = {"start": span.start, "end": span.end}
        episode.run.work.policy = PolicySpan(start=3, end=5)
        samples, dropped = episode_samples(episode)
        evaluation = await env.evaluate()
        return {
            "group": dict(group),
            "metrics": metrics,
            "span": seen,
            "mapped_versions": [s.policy_version for s in samples],
            "dropped": dropped,
            "eval": evaluation,
            "eval_answers": [t.data.answer for t in env.eval_tasks],
            "train_tasks": len(env.train_tasks),
        }
    finally:
        await env.close()
        await env.server.close()


if __name__ == "__main__":
    args = sys.argv[1:] + [""] * (4 - len(sys.argv[1:]))
    print("RESULT " + json.dumps(asyncio.run(main(*args[:4]))))
