"""TRL-style environment classes as atroposlib environments.

TRL's ``GRPOTrainer(environment_factory=...)`` takes a class (or any zero-argument factory) whose
instances follow a small contract, also used by TRL's OpenEnv, OpenReward and Harbor wrappers:

* ``reset(**row) -> str | None``: start an episode for one dataset row (the row's columns as
  keyword arguments); a returned string is appended to the last user message of the prompt.
* every other public method is a **tool** the model may call; its name, type hints and
  Google-style docstring describe it (``transformers.utils.get_json_schema``). Tools may be
  ``async``. What a tool returns is shown to the model as ``str(result)``; an exception becomes
  ``{"error": "..."}``.
* optional ``get_reward() -> float`` (may be ``async``): the episode's reward, read once after
  the episode from the instance's own state.

:class:`EnvironmentClassEnv` runs such a class as a multi-turn tool-calling ``BaseEnv``, so the
same class trains with any trainer behind run-api. For each item (a dataset row) it plays
``group_size`` episodes, each on its own instance (instances are pooled and reused through
``reset``, as TRL does). An episode is a :class:`~atroposlib.envs.rollout.ChatSession`: the model
writes a turn; if the turn calls tools they run and their results go back as ``tool`` messages;
the episode ends at a turn without tool calls, after ``max_turns`` turns, or when the token
budget is spent. Tokens, masks and sampler log-probs come from the server (every assistant turn
trained on, prompts and tool results masked), exactly as ``ManagedServer`` recorded them.

The reward of an episode is the weighted sum of its reward terms, as in TRL: ``get_reward``
(weight 1, named after the class) and any TRL-style ``reward_funcs``
(``f(prompts, completions, completion_ids, environments, **columns) -> list[float | None]``).
A term that returns ``None`` for an episode is left out of its sum; an episode no term scores is
sent with ``set_advantage_to_zero`` (it cannot teach anything). Each term is logged as
``train/<term>`` (and ``eval/<term>``), with tool use (``train/tool_calls``,
``train/tool_failures``, ``train/turns``).

Use it from your own file::

    from atroposlib.envs import EnvironmentClassEnv

    class Counter:
        def reset(self, **row): ...
        def increment(self, step: int) -> int:
            \"\"\"Add ``step`` to the counter.

            Args:
                step: How much to add.
            \"\"\"
        def get_reward(self) -> float: ...

    if __name__ == "__main__":
        EnvironmentClassEnv.wrap(Counter, rows="rows.jsonl").cli()

or without writing one, naming the class and the rows on the command line::

    python -m atroposlib.envs.environment_class process \\
        --env.environment_factory my_package.envs:Counter --env.dataset rows.jsonl

Rows are JSON objects; a ``prompt`` column (a chat, or a string taken as one user message) is
the episode's prompt, and every column is passed to ``reset``. Without rows every episode
starts from ``reset()`` alone (the environment makes its own tasks).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from atroposlib.envs.base import BaseEnv, ScoredDataGroup
from atroposlib.envs.config import LocalEnvConfig
from atroposlib.envs.rollout import (
    ChatSession,
    group_from_trajectories,
    log_reward_terms,
    reward_term_values,
    weighted_reward,
)
from atroposlib.envs.server_handling.server_baseline import local_server_configs
from atroposlib.scoring.tools import (
    ParsedCall,
    Tool,
    ToolRegistry,
    parse_hermes_calls,
    parse_openai_calls,
)
from atroposlib.utils.data import load_rows

__all__ = [
    "EnvironmentClassEnv",
    "EnvironmentClassEnvConfig",
    "EnvironmentContractError",
    "Episode",
    "environment_tools",
    "load_factory",
]

#: Methods of the contract that are not tools.
CONTRACT_METHODS = ("reset", "get_reward")


class EnvironmentContractError(TypeError):
    """An environment class does not follow the ``environment_factory`` contract; the message
    names the class, the method and what is wrong."""


def split_factory_spec(spec: str) -> tuple[str, str]:
    """``(module, name)`` of ``package.module:Name`` or ``path/to/file.py:Name``.

    Raises:
        ValueError: ``spec`` is not of that form.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'package.module:Class' or 'file.py:Class', got {spec!r}")
    return module_name, attr


def factory_spec(value: str) -> str:
    """A config validator: ``value`` unchanged when empty or a well-formed factory spec."""
    if value:
        split_factory_spec(value)
    return value


