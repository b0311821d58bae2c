"""Modules that run inside vLLM's own process (and virtualenv), not the trainer's.

Each module here imports only the standard library (and, where needed, torch and vllm), so
vLLM can import it from its own virtualenv: the trainer puts this folder on the vLLM child's
``PYTHONPATH`` and names the module by its top-level name, e.g.
``--middleware atropos_policy_version.PolicyVersionMiddleware``.
"""

from pathlib import Path

PLUGIN_DIR = Path(__file__).resolve().parent
"""The folder to put on vLLM's ``PYTHONPATH``."""
