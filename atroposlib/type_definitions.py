"""Shared type definitions: chat messages, agent/game histories and evaluation output shapes.

These are ``TypedDict``s (plain dicts at runtime), so environments can build them with literals
and send them as JSON unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

from openai.types.chat import ChatCompletionContentPartParam
from typing_extensions import NotRequired, TypedDict

__all__ = [
    "UUID",
    "AgentHistory",
    "AgentStep",
    "Content",
    "EvaluationConfigGeneral",
    "EvaluationMetrics",
    "EvaluationResults",
    "EvaluationSample",
    "GameHistory",
    "GameStep",
    "Item",
    "Message",
    "Observation",
    "number",
]

#: A message body: plain text, or a list of OpenAI content parts (text, image_url, ...).
Content = str | list[ChatCompletionContentPartParam]
#: Whatever an environment's ``get_next_item`` returns; the runtime never looks inside.
Item = Any
#: A real number as JSON carries it.
number = int | float
#: Identifier of a running item (a ``uuid4`` string).
UUID = str


class Message(TypedDict):
    """One chat message.

    Attributes:
        role: ``system``, ``user``, ``assistant`` or ``tool``.
        content: Text, or a list of OpenAI content parts.
        reward: Optional per-message reward (may be omitted).
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: Content
    reward: NotRequired[float | None]


class AgentStep(TypedDict, total=False):
    """A single step in an agent's history.

    Attributes:
        step: The step number.
        messages: The messages exchanged during the step.
        reward: The reward received at this step.
    """

    step: int
    messages: list[Message]
    reward: float


#: Maps agent ids (for example ``"Player 1"``) to their steps.
AgentHistory = dict[str, list[AgentStep]]


class Observation(TypedDict):
    """An observation in a game history.

    Attributes:
        raw: The raw observation data.
        rendered: The observation rendered for an LLM.
    """

    raw: dict[str, Any]
    rendered: Content


class GameStep(TypedDict):
    """One step of a game: an (s, a, r) triple with metadata.

    Attributes:
        step: The step number.
        agent_id: The agent who acted.
        observation: The observation at this step.
        action: The action taken.
        reward: A reward, or a mapping of agent id to reward.
        done: Whether the game ended after this step.
        info: Extra information.
    """

    step: int
    agent_id: str
    observation: Observation
    action: str
    reward: float | dict[str, float]
    done: bool
    info: dict[str, Any]


#: A game history is a list of game steps.
GameHistory = list[GameStep]


class EvaluationConfigGeneral(TypedDict):
    """The ``config_general`` section of ``metrics.json``."""

    total_evaluation_time_seconds: str
    model_name: str | None
    generation_parameters: dict[str, Any]


class EvaluationResults(TypedDict):
    """The ``results`` section of ``metrics.json``: ``"atropos|{task}|0"`` and ``"all"``, each
    mapping metric names to values."""

    all: dict[str, float]


class EvaluationMetrics(TypedDict):
    """The whole ``metrics.json`` written by ``evaluate_log``."""

    config_general: EvaluationConfigGeneral
    results: EvaluationResults


class EvaluationSample(TypedDict, total=False):
    """One line of ``samples.jsonl``; every field is optional."""

    messages: list[dict[str, str]] | None
    question: str | None
    gold_answer: str | None
    gold_parsed: str | None
    model_parsed: str | None
    score: int | None
    correct: bool | None
    finish_reason: str | None
    response_after_think: str | None
