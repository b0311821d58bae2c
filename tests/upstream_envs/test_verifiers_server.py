"""Upstream's ``environments/verifiers_server.py`` (byte-identical) runs with the verifiers it
pins (0.1.9.post2), in that version's own virtualenv with this checkout's atroposlib: ``process``
loads a verifiers environment package by name, plays one group through ``ManagedServer``
against a real ``atropos-serve`` (the scripted model) and writes it with the rubric's rewards.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import start_server
from tests.upstream_envs.scripted_model import build_scripted_model
from tests.upstream_envs.test_upstream_envs import UPSTREAM_COMMIT

HERE = Path(__file__).resolve().parent / "verifiers_env"
VF_PY = Path(os.environ.get("ATROPOS_VERIFIERS_PYTHON", "/tmp/verifiers-0.1.9-venv/bin/python"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VF_PY.exists(),
        reason=f"the verifiers 0.1.9.post2 virtualenv is not at {VF_PY} (see .ci/run)",
    ),
]
RIGHT = "Sorted: apple fig pear"
WRONG = "I would rather not sort these words today, thank you very much."


def test_the_vendored_file_is_upstreams() -> None:
    mirror = Path("/work/.mirror/NousResearch+atropos/repo")
    if not mirror.exists():
        return
    upstream = subprocess.run(
        ["git", "-C", str(mirror), "show", f"{UPSTREAM_COMMIT}:environments/verifiers_server.py"],
        capture_output=True,
        check=True,
    ).stdout
    ours = (HERE / "verifiers_server.py").read_bytes()
    assert hashlib.sha256(upstream).digest() == hashlib.sha256(ours).digest()


def test_the_pinned_verifiers_is_installed() -> None:
    out = subprocess.run(
        [str(VF_PY), "-c", "import verifiers, atroposlib; print(verifiers.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == "0.1.9.post2", out.stderr[-2000:]


def test_process_writes_a_group_scored_by_the_rubric(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    model = build_scripted_model(tmp_path / "model", [RIGHT, WRONG])
    with pytest.MonkeyPatch.context() as patch:  # the server loads the scripted model type
        patch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent / "standins"))
        patch.setenv("ATROPOS_SCRIPTED_MODEL", "1")
        serve = start_server(
            tmp_path_factory, model, "--dtype", "float32", "--served-model-name", "tiny"
        )
    try:
        out = tmp_path / "groups.jsonl"
        env = {
            **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            "PYTHONPATH": str(HERE / "packages"),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"),
            "WANDB_MODE": "disabled",
        }
        proc = subprocess.run(
            [
                str(VF_PY),
                str(HERE / "verifiers_server.py"),
                "process",
                "--env.vf_env_name",
                "local/vf-word-sort",
                "--env.total_steps",
                "1",
                "--env.group_size",
                "4",
                "--env.max_token_length",
                "64",
                "--env.tokenizer_name",
                str(model),
                "--env.data_path_to_save_groups",
                str(out),
                "--env.use_wandb",
                "false",
                "--openai.base_url",
                serve.url + "/v1",
                "--openai.model_name",
                "tiny",
                "--openai.server_type",
                "vllm",
                "--openai.api_key",
                "x",
                "--openai.tokenizer_name",
                str(model),
            ],  # fmt: skip
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=600,
        )
    finally:
        serve.stop()
    log = proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, log
    assert f"Wrote 1 groups to {out}" in proc.stdout, log
    (group,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(group["tokens"]) == len(group["masks"]) == len(group["scores"]) == 4
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    for tokens, masks, logprobs, score, messages in zip(
        group["tokens"],
        group["masks"],
        group["inference_logprobs"],
        group["scores"],
        group["messages"],
        strict=True,
    ):
        trained = tokenizer.decode([t for t, m in zip(tokens, masks, strict=True) if m != -100])
        reply = messages[-1]["content"]
        assert messages[0] == {"role": "system", "content": "Sort the user's words alphabetically."}
        assert reply in (RIGHT, WRONG)
        assert trained.startswith(reply)  # the reply (and its end-of-turn token) is trained
        assert masks[0] == -100 and len(logprobs) == len(tokens)
        assert score == (1.0 if reply == RIGHT else 0.0)  # each reward is its own reply's
        assert tokenizer.decode(tokens).count(reply) == 1  # and the tokens are that reply's
