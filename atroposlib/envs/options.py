"""Construction options the env CLI hands to an environment it builds.

They travel in context variables, not ``__init__`` arguments, so that subclasses written for
upstream's ``__init__(config, server_configs, slurm, testing)`` keep working unchanged. The CLI
(:mod:`atroposlib.envs.cli`) sets them around the constructor call; ``BaseEnv.__init__`` and
``TeacherDistillationEnv.__init__`` read them. This module imports nothing of the package, so
neither side imports the other.
"""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["ENV_INIT_EXTRAS", "SERVER_MANAGER_OPTIONS"]

#: ``ServerManager`` options for the env being built (``max_n_completions``, ``proxy_url``).
SERVER_MANAGER_OPTIONS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "atropos_server_manager_options", default=None
)

#: Keyword arguments the env class's own ``__init__`` does not take by name (e.g. a
#: ``TeacherDistillationEnv`` mixin's ``teacher_server_configs`` behind a subclass with
#: upstream's four-argument ``__init__``); the mixin picks them up from here.
ENV_INIT_EXTRAS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "atropos_env_init_extras", default=None
)
