"""``process`` and ``evaluate`` end to end with the tiny model on a real atropos-serve."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.envs.helpers import ARITHMETIC_ENV, env_environ
from tests.frontend.chromium import Browser, find_chromium


def _run(tmp_path: Path, *args: str, tiny_serve, tiny_model_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(ARITHMETIC_ENV),
            *args,
            "--openai.base_url",
            f"{tiny_serve.url}/v1",
            "--openai.model_name",
            "tiny",
            "--env.tokenizer_name",
            str(tiny_model_dir),
            "--env.max_answer_tokens",
            "6",
        ],
        capture_output=True,
        text=True,
        env=env_environ(),
        cwd=tmp_path,
        timeout=300,
    )


@pytest.mark.slow
def test_process_writes_jsonl_and_html_that_renders(tmp_path: Path, tiny_serve, tiny_model_dir):
    out = tmp_path / "out" / "groups.jsonl"
    out.parent.mkdir()
    out.write_text("keep me\n")  # never overwritten: the run writes groups_1.jsonl
    proc = _run(
        tmp_path,
        "process",
        "--env.total_steps",
        "3",
        "--env.data_path_to_save_groups",
        str(out),
        "--env.use_wandb",
        "false",
        tiny_serve=tiny_serve,
        tiny_model_dir=tiny_model_dir,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_text() == "keep me\n"
    written = out.with_name("groups_1.jsonl")
    groups = [json.loads(line) for line in written.read_text().splitlines()]
    assert len(groups) == 3
    for group in groups:
        assert len(group["tokens"]) == 4
        assert group["messages"][0][1]["content"].startswith("What is")
    assert "3/3" in proc.stderr  # the progress bar
    html = written.with_suffix(".html")
    assert html.exists()
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("chromium is not installed")
    pytest.importorskip("websockets")
    browser = Browser(chromium)
    try:
        browser.navigate(html)
        assert browser.errors() == []
        assert browser.evaluate("window.atroposViewer.groupCount") == 3
        assert browser.evaluate("window.atroposViewer.itemCount") == 12
    finally:
        browser.close()


@pytest.mark.slow
def test_process_logs_to_wandb_offline(tmp_path: Path, tiny_serve, tiny_model_dir):
    proc = subprocess.run(
        [
            sys.executable,
            str(ARITHMETIC_ENV),
            "process",
            "--openai.base_url",
            f"{tiny_serve.url}/v1",
            "--openai.model_name",
            "tiny",
            "--env.tokenizer_name",
            str(tiny_model_dir),
            "--env.max_answer_tokens",
            "4",
            "--env.total_steps",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env_environ(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true"),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "data" / "arithmetic.jsonl").exists()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, proc.stderr[-2000:]


@pytest.mark.slow
def test_evaluate_writes_metrics_samples_and_config(tmp_path: Path, tiny_serve, tiny_model_dir):
    evals = tmp_path / "evals"
    proc = _run(
        tmp_path,
        "evaluate",
        "--env.data_dir_to_save_evals",
        str(evals),
        "--env.num_eval_problems",
        "4",
        tiny_serve=tiny_serve,
        tiny_model_dir=tiny_model_dir,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((evals / "metrics.json").read_text())
    result = metrics["results"]["atropos|arithmetic_eval|0"]
    assert 0.0 <= result["eval/percent_correct"] <= 1.0
    assert metrics["results"]["all"] == result
    assert metrics["config_general"]["model_name"] == "tiny"
    assert metrics["config_general"]["generation_parameters"]["temperature"] == 0.0
    samples = [json.loads(x) for x in (evals / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and "question" in samples[0]
    config = yaml.safe_load((evals / "evaluate_config.yaml").read_text())
    assert config["env"]["num_eval_problems"] == 4
    assert config["openai"][0]["model_name"] == "tiny"
    assert "|arithmetic_eval" in proc.stdout  # the metrics table
