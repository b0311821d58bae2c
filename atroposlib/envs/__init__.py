"""Everything an environment author imports, from one place.

    from atroposlib.envs import BaseEnv, BaseEnvConfig, APIServerConfig, ScoredDataGroup
    from atroposlib.envs import ChatSession, group_from_samples, sample_chat_group

The names resolve lazily (on first use), so importing a submodule such as
``atroposlib.envs.server_handling.openai_server`` does not load the whole env runtime. The
upstream module paths (``atroposlib.envs.base`` and friends) keep working.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # the env class, its config and what it sends
    "BaseEnv": "atroposlib.envs.base",
    "BaseEnvConfig": "atroposlib.envs.base",
    "EvalHandlingEnum": "atroposlib.envs.base",
    "LocalEnvConfig": "atroposlib.envs.config",
    "ScoredDataGroup": "atroposlib.envs.base",
    "ScoredDataItem": "atroposlib.envs.base",
    "Item": "atroposlib.type_definitions",
    # inference servers
    "APIServer": "atroposlib.envs.base",
    "APIServerConfig": "atroposlib.envs.base",
    "ServerBaseline": "atroposlib.envs.base",
    "ServerManager": "atroposlib.envs.base",
    "ServerManagerConfig": "atroposlib.envs.base",
    "local_server_configs": "atroposlib.envs.server_handling.server_baseline",
    # building groups from rollouts (single- and multi-turn)
    "ChatSession": "atroposlib.envs.rollout",
    "Sample": "atroposlib.envs.rollout",
    "apply_length_penalty": "atroposlib.envs.rollout",
    "log_reward_terms": "atroposlib.envs.rollout",
    "weighted_reward": "atroposlib.envs.rollout",
    "eval_completion": "atroposlib.envs.rollout",
    "group_from_samples": "atroposlib.envs.rollout",
    "group_from_trajectories": "atroposlib.envs.rollout",
    "sample_chat_group": "atroposlib.envs.rollout",
    # TRL-style environment classes (environment_factory) as envs
    "EnvironmentClassEnv": "atroposlib.envs.environment_class",
    "EnvironmentClassEnvConfig": "atroposlib.envs.environment_class",
    # OpenEnv environments (extra ``openenv``)
    "OpenEnvEnv": "atroposlib.envs.openenv_env",
    "OpenEnvEnvConfig": "atroposlib.envs.openenv_env",
    # verifiers 0.4 environments (extra ``verifiers``)
    "VerifiersEnv": "atroposlib.envs.verifiers_env",
    "VerifiersEnvConfig": "atroposlib.envs.verifiers_env",
    # a ready-made env family
    "MathVerifyEnv": "atroposlib.envs.math_verify_env",
    "MathVerifyEnvConfig": "atroposlib.envs.math_verify_env",
}

__all__ = [
    "APIServer",
    "APIServerConfig",
    "BaseEnv",
    "BaseEnvConfig",
    "ChatSession",
    "EnvironmentClassEnv",
    "EnvironmentClassEnvConfig",
    "EvalHandlingEnum",
    "Item",
    "LocalEnvConfig",
    "MathVerifyEnv",
    "MathVerifyEnvConfig",
    "OpenEnvEnv",
    "OpenEnvEnvConfig",
    "Sample",
    "ScoredDataGroup",
    "ScoredDataItem",
    "ServerBaseline",
    "ServerManager",
    "ServerManagerConfig",
    "VerifiersEnv",
    "VerifiersEnvConfig",
    "apply_length_penalty",
    "eval_completion",
    "group_from_samples",
    "group_from_trajectories",
    "local_server_configs",
    "log_reward_terms",
    "sample_chat_group",
    "weighted_reward",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'atroposlib.envs' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from atroposlib.envs.base import (
        APIServer,
        APIServerConfig,
        BaseEnv,
        BaseEnvConfig,
        EvalHandlingEnum,
        ScoredDataGroup,
        ScoredDataItem,
        ServerBaseline,
        ServerManager,
        ServerManagerConfig,
    )
    from atroposlib.envs.config import LocalEnvConfig
    from atroposlib.envs.environment_class import EnvironmentClassEnv, EnvironmentClassEnvConfig
    from atroposlib.envs.math_verify_env import MathVerifyEnv, MathVerifyEnvConfig
    from atroposlib.envs.openenv_env import OpenEnvEnv, OpenEnvEnvConfig
    from atroposlib.envs.rollout import (
        ChatSession,
        Sample,
        apply_length_penalty,
        eval_completion,
        group_from_samples,
        group_from_trajectories,
        log_reward_terms,
        sample_chat_group,
        weighted_reward,
    )
    from atroposlib.envs.server_handling.server_baseline import local_server_configs
    from atroposlib.envs.verifiers_env import VerifiersEnv, VerifiersEnvConfig
    from atroposlib.type_definitions import Item
