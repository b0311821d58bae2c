"""Importance ratios with truncated sampling: the sampler's and the trainer's log-probs agree.

atropos-serve samples with temperature, top-p and top-k for real; the example trainer computes
its log-probs of the same tokens exactly as in training (``prepare_batch`` then
``policy_logprobs`` on the same weights). With no weight change the GRPO ratio
``exp(logp_train - logp_sampler)`` must average 1 over a few thousand tokens; the wrong kind of
log-probs (raw ones from the server, or processed ones against a trainer that does not replay
the truncation) must not.

Tolerance: ``|mean - 1| <= 4 * SEM + 1e-3``. With the right kind the ratio of every token is 1
in exact arithmetic (same weights, same distribution on both sides), so all that is left is
rounding: float32 on both sides, different kernels (the server's KV-cached decode against the
trainer's full forward), about 1e-5 per token; 1e-3 bounds that with room for a bf16-like
difference, and 4 standard errors of the mean (a false failure below 1e-4 for a normal mean)
cover a real model's per-token noise. Measured: mean 1.000000, every token within 5e-6 of 1
(3072 tokens). The wrong kinds are off by far more: processed log-probs against a trainer that
takes a full-vocabulary log-softmax give E[S], the mean kept mass (0.276 here at top_p 0.8 and
top_k 20, the tiny random model being nearly uniform; TRL measured 0.896 on Qwen2.5-1.5B,
trl#7269), and raw log-probs compare a different distribution altogether.
"""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest

from tests.inference.conftest import SERVED_NAME, start_server

torch = pytest.importorskip("torch")

from example_trainer.data import prepare_batch  # noqa: E402
from example_trainer.forward import check_fast_path, policy_logprobs  # noqa: E402

PROMPTS = [[504, 3458, 282, 4649, 314], [1, 9138, 28, 4, 77, 906], [2437, 11]]
SAMPLES = 16
MAX_TOKENS = 64
TEMPERATURE = 0.8
SETTINGS = [
    pytest.param({"top_p": 0.8, "top_k": 20}, id="top_p=0.8+top_k=20"),
    # each alone (top_p alone sorts the whole vocabulary at every step on both sides: slow;
    # nightly, as the combined setting above already exercises both cuts per commit)
    pytest.param({"top_p": 0.8}, id="top_p=0.8", marks=[pytest.mark.slow, pytest.mark.nightly]),
    pytest.param({"top_k": 20}, id="top_k=20", marks=[pytest.mark.slow, pytest.mark.nightly]),
]


def _serve(tmp_path_factory, model: Path, mode: str):
    server = start_server(
        tmp_path_factory, model, "--dtype", "float32", "--served-model-name", SERVED_NAME,
        "--logprobs-mode", mode,
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def processed_server(tmp_path_factory, tiny_model_dir: Path):
    """atropos-serve as it starts by default (``--logprobs-mode processed_logprobs``)."""
    yield from _serve(tmp_path_factory, tiny_model_dir, "processed_logprobs")


@pytest.fixture(scope="module")
def raw_server(tmp_path_factory, tiny_model_dir: Path):
    """atropos-serve with vLLM's default kind, ``raw_logprobs``."""
    yield from _serve(tmp_path_factory, tiny_model_dir, "raw_logprobs")


@pytest.fixture(scope="module")
def trainer_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, check_fast_path(model, "cpu")


def sample_groups(url: str, truncation: dict) -> list[dict]:
    """One group per prompt, as an environment sends it: the sampled tokens with the server's
    log-probs, and how they were sampled in ``generation_params``."""
    reply = httpx.post(
        url + "/v1/completions",
        json={
            "model": SERVED_NAME,
            "prompt": PROMPTS,
            "n": SAMPLES,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "temperature": TEMPERATURE,
            "logprobs": 0,
            "return_token_ids": True,
            "seed": 1234,
            **truncation,
        },
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    groups = []
    for p, prompt in enumerate(PROMPTS):
        mine = choices[p * SAMPLES : (p + 1) * SAMPLES]
        group = {
            "tokens": [prompt + c["token_ids"] for c in mine],
            "masks": [[-100] * len(prompt) + c["token_ids"] for c in mine],
            "scores": [float(i % 2) for i in range(SAMPLES)],
            "inference_logprobs": [
                [1.0] * len(prompt) + c["logprobs"]["token_logprobs"] for c in mine
            ],
            "generation_params": {"temperature": TEMPERATURE, **truncation},
        }
        groups.append(group)
    return groups


def ratios(model_and_fast, groups: list[dict]) -> torch.Tensor:
    """The per-token ratios ``exp(logp_train - logp_sampler)`` the example trainer's loss
    would form on the first micro-step of these groups (no weight change)."""
    model, fast = model_and_fast
    batch = prepare_batch(groups, micro_batch_size=4)
    out = []
    with torch.no_grad():
        for mb in batch.micro_batches:
            logp = policy_logprobs(model, mb, "cpu", fast=fast)
            trained = mb.mask > 0
            out.append(torch.exp(logp - mb.old_logprobs)[trained])
    return torch.cat(out).double()


def mean_is_one(values: torch.Tensor) -> tuple[bool, float, float]:
    """``(within tolerance, mean, standard error)`` (the tolerance: module docstring)."""
    mean = float(values.mean())
    sem = float(values.std(unbiased=True)) / math.sqrt(values.numel())
    return abs(mean - 1.0) <= 4 * sem + 1e-3, mean, sem


@pytest.mark.parametrize("truncation", SETTINGS)
def test_processed_logprobs_give_a_mean_ratio_of_one(processed_server, trainer_model, truncation):
    groups = sample_groups(processed_server.url, truncation)
    values = ratios(trainer_model, groups)
    assert values.numel() == len(PROMPTS) * SAMPLES * MAX_TOKENS  # 3072 sampled tokens
    ok, mean, sem = mean_is_one(values)
    assert ok, f"mean ratio {mean:.5f} +- {sem:.5f} with the right log-probs"
    # every token, not only the mean: both sides compute the same distribution
    assert float((values - 1).abs().max()) < 1e-3

    # the same samples, but the trainer is not told the truncation (a full-vocabulary
    # log-softmax, as TRL computes it): every ratio is the kept mass S < 1
    for group in groups:
        group["generation_params"] = {"temperature": TEMPERATURE}
    full = ratios(trainer_model, groups)
    ok, mean, sem = mean_is_one(full)
    assert not ok and mean < 0.9 and float(full.max()) <= 1 + 1e-3, (
        f"full vocabulary: {mean:.4f} +- {sem:.4f}"
    )


@pytest.mark.slow
@pytest.mark.nightly  # the per-commit test already fails the wrong kind (a full-vocabulary trainer)
def test_raw_logprobs_fail_the_same_check(raw_server, trainer_model):
    """vLLM's default kind: the model's own distribution, untempered and untruncated (slow: a
    second server; the fast test's full-vocabulary trainer is the other wrong kind)."""
    truncation = {"top_p": 0.8, "top_k": 20}
    raw = ratios(trainer_model, sample_groups(raw_server.url, truncation))
    ok, mean, sem = mean_is_one(raw)
    assert not ok and abs(mean - 1) > 10 * sem, f"raw: {mean:.4f} +- {sem:.4f}"
