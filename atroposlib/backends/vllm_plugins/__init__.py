"""Modules that run inside vLLM's own process (and virtualenv), not the trainer's.

Each module here imports only the standard library, so vLLM can import it from its own
virtualenv, which need not have atroposlib installed: whoever launches vLLM (the trainer,
``atropos-launch``, or you) puts this folder on vLLM's ``PYTHONPATH`` and names the module by
its top-level name, e.g. ``--middleware atropos_policy_version.PolicyVersionMiddleware``
(:func:`atroposlib.backends.plugin_env` builds that ``PYTHONPATH``).
"""

from pathlib import Path

PLUGIN_DIR = Path(__file__).resolve().parent
"""The folder to put on vLLM's ``PYTHONPATH``."""
