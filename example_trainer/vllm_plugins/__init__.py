"""Moved to :mod:`atroposlib.backends.vllm_plugins`; this import path keeps working."""

from atroposlib.backends.vllm_plugins import PLUGIN_DIR

__all__ = ["PLUGIN_DIR"]
