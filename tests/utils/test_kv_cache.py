"""The key/value cache argument under transformers' old and new names, without warnings."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from atroposlib.utils.kv_cache import cache_kwarg, cache_kwargs, output_cache


class _Old(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, use_cache=None):
        return {"past_key_values": past_key_values}


class _New(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None):
        return {"cache": cache}


def test_the_name_the_model_takes() -> None:
    assert cache_kwarg(_Old()) == "past_key_values"
    assert cache_kwarg(_New()) == "cache"
    assert cache_kwargs(_New(), "c") == {"cache": "c"}
    assert output_cache(_Old()(**cache_kwargs(_Old(), "c"))) == "c"
    assert output_cache(_New()(**cache_kwargs(_New(), "c"))) == "c"


def test_real_model_runs_without_deprecation_warnings(
    tiny_model_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            first = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
            cache = output_cache(first)
            second = model(input_ids=torch.tensor([[4]]), **cache_kwargs(model, cache))
    assert output_cache(second).get_seq_length() == 4
    assert "deprecated" not in capfd.readouterr().err  # transformers' own logger
