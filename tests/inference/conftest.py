"""Fixtures: tiny real models on disk and ``atropos-serve`` running them as child processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
pytest.importorskip("transformers")

from tests.conftest import ServeProcess, start_server  # noqa: E402

SERVED_NAME = "tiny"


#: The dtypes with prepacked kernels, for parametrising tests. Not every CPU has oneDNN's bf16
#: kernels (AVX-512 or AMX); where one lacks them, the bf16 cases check the documented fallback
#: instead (nothing packed, the stock path's results), so every case runs on every machine.
PACKED_DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir: Path):
    """The tiny model loaded in-process, to check the server's log-probs against."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[ServeProcess]:
    """``atropos-serve`` with the tiny model in float32, served as ``tiny``."""
    server = start_server(
        tmp_path_factory,
        tiny_model_dir,
        "--dtype",
        "float32",
        "--served-model-name",
        SERVED_NAME,
        "tiny-alias",
        "--max-concurrency",
        "48",
    )
    try:
        yield server
    finally:
        server.stop()


def own_tiny_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[ServeProcess]:
    """Body of a module's own float32 tiny server, served as ``tiny``, for tests that change
    its state (weights, pause): ``yield from own_tiny_server(...)`` in a module fixture."""
    server = start_server(
        tmp_path_factory, tiny_model_dir, "--dtype", "float32", "--served-model-name", SERVED_NAME
    )
    try:
        yield server
    finally:
        server.stop()


def reference_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """Log-probs of ``output_ids`` after ``prompt_ids`` from one plain forward pass."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    start = len(prompt_ids) - 1
    return [logprobs[start + i, t].item() for i, t in enumerate(output_ids)]
