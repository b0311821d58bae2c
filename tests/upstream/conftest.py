"""Run upstream Atropos's own test suite (vendored unchanged) against this package.

Upstream's tests import ``atroposlib.tests.*`` and ``environments.eval_environments.*``; those
live here (``tests/upstream``) and in ``tests/upstream_envs``, so they are registered under the
upstream module names before the test modules are imported.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import types
from pathlib import Path

import pytest

from tests.conftest import _upstream_port_8000_file

HERE = Path(__file__).resolve().parent
UPSTREAM_ENVS = HERE.parent / "upstream_envs" / "environments"


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _alias_upstream_modules() -> None:
    """``atroposlib.tests`` and ``environments.eval_environments.eval_helpers`` as upstream has them."""
    import atroposlib

    if "atroposlib.tests" not in sys.modules:
        package = types.ModuleType("atroposlib.tests")
        package.__path__ = [str(HERE)]
        sys.modules["atroposlib.tests"] = package
        atroposlib.tests = package  # type: ignore[attr-defined]
        package.api_test_utils = _load(  # type: ignore[attr-defined]
            "atroposlib.tests.api_test_utils", HERE / "api_test_utils.py"
        )
    if "environments.eval_environments" not in sys.modules:
        package = types.ModuleType("environments.eval_environments")
        package.__path__ = [str(UPSTREAM_ENVS / "eval_environments")]
        sys.modules["environments.eval_environments"] = package
        package.eval_helpers = _load(  # type: ignore[attr-defined]
            "environments.eval_environments.eval_helpers",
            UPSTREAM_ENVS / "eval_environments" / "eval_helpers.py",
        )


_alias_upstream_modules()


def pytest_configure(config) -> None:
    """Upstream's markers."""
    config.addinivalue_line("markers", "providers: needs provider API keys (upstream marker)")
    config.addinivalue_line("markers", "gpu: needs a GPU (upstream marker)")


# Tests that cannot run here, by node id prefix: they are deselected (not skipped; a skip fails
# CI), and listed in docs/compat.md.
NOT_RUN = {
    "tests/upstream/test_managed_server_proxy_integration.py": (
        "needs a GPU and the Qwen/Qwen3-4B-Thinking-2507 weights from the hub (upstream marks "
        "it gpu)"
    ),
    "tests/upstream/test_openai_api_workarounds.py": (
        "calls the paid OpenAI and OpenRouter APIs (upstream marks it providers)"
    ),
    "tests/upstream/test_reasoning_models.py::test_server_manager_injects_extra_body": (
        "calls the paid OpenRouter API"
    ),
    "tests/upstream/test_vllm_api_server_generate.py": (
        "imports vLLM and patches the engine of upstream's vLLM-based server; here "
        "example_trainer.vllm_api_server launches vLLM's own server or atropos-serve"
    ),
    "tests/upstream/test_utils/test_tokenize_for_trainer.py::"
    "test_tokenize_for_trainer_mask_len_last_turn_only": (
        "downloads the gated meta-llama/Llama-3.2-1B-Instruct tokenizer, and assumes "
        "transformers 4 (apply_chat_template returns a BatchEncoding in transformers 5)"
    ),
}

# Deliberate differences (fixed upstream bugs): expected to fail, strictly.
DIFFERENT = {
    "tests/upstream/test_api_messages_handling.py::TestSFTIntegration::test_sft_batch_processing": (
        "sends advantages of 4 values for 3 tokens; run-api refuses that group with 422 "
        "(advantages must be per token or a single value; docs/compat.md)"
    ),
    "tests/upstream/test_api_messages_handling.py::TestWeirdMessageFormats::"
    "test_messages_with_numeric_strings_as_content": (
        "sends advantages of 4 values for 3 tokens; run-api refuses that group with 422 "
        "(advantages must be per token or a single value; docs/compat.md)"
    ),
}


def _drop_vllm_skips(items: list) -> None:
    """Upstream skips its tool-call tests without vLLM; here the built-in hermes parser
    serves them, so they run."""
    for item in items:
        for node in item.listchain():
            node.own_markers[:] = [
                m
                for m in node.own_markers
                if not (m.name == "skipif" and m.kwargs.get("reason") == "vLLM not installed")
            ]


def _rel(nodeid: str) -> str:
    """Node id relative to the repository root, whatever directory pytest runs from."""
    marker = "tests/upstream/"
    return nodeid[nodeid.index(marker) :] if marker in nodeid else nodeid


def pytest_collection_modifyitems(config, items) -> None:
    """Deselect what cannot run here, mark deliberate differences xfail(strict=True)."""
    _drop_vllm_skips(items)
    keep, dropped = [], []
    for item in items:
        nodeid = _rel(item.nodeid)
        if not nodeid.startswith("tests/upstream/"):
            keep.append(item)
            continue
        if any(nodeid.startswith(prefix) for prefix in NOT_RUN):
            dropped.append(item)
            continue
        if nodeid in DIFFERENT:
            item.add_marker(pytest.mark.xfail(strict=True, reason=DIFFERENT[nodeid]))
        keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


_port_8000: dict[str, bool] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Upstream's API tests start ``run-api`` on port 8000 and reuse whatever answers there;
    refuse to run them against somebody else's server. Checked once per worker, before the
    first of those files sets up its fixtures (they all run on one worker: ``tests/conftest.py``)."""
    if not _upstream_port_8000_file(item.nodeid):
        return
    if "taken" not in _port_8000:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            _port_8000["taken"] = sock.connect_ex(("127.0.0.1", 8000)) == 0
    if _port_8000["taken"]:
        pytest.fail(
            "port 8000 was already in use before upstream's API tests started: they hardcode "
            "http://localhost:8000 and would reset the server listening there"
        )
