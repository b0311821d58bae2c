"""OpenEnv environments as atroposlib environments (extra ``openenv``, ``openenv==0.10.0``).

An OpenEnv environment is a Gym-style ``reset(seed) -> Observation`` / ``step(Action) ->
Observation`` object (``openenv.core.env_server.Environment``), usually served over HTTP with
``create_app``. :class:`OpenEnvEnv` plays it as a multi-turn atroposlib environment:

* **in process** (``--env.environment package.module:Class``): one instance per episode;
* **against its server** (``--env.url http://host:port``): one WebSocket session per episode
  (``openenv.core.GenericEnvClient``). OpenEnv's stateless HTTP ``/reset`` and ``/step`` build a
  fresh environment per call, so only session mode can hold an episode.

Each item is a reset seed; the ``group_size`` episodes of a group all start from
``reset(seed=...)`` with that seed, so they share one baseline. An episode is a
:class:`~atroposlib.envs.rollout.ChatSession`: the observation is shown to the model, the
model's turn becomes an action, the environment steps, until the observation says ``done``,
``--env.max_turns`` turns have passed or the token budget is spent. Observations are prompt
(masked); every model turn is trained on.

How a turn becomes an action (``--env.action_mode``):

* ``text``: the reply itself is the action's one text field (``{"guess": reply}``): games and
  chats whose action is a string;
* ``tool``: the model calls a tool ``act`` whose parameters are the action's fields (its JSON
  schema, from the Action class or the server's ``/schema``); a reply without a call ends the
  episode;
* ``auto`` (default): ``text`` when the action has exactly one required string field, else
  ``tool``.

An action the environment refuses (validation error, an exception in ``step``) is shown to the
model as ``{"error": ...}`` and counted (``train/invalid_actions``); the episode goes on. The
episode's score is the sum of the step rewards (``--env.reward last``: the last one); an
episode with no reward at all is sent with ``set_advantage_to_zero``.

:func:`training_traces` turns a group (any env's, with ``inference_logprobs``) into OpenEnv's
``TrainingTrace`` records, one per sequence and one turn per trained span (the engine call: the
tokens before it as prompt, the span as completion); ``--env.training_trace_path`` appends them,
with each sequence's score and seed, to a JSON-lines file as groups are made.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from atroposlib.envs.base import BaseEnv, ScoredDataGroup
from atroposlib.envs.config import LocalEnvConfig
from atroposlib.envs.environment_class import factory_spec, load_factory
from atroposlib.envs.rollout import ChatSession, group_from_trajectories
from atroposlib.envs.server_handling.policy_version import rollout_policy_version
from atroposlib.envs.server_handling.server_baseline import local_server_configs
from atroposlib.scoring.tools import ToolRegistry, parse_hermes_calls, parse_openai_calls

__all__ = ["OpenEnvEnv", "OpenEnvEnvConfig", "OpenEnvEpisode", "training_traces"]

#: Observation fields every OpenEnv observation has (not shown to the model as content).
BASE_OBSERVATION_FIELDS = ("done", "reward", "metadata")
ACT_TOOL = "act"


class OpenEnvEnvConfig(LocalEnvConfig):
    """Settings of :class:`OpenEnvEnv` (on top of ``BaseEnvConfig``)."""

    environment: str = Field(
        default="",
        description="An OpenEnv Environment class (or factory) to run in process: "
        "'package.module:Class' or 'file.py:Class'. Exclusive with --env.url",
    )
    action_class: str = Field(
        default="",
        description="Its Action class ('module:Class'); default: read from the Environment's "
        "type parameters (Environment[Action, Observation, State])",
    )
    url: str = Field(
        default="",
        description="A running OpenEnv server (http://host:port): one WebSocket session per "
        "episode. Exclusive with --env.environment",
    )
    action_mode: Literal["auto", "text", "tool"] = Field(
        default="auto",
        description="text: the reply is the action's one text field; tool: the model calls "
        "a tool 'act' with the action's fields; auto: text when the action has exactly one "
        "required string field",
    )
    reward: Literal["sum", "last"] = Field(
        default="sum", description="An episode's score: the sum of its step rewards, or the last"
    )
    seeds: int = Field(
        default=1000, ge=1, description="Training items are reset seeds 0 .. seeds-1, in turn"
    )
    eval_items: int = Field(
        default=16, ge=0, description="Episodes evaluate() plays (seeds after the training ones)"
    )
    max_turns: int = Field(default=8, ge=1, description="Model turns (actions) per episode")
    max_tokens_per_turn: int = Field(default=128, ge=1, description="Generation budget of a turn")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature")
    system_prompt: str | None = Field(
        default=None, description="A system message before the first observation"
    )
    training_trace_path: str | None = Field(
        default=None,
        description="Also append every group's sequences to this JSON-lines file as OpenEnv "
        'TrainingTrace records ({"seed", "score", "policy_version", '
        '"training_trace"}); needs a server that gives token ids and log-probs',
    )

    _spec = field_validator("environment", "action_class")(factory_spec)

    @model_validator(mode="after")
    def _one_source(self) -> OpenEnvEnvConfig:
        if self.environment and self.url:
            raise ValueError(
                "give --env.environment (in process) or --env.url (a server), not both"
            )
        return self


@dataclass
class OpenEnvEpisode:
    """What one episode produced: its trajectory, its step rewards, turns and refused actions."""

    trajectory: dict[str, Any] | None = None
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    invalid_actions: int = 0
    done: bool = False


# ----------------------------------------------------------------------------- sessions


class _Session:
    """One episode's environment: ``reset`` and ``step`` returning ``(observation fields,
    reward, done)``."""

    async def reset(self, seed: int) -> tuple[dict[str, Any], float | None, bool]:
        raise NotImplementedError

    async def step(self, action: dict[str, Any]) -> tuple[dict[str, Any], float | None, bool]:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class _LocalSession(_Session):
    def __init__(self, env: Any, action_cls: type) -> None:
        self.env = env
        self.action_cls = action_cls

    @staticmethod
    def _split(observation: Any) -> tuple[dict[str, Any], float | None, bool]:
        data = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation)
        reward = data.get("reward")
        return data, None if reward is None else float(reward), bool(data.get("done"))

    async def reset(self, seed: int) -> tuple[dict[str, Any], float | None, bool]:
        reset = getattr(self.env, "reset_async", None)
        observation = await reset(seed=seed) if reset else self.env.reset(seed=seed)
        return self._split(observation)

    async def step(self, action: dict[str, Any]) -> tuple[dict[str, Any], float | None, bool]:
        typed = self.action_cls(**action)  # ValidationError: refused
        step = getattr(self.env, "step_async", None)
        observation = await step(typed) if step else self.env.step(typed)
        return self._split(observation)

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            result = close()
            if inspect.isawaitable(result):
                await result


class _RemoteSession(_Session):
    def __init__(self, url: str) -> None:
        from openenv.core import GenericEnvClient

        self.client = GenericEnvClient(base_url=url)
        self.connected = False

    @staticmethod
    def _split(result: Any) -> tuple[dict[str, Any], float | None, bool]:
        data = dict(result.observation or {})
        reward = result.reward
        return data, None if reward is None else float(reward), bool(result.done)

    async def reset(self, seed: int) -> tuple[dict[str, Any], float | None, bool]:
        await self.client.connect()
        self.connected = True
        return self._split(await self.client.reset(seed=seed))

    async def step(self, action: dict[str, Any]) -> tuple[dict[str, Any], float | None, bool]:
        return self._split(await self.client.step(action))

    async def close(self) -> None:
        if self.connected:
            await self.client.close()


def _action_class_of(env_cls: type) -> type | None:
    """The Action type parameter of ``Environment[Action, Observation, State]`` subclasses."""
    for klass in getattr(env_cls, "__mro__", ()):
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    return None


def _render(observation: dict[str, Any]) -> str:
    """What the model sees of an observation: its own fields (one text field as is, several
    as JSON)."""
    shown = {k: v for k, v in observation.items() if k not in BASE_OBSERVATION_FIELDS}
    if len(shown) == 1 and isinstance(next(iter(shown.values())), str):
        return next(iter(shown.values()))
    return json.dumps(shown, ensure_ascii=False, default=str)


# ----------------------------------------------------------------------------- export


def training_traces(group: Mapping[str, Any]) -> list[Any]:
    """OpenEnv ``TrainingTrace`` records of a scored group: one per sequence, one turn per
    trained span (a run of unmasked tokens: one engine call), whose prompt is every token
    before it and whose completion is the span, with the sampler's log-probs and a loss mask
    of 0 on the prompt and 1 on the completion. OpenEnv validates each turn.

    Raises:
        ValueError: the group has no ``inference_logprobs`` (a server that gives no token
            log-probs), or a sequence that OpenEnv's validation refuses.
    """
    from openenv.core.harness import TrainingTrace, TrainingTurn

    logprobs_all = group.get("inference_logprobs")
    if not logprobs_all:
        raise ValueError(
            "a TrainingTrace needs the sampler's log-probs: this group has no "
            "inference_logprobs (use a server that gives token ids, e.g. server_type vllm)"
        )
    traces = []
    for index, (tokens, masks, logprobs) in enumerate(
        zip(group["tokens"], group["masks"], logprobs_all, strict=True)
    ):
        turns = []
        start = None
        for pos in range(len(tokens) + 1):
            trained = pos < len(tokens) and masks[pos] != -100
            if trained and start is None:
                start = pos
            elif not trained and start is not None:
                prompt, completion = list(tokens[:start]), list(tokens[start:pos])
                turns.append(
                    TrainingTurn(
                        node_id=f"seq{index}-turn{len(turns)}",
                        prompt_token_ids=prompt,
                        completion_token_ids=completion,
                        per_token_logps=[float(x) for x in logprobs[start:pos]],
                        loss_mask=[0] * len(prompt) + [1] * len(completion),
                    )
                )
                start = None
        traces.append(TrainingTrace(turns=turns))
    return traces


# ----------------------------------------------------------------------------- the env


class OpenEnvEnv(BaseEnv):
    """An OpenEnv environment (in process or behind its server) as a multi-turn env."""

    name = "openenv"
    env_config_cls = OpenEnvEnvConfig
    default_server_configs = local_server_configs(num_requests_for_eval=8, timeout=300)

    async def setup(self) -> None:
        cfg = self.config
        if not cfg.environment and not cfg.url:
            raise ValueError(
                "--env.environment or --env.url: name the OpenEnv Environment class to run in "
                "process, or the URL of its server"
            )
        self.factory: Callable[[], Any] | None = None
        self.action_cls: type | None = None
        if cfg.environment:
            self.factory = load_factory(cfg.environment, "--env.environment")
            if cfg.action_class:
                self.action_cls = load_factory(cfg.action_class, "--env.action_class")
            else:
                self.action_cls = _action_class_of(self.factory)
            if self.action_cls is None or not hasattr(self.action_cls, "model_json_schema"):
                raise ValueError(
                    "--env.action_class: cannot read the Action class from "
                    f"{cfg.environment}'s type parameters; name it"
                )
            schema = self.action_cls.model_json_schema()
        else:
            schema = await self._remote_action_schema(cfg.url)
        self.action_schema = self._tool_parameters(schema)
        text_fields = [
            name
            for name in self.action_schema.get("required", [])
            if self.action_schema["properties"].get(name, {}).get("type") == "string"
        ]
        mode = cfg.action_mode
        if mode == "auto":
            mode = (
                "text"
                if len(text_fields) == 1 and len(self.action_schema["required"]) == 1
                else "tool"
            )
        if mode == "text" and len(text_fields) != 1:
            raise ValueError(
                "--env.action_mode text: the action needs exactly one required string field, "
                f"it has {self.action_schema.get('required', [])}"
            )
        self.action_mode = mode
        self.text_field = text_fields[0] if mode == "text" else None
        self.registry = ToolRegistry()
        from atroposlib.scoring.tools import Tool

        self.registry.register(
            Tool(ACT_TOOL, "Take an action in the environment.", self.action_schema, lambda **a: a)
        )
        self.iter = 0

    @staticmethod
    def _tool_parameters(schema: dict[str, Any]) -> dict[str, Any]:
        """The action's JSON schema as tool parameters (without OpenEnv's ``metadata``)."""
        props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
        required = [k for k in schema.get("required", []) if k in props]
        return {"type": "object", "properties": props, "required": required}

    @staticmethod
    async def _remote_action_schema(url: str) -> dict[str, Any]:
        import httpx

        async with httpx.AsyncClient(timeout=30) as client:
            try:
                reply = await client.get(url.rstrip("/") + "/schema")
                reply.raise_for_status()
            except httpx.HTTPError as exc:
                raise ConnectionError(
                    f"--env.url {url}: cannot read the action schema (GET /schema): {exc}"
                ) from exc
        return reply.json()["action"]

    async def get_next_item(self) -> dict[str, int]:
        seed = self.iter % self.config.seeds
        self.iter += 1
        return {"seed": seed}

    def _session(self) -> _Session:
        if self.factory is not None:
            return _LocalSession(self.factory(), self.action_cls)
        return _RemoteSession(self.config.url)

    def _action(self, choice: Any) -> tuple[dict[str, Any] | None, str | None]:
        """The action a model turn takes: ``(action, None)``, ``(None, why it is refused)``, or
        ``(None, None)`` when the turn takes none (tool mode, no call)."""
        text = choice.message.content or ""
        if self.action_mode == "text":
            return {self.text_field: text.strip()}, None
        tool_calls = getattr(choice.message, "tool_calls", None)
        calls = parse_openai_calls(tool_calls) if tool_calls else parse_hermes_calls(text)
        if not calls:
            return None, None
        problem = self.registry.validate(calls[0])
        if problem is not None:
            return None, problem
        return dict(calls[0].arguments), None

    async def play(self, seed: int, temperature: float, split: str | None = None) -> OpenEnvEpisode:
        """One episode from ``reset(seed=seed)``."""
        cfg = self.config
        episode = OpenEnvEpisode()
        session = self._session()
        try:
            observation, reward, done = await session.reset(seed)
            messages: list[dict[str, Any]] = []
            system = cfg.system_prompt or ""
            if self.action_mode == "tool":
                system = self.registry.hermes_system_prompt(system)
            if system:
                messages.append({"role": "system", "content": system})
            messages.append({"role": "user", "content": _render(observation)})
            extra = {"split": split} if split else {}
            async with ChatSession(
                self,
                messages,
                max_tokens_per_turn=cfg.max_tokens_per_turn,
                max_token_length=cfg.max_token_length,
                temperature=temperature,
            ) as chat:
                while not done and chat.turns < cfg.max_turns:
                    choice = await chat.generate(**extra)
                    if choice is None:
                        break
                    action, refused = self._action(choice)
                    if action is None and refused is None:
                        break  # tool mode: the model took no action
                    if action is not None:
                        try:
                            observation, reward, done = await session.step(action)
                        except (ValidationError, ValueError, TypeError) as exc:
                            refused = f"{type(exc).__name__}: {exc}"
                        except Exception as exc:  # a remote refusal, a failing step
                            refused = f"{type(exc).__name__}: {exc}"
                    if refused is not None:
                        episode.invalid_actions += 1
                        content = json.dumps({"error": refused})
                    else:
                        if reward is not None:
                            episode.rewards.append(reward)
                        content = _render(observation)
                    if done or chat.turns >= cfg.max_turns:
                        break
                    if self.action_mode == "tool":
                        chat.add("tool", f"<tool_response>\n{content}\n</tool_response>")
                    else:
                        chat.add("user", content)
                episode.trajectory = chat.trajectory()
                episode.turns = chat.turns
                episode.done = done
        finally:
            await session.close()
        return episode

    def score(self, episode: OpenEnvEpisode) -> float | None:
        """The episode's score (None: no step gave a reward)."""
        if not episode.rewards:
            return None
        return sum(episode.rewards) if self.config.reward == "sum" else episode.rewards[-1]

    async def collect_trajectories(
        self, item: dict[str, Any]
    ) -> tuple[ScoredDataGroup | None, list]:
        episodes = await asyncio.gather(
            *(
                self.play(item["seed"], self.config.temperature)
                for _ in range(self.config.group_size)
            )
        )
        scores = [self.score(e) for e in episodes]
        self.log_train_metric("train/reward", [s for s in scores if s is not None])
        self.log_train_metric("train/turns", [float(e.turns) for e in episodes])
        self.log_train_metric("train/invalid_actions", [float(e.invalid_actions) for e in episodes])
        self.log_train_metric("train/done", [float(e.done) for e in episodes])
        group = group_from_trajectories(
            [e.trajectory for e in episodes], scores, group_size=self.config.group_size
        )
        if group is not None and self.config.training_trace_path:
            await asyncio.to_thread(self._export, group, item["seed"])
        return group, []

    def _export(self, group: ScoredDataGroup, seed: int) -> None:
        """Append the group's sequences to ``--env.training_trace_path``."""
        lines = [
            json.dumps(
                {
                    "seed": seed,
                    "score": score,
                    "policy_version": group.get("policy_version", rollout_policy_version()),
                    "training_trace": trace.model_dump(mode="json"),
                }
            )
            for trace, score in zip(training_traces(group), group["scores"], strict=True)
        ]
        with open(self.config.training_trace_path, "a", encoding="utf-8") as out:
            out.write("\n".join(lines) + "\n")

    async def _eval_one(self, seed: int) -> dict[str, Any]:
        episode = await self.play(seed, 0.0, split="eval")
        score = self.score(episode)
        return {
            "seed": seed,
            "messages": episode.trajectory["messages"] if episode.trajectory else None,
            "score": 0.0 if score is None else score,
            "turns": episode.turns,
            "invalid_actions": episode.invalid_actions,
            "done": episode.done,
        }

    @staticmethod
    def summarize_eval(samples: list[dict[str, Any]]) -> dict[str, float]:
        """Mean reward, turns, refused actions and the share of episodes that finished."""
        n = max(1, len(samples))
        return {
            "eval/mean_reward": sum(s["score"] for s in samples) / n,
            "eval/turns": sum(s["turns"] for s in samples) / n,
            "eval/invalid_actions": sum(s["invalid_actions"] for s in samples) / n,
            "eval/done_rate": sum(s["done"] for s in samples) / n,
        }

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        first = self.config.seeds
        return await self.run_eval(
            [self._eval_one(first + i) for i in range(self.config.eval_items)],
            self.summarize_eval,
            generation_parameters={
                "temperature": 0.0,
                "max_tokens": self.config.max_tokens_per_turn,
                "max_turns": self.config.max_turns,
                "action_mode": self.action_mode,
            },
        )


if __name__ == "__main__":
    OpenEnvEnv.cli()
