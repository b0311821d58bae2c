"""Fixtures: tiny real models on disk and ``atropos-serve`` running them as child processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
pytest.importorskip("transformers")

from tests.conftest import ServeProcess, start_server  # noqa: E402

SERVED_NAME = "tiny"


def _packed_dtypes() -> list:
    from atroposlib.inference.fastpath.packed_linear import packing_supported

    bf16_missing = not packing_supported(torch.bfloat16)
    reason = "no bf16 oneDNN kernels on this CPU"
    return [
        torch.float32,
        pytest.param(torch.bfloat16, marks=pytest.mark.skipif(bf16_missing, reason=reason)),
    ]


#: The dtypes with prepacked kernels, for parametrising tests (bf16 skipped where missing).
PACKED_DTYPES = _packed_dtypes()


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


def reference_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """Log-probs of ``output_ids`` after ``prompt_ids`` from one plain forward pass."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    start = len(prompt_ids) - 1
    return [logprobs[start + i, t].item() for i, t in enumerate(output_ids)]
