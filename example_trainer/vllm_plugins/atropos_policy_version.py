"""Moved to :mod:`atroposlib.backends.vllm_plugins.atropos_policy_version` (the module vLLM
imports from ``PLUGIN_DIR``); this import path keeps working."""

from atroposlib.backends.vllm_plugins.atropos_policy_version import (  # noqa: F401
    ENV,
    PATH,
    PolicyVersionMiddleware,
    engine_version,
    launch_version,
)