def load_factory(spec: str, flag: str = "--env.environment_factory") -> Callable[[], Any]:
    """The factory named by ``spec``: ``package.module:Name`` or ``path/to/file.py:Name``.

    Raises:
        ValueError: ``spec`` is malformed, the module cannot be imported or lacks ``Name``
            (the message starts with ``flag``).
    """
    try:
        module_name, attr = split_factory_spec(spec)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"no such file {path}")
            name = f"_atropos_environment_{path.stem}"
            module_spec = importlib.util.spec_from_file_location(name, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(
            f"{flag}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"{flag}: {module_name!r} has no callable {attr!r}")
    return factory


def environment_tools(instance: Any) -> dict[str, Callable[..., Any]]:
    """The tools of an environment instance: its public methods other than ``reset`` and
    ``get_reward``, bound to it (listed on the class, as TRL does, so properties are not
    evaluated)."""
    return {
        name: getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in CONTRACT_METHODS and not name.startswith("_")
    }


_SCHEMAS: dict[type, dict[str, tuple[str, dict[str, Any]]]] = {}


def _tool_registry(instance: Any) -> ToolRegistry:
    """A :class:`ToolRegistry` of ``instance``'s tools, their schemas from their signatures
    and docstrings (``transformers.utils.get_json_schema``; worked out once per class)."""
    cls = type(instance)
    schemas = _SCHEMAS.get(cls)
    if schemas is None:
        from transformers.utils import get_json_schema

        schemas = {}
        for name, method in environment_tools(instance).items():
            try:
                schema = get_json_schema(method)["function"]
            except Exception as exc:
                raise EnvironmentContractError(
                    f"{cls.__name__}.{name}: cannot describe it as a tool ({exc}); give every "
                    "argument a type hint and a Google-style docstring with an 'Args:' entry "
                    "for each (or make the method private with a leading underscore)"
                ) from exc
            schemas[name] = (schema.get("description", ""), schema.get("parameters", {}))
        _SCHEMAS[cls] = schemas
    return ToolRegistry(
        [
            Tool(name, description, parameters, getattr(instance, name))
            for name, (description, parameters) in schemas.items()
        ]
    )


def check_environment(instance: Any) -> ToolRegistry:
    """Check ``instance`` against the contract; its tool registry.

    Raises:
        EnvironmentContractError: no callable ``reset``, a ``get_reward`` that takes
            arguments, or a tool that cannot be described.
    """
    cls = type(instance).__name__
    reset = getattr(instance, "reset", None)
    if not callable(reset):
        raise EnvironmentContractError(
            f"{cls}.reset: missing; an environment must define reset(**row)"
        )
    get_reward = getattr(instance, "get_reward", None)
    if get_reward is not None:
        required = [
            p
            for p in inspect.signature(get_reward).parameters.values()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if required:
            raise EnvironmentContractError(
                f"{cls}.get_reward: must take no arguments, takes {[p.name for p in required]}"
            )
    return _tool_registry(instance)


def _completion_ids(trajectory: dict[str, Any] | None) -> list[int]:
    """The tokens after the prompt (the model's turns and the tool results between them)."""
    if not trajectory:
        return []
    masks = trajectory["masks"]
    first = next((i for i, m in enumerate(masks) if m != -100), len(masks))
    return list(trajectory["tokens"][first:])


def _prompt_of(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's prompt as a chat (TRL: ``prompt`` column, conversational or a plain string;
    none: one empty user message)."""
    prompt = row.get("prompt")
    if prompt is None:
        return [{"role": "user", "content": ""}]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(
        f"prompt: expected a string or a list of {{'role', 'content'}} messages, got {prompt!r:.120}"
    )


class EnvironmentClassEnvConfig(LocalEnvConfig):
    """Settings of :class:`EnvironmentClassEnv` (on top of ``BaseEnvConfig``)."""

    environment_factory: str = Field(
        default="",
        description="The environment class (or factory): 'package.module:Class' or "
        "'path/to/file.py:Class'. Not needed when the env file binds one "
        "(EnvironmentClassEnv.wrap).",
    )
    dataset: str | None = Field(
        default=None,
        description="Rows for reset(**row): a .jsonl/.json file or a folder with train.jsonl. "
        "None: every episode starts from reset() alone.",
    )
    eval_dataset: str | None = Field(
        default=None,
        description="Rows evaluate() plays (greedy). None: the last eval_items rows of "
        "--env.dataset are held out of training for it.",
    )
    eval_items: int = Field(default=16, ge=0, description="Episodes evaluate() plays")
    max_turns: int = Field(
        default=8,
        ge=1,
        description="Model turns per episode (TRL's max_tool_calling_iterations + 1)",
    )
    max_tokens_per_turn: int = Field(default=256, ge=1, description="Generation budget of a turn")
    max_calls_per_turn: int = Field(
        default=8, ge=1, description="Tool calls run per turn; further calls are failures"
    )
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature")
    system_prompt: str | None = Field(
        default=None,
        description="A system message put before rows' prompts that have none (the tool list "
        "is added to it in the hermes format)",
    )
    tool_format: Literal["auto", "hermes", "openai"] = Field(
        default="auto",
        description="How tools reach the model: 'openai' sends tools=[...] for the chat "
        "template to render; 'hermes' lists them in the system prompt and reads "
        "<tool_call> blocks; 'auto' picks openai when the tokenizer's chat template renders "
        "tools, else hermes",
    )

    _factory_spec = field_validator("environment_factory")(factory_spec)

    tools_in_threads: bool = Field(
        default=True,
        description="Run synchronous reset/tool/get_reward calls in worker threads, so a "
        "slow tool does not stall the other episodes (one instance is only used by one "
        "episode at a time)",
    )


@dataclass
class Episode:
    """What one episode produced.

    Attributes:
        instance: The environment instance it ran on.
        prompt: The chat the model started from (system prompt and observation included).
        completion: What came after: assistant turns and tool results.
        trajectory: ``ChatSession.trajectory()`` (None when the model never spoke).
        terms: Each reward term's value (None where the term did not score it).
        tool_calls: Calls the model made; ``tool_failures`` of them failed.
        turns: Model turns; ``truncated`` when the token budget ended the episode.
    """

    instance: Any
    prompt: list[dict[str, Any]] = field(default_factory=list)
    completion: list[dict[str, Any]] = field(default_factory=list)
    trajectory: dict[str, Any] | None = None
    terms: dict[str, float | None] = field(default_factory=dict)
    tool_calls: int = 0
    tool_failures: int = 0
    turns: int = 0
    truncated: bool = False


class EnvironmentClassEnv(BaseEnv):
    """A TRL-style environment class (``environment_factory``) as a multi-turn tool env.

    Bind the class in code with :meth:`wrap`, or name it with ``--env.environment_factory``.
    """

    name = "environment_class"
    env_config_cls = EnvironmentClassEnvConfig
    default_server_configs = local_server_configs(num_requests_for_eval=8, timeout=300)

    #: The environment factory bound by :meth:`wrap` (else ``config.environment_factory``).
    environment_factory: ClassVar[Callable[[], Any] | None] = None
    #: TRL-style reward functions (``f(prompts, completions, **kwargs) -> list[float | None]``).
    reward_funcs: ClassVar[Sequence[Callable[..., Any]]] = ()
    #: Their weights (default 1 each); ``get_reward`` has weight 1.
    reward_weights: ClassVar[Sequence[float] | None] = None
    #: Rows bound in code (a list of dicts or a path), used when ``--env.dataset`` is unset.
    rows: ClassVar[Sequence[dict[str, Any]] | str | None] = None
    #: Eval rows bound in code.
    eval_rows: ClassVar[Sequence[dict[str, Any]] | str | None] = None

    @classmethod
    def wrap(
        cls,
        factory: Callable[[], Any],
        *,
        rows: Sequence[dict[str, Any]] | str | None = None,
        eval_rows: Sequence[dict[str, Any]] | str | None = None,
        reward_funcs: Sequence[Callable[..., Any]] = (),
        reward_weights: Sequence[float] | None = None,
        name: str | None = None,
    ) -> type[EnvironmentClassEnv]:
        """A subclass running ``factory``'s environments (call ``.cli()`` on it).

        Args:
            factory: The environment class, or a zero-argument callable returning instances.
            rows: Training rows (dicts, or a path as for ``--env.dataset``).
            eval_rows: Evaluation rows (as ``--env.eval_dataset``).
            reward_funcs: TRL-style reward functions added to ``get_reward``.
            reward_weights: Their weights (default 1 each).
            name: The env's name (default: the factory's name).
        """
        if reward_weights is not None and len(reward_weights) != len(reward_funcs):
            raise ValueError(
                f"reward_weights: {len(reward_weights)} weights for {len(reward_funcs)} reward_funcs"
            )
        label = name or getattr(factory, "__name__", "environment")
        attrs = {
            "name": label,
            "environment_factory": staticmethod(factory),
            "reward_funcs": tuple(reward_funcs),
            "reward_weights": tuple(reward_weights) if reward_weights is not None else None,
            "rows": rows,
            "eval_rows": eval_rows,
            "__module__": getattr(factory, "__module__", cls.__module__),
        }
        return type(f"{label}Env", (cls,), attrs)

    # ------------------------------------------------------------------ setup

    def _factory(self) -> Callable[[], Any]:
        bound = type(self).__dict__.get("environment_factory") or type(self).environment_factory
        if bound is not None:
            return bound
        if not self.config.environment_factory:
            raise ValueError(
                "--env.environment_factory: name the environment class ('package.module:Class' "
                "or 'file.py:Class'), or bind one with EnvironmentClassEnv.wrap(Class)"
            )
        return load_factory(self.config.environment_factory)

    def _load(
        self, source: Sequence[dict[str, Any]] | str | None, flag: str
    ) -> list[dict[str, Any]]:
        if source is None:
            return []
        if isinstance(source, (str, Path)):
            return load_rows(source, flag=flag)
        return [dict(row) for row in source]

    async def setup(self) -> None:
        cfg = self.config
        self.factory = self._factory()
        first = self.factory()
        check_environment(first)
        self._pool: list[Any] = [first]
        self.env_class_name = type(first).__name__
        self.has_reward = callable(getattr(first, "get_reward", None))
        if not self.has_reward and not self.reward_funcs:
            raise EnvironmentContractError(
                f"{self.env_class_name}: no reward source: define get_reward() on the class or "
                "pass reward_funcs to EnvironmentClassEnv.wrap"
            )
        weights = self.reward_weights or [1.0] * len(self.reward_funcs)
        self.terms: list[tuple[str, float, Callable[..., Any] | None]] = []
        if self.has_reward:
            self.terms.append((self.env_class_name, 1.0, None))
        for func, weight in zip(self.reward_funcs, weights, strict=True):
            self.terms.append((getattr(func, "__name__", "reward"), float(weight), func))
        train = self._load(cfg.dataset if cfg.dataset else self.rows, "--env.dataset")
        evals = self._load(
            cfg.eval_dataset if cfg.eval_dataset else self.eval_rows, "--env.eval_dataset"
        )
        if not evals and cfg.eval_items and len(train) > 1:
            held = min(cfg.eval_items, len(train) // 5 or 1)
            train, evals = train[:-held], train[-held:]
        for i, row in enumerate(train + evals):
            _prompt_of(row)  # a bad prompt fails now, naming the row
            if not isinstance(row, dict):
                raise ValueError(f"--env.dataset: row {i} is not a JSON object")
        self.train_rows = train
        # no eval rows and nothing to hold out: evaluate on the training rows (or, with no
        # rows at all, on episodes the environment starts by itself)
        self.eval_rows_ = (evals or train or [{}] * cfg.eval_items)[: cfg.eval_items]
        template = getattr(self.tokenizer, "chat_template", None) or ""
        fmt = cfg.tool_format
        if fmt == "auto":
            fmt = "openai" if "tools" in template else "hermes"
        self.resolved_tool_format = fmt
        self.iter = 0

    async def get_next_item(self) -> dict[str, Any]:
        self.iter += 1
        if not self.train_rows:
            return {}
        return self.train_rows[(self.iter - 1) % len(self.train_rows)]

    # ------------------------------------------------------------------ one episode

    async def _call(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Call an environment method: awaited when async, else in a worker thread (or inline
        with ``tools_in_threads=False``)."""
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        if self.config.tools_in_threads:
            result = await asyncio.to_thread(fn, *args, **kwargs)
        else:
            result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    def _acquire(self) -> Any:
        return self._pool.pop() if self._pool else self.factory()

    def _messages(self, row: dict[str, Any], observation: Any, registry: ToolRegistry) -> list:
        messages = _prompt_of(row)
        if observation is not None:
            if not isinstance(observation, str):
                raise EnvironmentContractError(
                    f"{self.env_class_name}.reset: returned {type(observation).__name__}; "
                    "expected a string (appended to the prompt) or None"
                )
            last = messages[-1]
            messages[-1] = {**last, "content": f"{last.get('content') or ''}{observation}"}
        system = self.config.system_prompt
        if messages[0]["role"] != "system" and (system or self.resolved_tool_format == "hermes"):
            messages.insert(0, {"role": "system", "content": system or ""})
        if self.resolved_tool_format == "hermes" and registry.tools:
            messages[0] = {
                **messages[0],
                "content": registry.hermes_system_prompt(messages[0].get("content") or ""),
            }
        return messages

    async def _run_call(self, registry: ToolRegistry, call: ParsedCall) -> tuple[bool, str]:
        """Run one tool call as TRL does: ``(ok, content)``; content is ``str(result)``, or
        ``{"error": ...}`` for a malformed call or a tool that raised."""
        problem = registry.validate(call)
        if problem is not None:
            return False, json.dumps({"error": problem})
        try:
            result = await self._call(registry.tools[call.name].fn, **call.arguments)
        except Exception as exc:  # a tool's failure is the model's to see, not the env's
            return False, json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        return True, str(result)

    async def play(
        self, row: dict[str, Any], *, temperature: float, split: str | None = None
    ) -> Episode:
        """One episode of ``row`` on a pooled instance (``reset``, turns with tool calls,
        ``get_reward``). The caller returns ``episode.instance`` to the pool with
        :meth:`release` once the reward functions have read it; an instance whose ``reset``
        or ``get_reward`` raised is dropped (the error says which method and row)."""
        cfg = self.config
        episode = Episode(self._acquire())
        instance = episode.instance
        try:
            observation = await self._call(instance.reset, **row)
        except Exception as exc:
            exc.add_note(f"in {self.env_class_name}.reset(**row) for row {row!r:.200}")
            raise
        registry = _tool_registry(instance)
        openai_format = self.resolved_tool_format == "openai"
        messages = self._messages(row, observation, registry)
        episode.prompt = [dict(m) for m in messages]
        extra = {"split": split} if split else {}
        async with ChatSession(
            self,
            messages,
            max_tokens_per_turn=cfg.max_tokens_per_turn,
            max_token_length=cfg.max_token_length,
            temperature=temperature,
            tools=registry.openai_tools() if openai_format and registry.tools else None,
        ) as session:
            while session.turns < cfg.max_turns:
                choice = await session.generate(**extra)
                if choice is None:
                    break
                tool_calls = getattr(choice.message, "tool_calls", None)
                text = choice.message.content or ""
                calls = parse_openai_calls(tool_calls) if tool_calls else parse_hermes_calls(text)
                if not calls or session.turns >= cfg.max_turns:
                    break  # an answer, or no turn left to read the results in
                for i, call in enumerate(calls):
                    episode.tool_calls += 1
                    if i >= cfg.max_calls_per_turn:
                        ok, content = (
                            False,
                            json.dumps(
                                {"error": f"more than {cfg.max_calls_per_turn} calls in one turn"}
                            ),
                        )
                    else:
                        ok, content = await self._run_call(registry, call)
                    episode.tool_failures += not ok
                    if openai_format and tool_calls:
                        session.add("tool", content, tool_call_id=call.id, name=call.name)
                    else:
                        session.add("tool", f"<tool_response>\n{content}\n</tool_response>")
            episode.trajectory = session.trajectory()
            episode.turns = session.turns
            episode.truncated = session.truncated
            episode.completion = [dict(m) for m in session.messages[len(messages) :]]
        if self.has_reward:
            try:
                reward = await self._call(instance.get_reward)
            except Exception as exc:
                exc.add_note(f"in {self.env_class_name}.get_reward() after row {row!r:.200}")
                raise
            episode.terms[self.env_class_name] = None if reward is None else float(reward)
        return episode

    def release(self, episode: Episode) -> None:
        """Return ``episode``'s instance to the pool (``reset`` starts its next episode)."""
        self._pool.append(episode.instance)

    async def play_group(
        self, row: dict[str, Any], n: int, *, temperature: float, split: str | None = None
    ) -> tuple[list[Episode], list[float | None]]:
        """``n`` episodes of ``row`` and their rewards (see :meth:`score`); every instance is
        back in the pool afterwards, and the first failure is raised once all have ended."""
        results = await asyncio.gather(
            *(self.play(row, temperature=temperature, split=split) for _ in range(n)),
            return_exceptions=True,
        )
        episodes = [r for r in results if isinstance(r, Episode)]
        try:
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                raise failures[0]
            return episodes, await self.score(row, episodes)
        finally:
            for episode in episodes:
                self.release(episode)

    async def score(self, row: dict[str, Any], episodes: list[Episode]) -> list[float | None]:
        """Each episode's reward: the weighted sum of the terms that scored it (None when
        none did). Runs the reward functions over the group, TRL-style: called with
        ``prompts``, ``completions`` (the messages after the prompt), ``completion_ids``
        (tokens after the prompt), ``environments``, ``trainer_state=None`` and the row's
        other columns, one entry per episode."""
        columns = {k: [v] * len(episodes) for k, v in row.items() if k != "prompt"}
        for name, _, func in self.terms:
            if func is None:
                continue
            kwargs = dict(
                prompts=[e.prompt for e in episodes],
                completions=[e.completion for e in episodes],
                completion_ids=[_completion_ids(e.trajectory) for e in episodes],
                environments=[e.instance for e in episodes],
                trainer_state=None,
                **columns,
            )
            values = func(**kwargs)
            if inspect.isawaitable(values):
                values = await values
            values = list(values)
            if len(values) != len(episodes):
                raise ValueError(
                    f"reward function {name}: returned {len(values)} rewards for {len(episodes)} "
                    "completions"
                )
            for episode, value in zip(episodes, values, strict=True):
                episode.terms[name] = None if value is None else float(value)
        weights = {name: weight for name, weight, _ in self.terms}
        return [weighted_reward(e.terms, weights) for e in episodes]

    def _log(self, prefix: str, episodes: list[Episode]) -> None:
        log_reward_terms(self, prefix, [e.terms for e in episodes])
        self.log_train_metric(f"{prefix}/tool_calls", [float(e.tool_calls) for e in episodes])
        self.log_train_metric(f"{prefix}/tool_failures", [float(e.tool_failures) for e in episodes])
        self.log_train_metric(f"{prefix}/turns", [float(e.turns) for e in episodes])

    async def collect_trajectories(
        self, item: dict[str, Any]
    ) -> tuple[ScoredDataGroup | None, list]:
        episodes, totals = await self.play_group(
            item, self.config.group_size, temperature=self.config.temperature
        )
        self._log("train", episodes)
        group = group_from_trajectories(
            [e.trajectory for e in episodes], totals, group_size=self.config.group_size
        )
        return group, []

    # ------------------------------------------------------------------ evaluation

    async def _eval_row(self, row: dict[str, Any]) -> dict[str, Any]:
        (episode,), (total,) = await self.play_group(row, 1, temperature=0.0, split="eval")
        return {
            "messages": episode.trajectory["messages"] if episode.trajectory else None,
            "score": 0.0 if total is None else total,
            "scored": total is not None,
            "terms": {k: v for k, v in episode.terms.items() if v is not None},
            "tool_calls": episode.tool_calls,
            "tool_failures": episode.tool_failures,
            "turns": episode.turns,
        }

    def summarize_eval(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """Mean reward, each term's mean, tool use and turns over the eval episodes."""
        n = max(1, len(samples))
        out = {
            "eval/mean_reward": sum(s["score"] for s in samples) / n,
            "eval/scored_rate": sum(s["scored"] for s in samples) / n,
            "eval/tool_calls": sum(s["tool_calls"] for s in samples) / n,
            "eval/tool_failures": sum(s["tool_failures"] for s in samples) / n,
            "eval/turns": sum(s["turns"] for s in samples) / n,
        }
        for name, values in reward_term_values([s["terms"] for s in samples]).items():
            out[f"eval/{name}"] = sum(values) / len(values)
        return out

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return await self.run_eval(
            [self._eval_row(row) for row in self.eval_rows_],
            self.summarize_eval,
            generation_parameters={
                "temperature": 0.0,
                "max_tokens": self.config.max_tokens_per_turn,
                "max_turns": self.config.max_turns,
                "tool_format": self.resolved_tool_format,
            },
        )


if __name__ == "__main__":
    EnvironmentClassEnv.cli()
