"""verifiers environments as atroposlib environments (extra ``verifiers``: ``verifiers==0.4.0``).

verifiers 0.4 (``import verifiers.v1 as vf``) splits an environment into a *taskset* (an
installed package exporting a ``vf.Taskset``: the tasks and their ``@vf.reward`` /
``@vf.metric`` scoring), the *harness* that plays a task (a chat program, a coding agent ...)
in a *runtime* (a subprocess here, or a container), and the ``vf.Env`` that turns one task into
one ``Episode`` of ``Trace`` records. :class:`VerifiersEnv` loads such an environment by name
(``--env.taskset vf-reverse``, as ``vf-eval`` does) and plays it with verifiers' own machinery:

* every model call of a harness goes through verifiers' interception server to its *training
  client* (``TrainClientConfig``), which renders the chat with the model's template and calls
  the inference server's tokens-in/tokens-out ``POST /inference/v1/generate`` (atropos-serve and
  vLLM serve it). The trace then holds the exact token ids the server saw and sampled and their
  log-probs: a group's ``tokens`` are the branch's ``token_ids``, ``masks`` keep the sampled
  tokens (prompt, template and tool results are ``-100``), ``inference_logprobs`` are the
  sampler's (``1.0`` under unsampled tokens). Nothing is re-tokenized.
* a group is ``group_size`` episodes of one task (one baseline); each trainable branch of each
  trainable trace is one sequence, scored with the trace's reward (the weighted sum of its
  reward terms). A trace whose scoring did not run is sent with ``set_advantage_to_zero``; a
  failed episode is left out of the group and counted (``train/failed_episodes``).
* each reward term is logged as ``train/<term>`` (unweighted, as verifiers reports it), each
  metric as ``train/<metric>``; evaluation (greedy, held-out tasks) as ``eval/<name>``.
* the policy versions an episode spanned (``GET /policy_version`` of its server before and
  after it) are stamped on the episode as verifiers' ``PolicySpan``; a sequence's
  ``policy_version`` is the span's start, the oldest weights that can have sampled it.

:func:`episode_samples` is the mapping on its own: any verifiers ``Episode`` whose traces carry
tokens (one from prime-rl's env server, say) becomes the same sequences.

Multi-turn environments (tools from the task's ``vf.Toolset`` MCP servers, simulated users)
need nothing more: the harness runs the turns, the trace records them. verifiers' chat harnesses
(``null``, ``bash``) start their program with ``uv`` (installed with the extra); ``uv`` fetches
the program's few dependencies from the package index the first time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from atroposlib.envs.base import BaseEnv, ScoredDataGroup
from atroposlib.envs.config import LocalEnvConfig
from atroposlib.envs.rollout import (
    group_from_trajectories,
    log_reward_terms,
    reward_term_values,
)
from atroposlib.envs.server_handling.server_baseline import local_server_configs
from atroposlib.envs.tokenizers import resolve_tokenizer_name
from atroposlib.utils.cli import merge_dicts

logger = logging.getLogger(__name__)

__all__ = ["VerifiersEnv", "VerifiersEnvConfig", "VerifiersSample", "episode_samples"]

#: The environment variable each server's API key is handed to verifiers' client through.
API_KEY_VAR = "ATROPOS_VERIFIERS_API_KEY_{index}"
#: The sentinel under tokens the sampler did not produce (the library's convention).
UNSAMPLED_LOGPROB = 1.0


class VerifiersEnvConfig(LocalEnvConfig):
    """Settings of :class:`VerifiersEnv` (on top of ``BaseEnvConfig``)."""

    taskset: str = Field(
        default="",
        description="The verifiers taskset to play: an installed package exporting a "
        "vf.Taskset (its id, e.g. 'vf-reverse' or 'owner/name'), as vf-eval takes it",
    )
    env_id: str = Field(
        default="",
        description="A verifiers Env to pair with the taskset (e.g. 'best-of-n'); empty: the "
        "taskset's own, else verifiers' single-agent env",
    )
    harness: str = Field(
        default="",
        description="The harness every agent seat runs (e.g. 'null': a plain chat loop with the "
        "task's tools); empty: verifiers' default (the taskset's own harness, else 'bash')",
    )
    runtime: str = Field(
        default="subprocess",
        description="Where harness programs run: verifiers' runtime type ('subprocess': on this "
        "machine; 'docker', 'podman', 'apptainer', 'prime')",
    )
    env_args: dict[str, Any] = Field(
        default_factory=dict,
        description="More verifiers env config, merged over the above (JSON or YAML mapping), "
        'e.g. {"taskset": {"num_tasks": 50}} or {"agent": {"max_turns": 4}}',
    )
    renderer: dict[str, Any] = Field(
        default_factory=dict,
        description="The renderers.RendererConfig verifiers' training client renders chats "
        'with, e.g. {"name": "default", "tool_parser": "qwen3"} for hermes-style '
        "<tool_call> replies; empty: chosen from the tokenizer",
    )
    max_tasks: int = Field(
        default=100_000, ge=1, description="Tasks read from the taskset (bounds infinite ones)"
    )
    eval_items: int = Field(
        default=16,
        ge=0,
        description="Tasks held out of training for evaluate() (the first of the shuffled "
        "taskset), one greedy episode each",
    )
    shuffle_seed: int = Field(default=0, description="Seed of the task order")
    max_tokens_per_turn: int = Field(default=256, ge=1, description="Generation budget of a turn")
    max_turns: int | None = Field(
        default=None, ge=1, description="Model turns per agent run (None: the harness's own)"
    )
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature")


@dataclass
class VerifiersSample:
    """One training sequence of a verifiers episode (one trainable branch of one trace)."""

    trajectory: dict[str, Any] | None
    """``{"tokens", "masks", "inference_logprobs", "messages"}``; None when the branch holds
    no sampled tokens."""
    score: float | None
    """The trace's reward (weighted sum of its terms); None when its scoring did not run."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Each reward term's unweighted score."""
    metrics: dict[str, float] = field(default_factory=dict)
    turns: int = 0
    truncated: bool = False
    policy_version: int | None = None


def _message(message: Any) -> dict[str, Any]:
    """A verifiers message as an OpenAI-style chat message (text content)."""
    from verifiers.v1.types import content_text

    out: dict[str, Any] = {"role": message.role, "content": content_text(message.content) or ""}
    calls = getattr(message, "tool_calls", None)
    if calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    if message.role == "tool" and getattr(message, "tool_call_id", None):
        out["tool_call_id"] = message.tool_call_id
    return out


def _policy_start(episode: Any) -> int | None:
    run = getattr(episode, "run", None)
    work = getattr(run, "work", None)
    policy = getattr(work, "policy", None)
    return None if policy is None else int(policy.start)


def episode_samples(episode: Any) -> tuple[list[VerifiersSample], list[str]]:
    """The training sequences of a verifiers ``Episode``, and why each left-out trace was left
    out (``"episode_failed"``, ``"trace_failed"``).

    Every trainable branch of every trainable trace is one sequence: ``tokens`` are the
    branch's ``token_ids`` (what the server saw and sampled), ``masks`` the sampled tokens and
    ``-100`` elsewhere, ``inference_logprobs`` the sampler's log-probs and ``1.0`` under
    unsampled tokens. Traces of seats marked not trainable (a judge) are skipped silently. A
    sequence's ``policy_version`` is the start of the episode's policy span, when it has one.
    """
    if not episode.ok:
        return [], ["episode_failed"] * max(1, len(episode.traces))
    version = _policy_start(episode)
    samples: list[VerifiersSample] = []
    dropped: list[str] = []
    for trace in episode.traces:
        if not trace.agent.trainable:
            continue
        if not trace.ok:
            dropped.append("trace_failed")
            continue
        rewards = {name: r.score for name, r in trace.rewards.items() if r is not None}
        scored = bool(trace.rewards) and all(r is not None for r in trace.rewards.values())
        metrics = {name: float(v) for name, v in trace.metrics.items() if v is not None}
        for branch in trace.branches:
            if not branch.trainable:
                continue
            tokens = list(branch.token_ids)
            sampled = list(branch.sampled_mask)
            trajectory: dict[str, Any] | None = None
            if tokens and any(sampled):
                logprobs = branch.logprobs
                trajectory = {
                    "tokens": tokens,
                    "masks": [t if s else -100 for t, s in zip(tokens, sampled, strict=True)],
                    "inference_logprobs": [
                        lp if s else UNSAMPLED_LOGPROB
                        for lp, s in zip(logprobs, sampled, strict=True)
                    ],
                    "messages": [_message(m) for m in branch.messages],
                }
            samples.append(
                VerifiersSample(
                    trajectory=trajectory,
                    score=trace.reward if scored else None,
                    rewards=rewards,
                    metrics=metrics,
                    turns=trace.num_turns,
                    truncated=trace.is_truncated,
                    policy_version=version,
                )
            )
    return samples, dropped


class VerifiersEnv(BaseEnv):
    """A verifiers 0.4 environment (taskset + harness + env), loaded by name."""

    name = "verifiers"
    env_config_cls = VerifiersEnvConfig
    default_server_configs = local_server_configs(num_requests_for_eval=8, timeout=300)

    # ----------------------------------------------------------------------- setup

    def _env_config(self, vf: Any) -> Any:
        """verifiers' env config: taskset and env ids, each agent seat's harness, runtime and
        budget, then ``--env.env_args`` over all of it."""
        from verifiers.v1.configs.agent import agent_config_fields

        cfg = self.config
        base: dict[str, Any] = {"taskset": {"id": cfg.taskset}}
        if cfg.env_id:
            base["id"] = cfg.env_id
        try:
            roles = list(
                agent_config_fields(vf.resolve_env_config(merge_dicts(base, cfg.env_args)))
            )
        except Exception as exc:  # noqa: BLE001 - name the flag whatever verifiers raised
            raise ValueError(f"--env.taskset {cfg.taskset!r}: {exc}") from exc
        seat: dict[str, Any] = {
            "runtime": {"type": cfg.runtime},
            "max_total_tokens": cfg.max_token_length,
        }
        if cfg.harness:
            seat["harness"] = {"id": cfg.harness}
        if cfg.max_turns is not None:
            seat["max_turns"] = cfg.max_turns
        data = merge_dicts(base, {role: seat for role in roles}, cfg.env_args)
        try:
            return vf.resolve_env_config(data)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"--env.env_args / --env.harness / --env.runtime: {exc}") from exc

    async def setup(self) -> None:
        cfg = self.config
        if not cfg.taskset:
            raise ValueError(
                "--env.taskset: name the verifiers taskset to play (an installed package "
                "exporting a vf.Taskset, e.g. 'vf-reverse')"
            )
        try:
            import verifiers.v1 as vf
        except ImportError as exc:
            raise ImportError(
                "VerifiersEnv needs verifiers 0.4: pip install 'atroposlib[verifiers]'"
            ) from exc
        self._check_servers()
        # verifiers' interception server logs every model call at INFO through aiohttp
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
        # verifiers' chat harnesses start their program with `uv`: the one installed beside
        # this interpreter (the extra's) works even when its virtualenv is not activated
        bindir = os.path.dirname(sys.executable)
        if os.path.exists(os.path.join(bindir, "uv")) and bindir not in os.environ.get(
            "PATH", ""
        ).split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        env_config = self._env_config(vf)
        try:
            self.vf_env = vf.load_environment(env_config)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"--env.taskset {cfg.taskset!r}: {exc}") from exc
        harnesses = self.vf_env._harnesses.values()
        if any(getattr(h.config, "id", "") in ("null", "bash") for h in harnesses) and not (
            shutil.which("uv")
        ):
            raise RuntimeError(
                "verifiers' chat harnesses run their program with uv, which is not installed: "
                "pip install uv (the 'verifiers' extra does)"
            )
        tasks = await asyncio.to_thread(lambda: list(self.vf_env.taskset.take(cfg.max_tasks)))
        if not tasks:
            raise ValueError(f"--env.taskset {cfg.taskset!r}: the taskset has no tasks")
        random.Random(cfg.shuffle_seed).shuffle(tasks)
        if cfg.eval_items >= len(tasks):
            raise ValueError(
                f"--env.eval_items {cfg.eval_items}: the taskset has {len(tasks)} tasks, none "
                "would be left for training"
            )
        self.eval_tasks = tasks[: cfg.eval_items]
        self.train_tasks = tasks[cfg.eval_items :]
        self.renderer_config = self._renderer_config()
        self.renderer_model = resolve_tokenizer_name(cfg.tokenizer_name)
        for i, server in enumerate(self.server.servers):
            os.environ[API_KEY_VAR.format(index=i)] = getattr(server.config, "api_key", "") or "x"
        self._serving = AsyncExitStack()
        await self._serving.enter_async_context(self.vf_env.serving())
        self.iter = 0
        logger.info(
            "verifiers env %s: %d training tasks, %d held out for evaluation, seats %s",
            env_config.env_id,
            len(self.train_tasks),
            len(self.eval_tasks),
            {name: h.config.id for name, h in self.vf_env._harnesses.items()},
        )

    def _check_servers(self) -> None:
        """Refuse servers verifiers' training client cannot use (it needs token ids)."""
        from atroposlib.backends.registry import serves_token_generate

        for server in self.server.servers:
            server_type = getattr(server.config, "server_type", "openai")
            if not serves_token_generate(server_type):
                raise ValueError(
                    f"--openai.server_type {server_type}: VerifiersEnv needs a server with "
                    "vLLM's tokens-in/tokens-out POST /inference/v1/generate (atropos-serve or "
                    "vLLM, server_type vllm), so that groups hold the exact sampled tokens"
                )

    def _renderer_config(self) -> Any:
        if not self.config.renderer:
            return None
        from pydantic import TypeAdapter
        from renderers import RendererConfig

        try:
            return TypeAdapter(RendererConfig).validate_python(dict(self.config.renderer))
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"--env.renderer: {exc}") from exc

    async def close(self) -> None:
        serving = getattr(self, "_serving", None)
        if serving is not None:
            self._serving = None
            await serving.aclose()

    # ----------------------------------------------------------------------- episodes

    async def get_next_item(self) -> dict[str, int]:
        index = self.iter % len(self.train_tasks)
        self.iter += 1
        return {"task": index}

    async def play(self, task: Any, temperature: float, training: bool = True) -> Any:
        """One verifiers episode of ``task`` on the most available server, stamped with the
        policy versions it spanned."""
        from verifiers.v1 import Sampling
        from verifiers.v1.clients import ModelContext
        from verifiers.v1.configs.client import TrainClientConfig
        from verifiers.v1.episode import PolicySpan, TrainRunInfo, TrainWorkInfo

        async with self.server.dedicated_server("train" if training else "eval") as server:
            index = self.server.servers.index(server)
            tracker = server._policy_tracker()
            start = await tracker.current()
            client = TrainClientConfig(
                base_url=server.config.base_url,
                api_key_var=API_KEY_VAR.format(index=index),
                renderer=self.renderer_config,
                renderer_model_name=self.renderer_model,
            )
            ctx = ModelContext(
                model=server.config.model_name,
                client=client,
                sampling=Sampling(
                    temperature=temperature, max_tokens=self.config.max_tokens_per_turn
                ),
            )
            slot = self.vf_env.slots(task, 1)[0]
            episode = await self.vf_env.run_slot(slot, ctx)
            end = await tracker.current()
        if start is not None:
            span = PolicySpan(start=start, end=max(start, end if end is not None else start))
            episode.record_run(
                TrainRunInfo(
                    id=str(self.wandb_prepend or self.name),
                    name=self.config.wandb_name,
                    work=TrainWorkInfo(step=self.curr_step, policy=span),
                )
            )
        return episode

    def _log_samples(self, prefix: str, samples: list[VerifiersSample]) -> None:
        log_reward_terms(self, prefix, [{**s.rewards, **s.metrics} for s in samples])

    async def collect_trajectories(
        self, item: dict[str, Any]
    ) -> tuple[ScoredDataGroup | None, list]:
        cfg = self.config
        task = self.train_tasks[item["task"]]
        episodes = await asyncio.gather(
            *(self.play(task, cfg.temperature) for _ in range(cfg.group_size))
        )
        samples: list[VerifiersSample] = []
        dropped: list[str] = []
        for episode in episodes:
            got, lost = episode_samples(episode)
            samples += got
            dropped += lost
        failed = sum(1 for e in episodes if not e.ok)
        self.log_train_metric("train/failed_episodes", failed / len(episodes))
        if not samples:
            errors = [e.last_error for e in episodes if e.last_error is not None]
            errors += [t.last_error for e in episodes for t in e.traces if t.last_error is not None]
            detail = f"{errors[0].type}: {errors[0].message}" if errors else "no trainable trace"
            raise RuntimeError(
                f"verifiers task {task.data.idx}: every episode failed ({', '.join(dropped)}); "
                f"first error: {detail}"
            )
        scores = [s.score for s in samples]
        self.log_train_metric("train/reward", [s for s in scores if s is not None])
        self.log_train_metric("train/turns", [float(s.turns) for s in samples])
        self.log_train_metric("train/truncated", [float(s.truncated) for s in samples])
        self._log_samples("train", samples)
        generation = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens_per_turn}
        trajectories = [
            None if s.trajectory is None else {**s.trajectory, "generation_params": generation}
            for s in samples
        ]
        group = group_from_trajectories(trajectories, scores, group_size=cfg.group_size)
        versions = [s.policy_version for s in samples if s.policy_version is not None]
        if group is not None and versions:
            group["policy_version"] = min(versions)
        return group, []

    # ----------------------------------------------------------------------- evaluation

    async def _eval_one(self, task: Any) -> dict[str, Any]:
        episode = await self.play(task, 0.0, training=False)
        samples, _ = episode_samples(episode)
        sample = samples[0] if samples else None
        return {
            "task": task.data.idx,
            "messages": sample.trajectory["messages"] if sample and sample.trajectory else None,
            "score": (sample.score or 0.0) if sample else 0.0,
            "failed": sample is None,
            "turns": sample.turns if sample else 0,
            "terms": {**sample.rewards, **sample.metrics} if sample else {},
        }

    @staticmethod
    def summarize_eval(samples: list[dict[str, Any]]) -> dict[str, float]:
        """Mean reward, each reward term and metric, turns and the failed share."""
        n = max(1, len(samples))
        out = {
            "eval/mean_reward": sum(s["score"] for s in samples) / n,
            "eval/turns": sum(s["turns"] for s in samples) / n,
            "eval/failed_rate": sum(s["failed"] for s in samples) / n,
        }
        for name, values in reward_term_values([s["terms"] for s in samples]).items():
            out.setdefault(f"eval/{name}", sum(values) / len(values))
        return out

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return await self.run_eval(
            [self._eval_one(task) for task in self.eval_tasks],
            self.summarize_eval,
            generation_parameters={
                "temperature": 0.0,
                "max_tokens": self.config.max_tokens_per_turn,
                "taskset": self.config.taskset,
                "harness": self.config.harness or "default",
            },
        )


if __name__ == "__main__":
    VerifiersEnv.cli()
