"""``atropos-sft-gen`` against a real ``run-api``: a producer posts real tokenized groups (SmolLM2
tokenizer) to ``/scored_data`` while the tool runs as a subprocess.

The helpers here (producer, tool runner) are imported by ``test_dpo_gen.py``.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from atroposlib.datagen import select_dpo_pairs, select_sft, split_group
from tests.conftest import REPO

ARITHMETIC_ENV = REPO / "environments" / "arithmetic_server.py"
QUESTION = "What is 2 + 3?"


# ----------------------------------------------------------------------------- helpers


@functools.cache
def smollm2_tokenizer() -> tuple[Path, Any]:
    """The real SmolLM2 tokenizer: its local folder and the loaded tokenizer."""
    from transformers import AutoTokenizer

    from atroposlib.inference.models import smollm2_tokenizer_dir

    path = smollm2_tokenizer_dir()
    return path, AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return smollm2_tokenizer()[0]


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return smollm2_tokenizer()[1]


def chat_group(
    tokenizer: Any, question: str, answers: Sequence[str], scores: Sequence[float]
) -> dict[str, Any]:
    """A scored group as an env sends it: tokens, masks (prompt masked), scores, messages."""
    from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

    group: dict[str, Any] = {"tokens": [], "masks": [], "scores": list(scores), "messages": []}
    for answer in answers:
        chat = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out = tokenize_for_trainer(tokenizer, chat)
        group["tokens"].append(out["tokens"])
        group["masks"].append(out["masks"])
        group["messages"].append(chat)
    return group


def prompt_text(tokenizer: Any, question: str) -> str:
    """The templated prompt (generation prompt included) as the tool should report it."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return tokenizer.decode(ids)


def tool_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env["WANDB_MODE"] = "disabled"
    return env


class Tool:
    """``python -m atroposlib.cli.<module> ...`` as a subprocess, output captured to a file.

    With ``api_url`` the API is reset first, so that :func:`wait_registered` sees this tool's
    registration and not an earlier one.
    """

    def __init__(self, module: str, *args: str, log: Path, api_url: str | None = None) -> None:
        if api_url is not None:
            assert httpx.get(api_url + "/reset_data").status_code == 200
            args = (*args, "--api-url", api_url)
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in wait()/stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"atroposlib.cli.{module}", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=tool_env(),
            cwd=str(REPO),
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def wait_registered(api_url: str, batch_size: int, tool: Tool, timeout: float = 90) -> None:
    """Block until the tool has registered as the trainer with ``batch_size``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tool.proc.poll() is not None:
            raise AssertionError(f"tool exited early:\n{tool.output()}")
        if httpx.get(api_url + "/info").json()["batch_size"] == batch_size:
            return
        time.sleep(0.1)
    raise AssertionError(f"tool did not register in {timeout}s:\n{tool.output()}")


def post_groups(api_url: str, groups: Sequence[dict[str, Any]]) -> None:
    for group in groups:
        resp = httpx.post(api_url + "/scored_data", json=group, timeout=30)
        assert resp.status_code == 200, resp.text


def register_env(api_url: str, group_size: int, timeout: float = 30) -> dict[str, Any]:
    """Register an env once the tool's first ``/batch`` opened registration; the answer."""
    body = {"max_token_length": 512, "desired_name": "t", "weight": 1.0, "group_size": group_size}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = httpx.post(api_url + "/register-env", json=body).json()
        if data["status"] == "success":
            return data
        time.sleep(0.2)
    raise AssertionError("registration never opened")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), "last line is complete"
    return [json.loads(line) for line in text.splitlines()]


def run_with_groups(
    api_url: str,
    module: str,
    out: Path,
    groups: Sequence[dict[str, Any]],
    batch_size: int,
    *args: str,
    log: Path,
    timeout: float = 120,
) -> tuple[int, str]:
    """Start the tool, post ``groups`` once it registered, wait for it to finish."""
    tool = Tool(module, str(out), *args, log=log, api_url=api_url)
    try:
        wait_registered(api_url, batch_size, tool)
        post_groups(api_url, groups)
        rc = tool.wait(timeout)
    finally:
        tool.stop()
    return rc, tool.output()


# ----------------------------------------------------------------------------- selection rules


def test_select_sft_rules() -> None:
    scores = [1.0, 0.0, -1.0, 0.5]
    assert select_sft(scores, 3, allow_negative=False, min_diff=0.0) == [0, 3]  # 0.0 dropped
    assert select_sft(scores, 3, allow_negative=True, min_diff=0.0) == [0, 3, 1]
    # more than 1.0 above the group's lowest (-1.0): 0.0 is exactly 1.0 above, so out
    assert select_sft(scores, 9, allow_negative=True, min_diff=1.0) == [0, 3]
    assert select_sft([], 3, allow_negative=True, min_diff=1.0) == []


def test_select_dpo_pairs_respects_margin() -> None:
    rng = random.Random(0)
    for _ in range(300):
        scores = [round(rng.uniform(-2, 2), 1) for _ in range(rng.randint(1, 8))]
        margin = rng.choice([0.0, 0.5, 1.0])
        n = rng.randint(1, 4)
        pairs = select_dpo_pairs(scores, n, rng.random() < 0.5, margin, rng)
        assert len(pairs) <= n
        assert len({neg for _, neg in pairs}) == len(pairs), "a rejected is used once"
        for pos, neg in pairs:
            assert scores[pos] - scores[neg] > margin


def test_split_group_empty_common_prefix(tokenizer: Any) -> None:
    texts = ["Apple pie", "Banana split"]
    tokens = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    group = {"tokens": tokens, "masks": tokens, "scores": [1.0, 1.0]}
    assert split_group(tokenizer, group) == [("", "Apple pie"), ("", "Banana split")]


# ----------------------------------------------------------------------------- the tool


def test_sft_top_n_prefix_completion_and_num_steps(
    api_server, tokenizer, tokenizer_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sft.jsonl"
    groups = [
        chat_group(tokenizer, QUESTION, ["5", "0", "6", "five"], [1.0, 0.0, -1.0, 0.5]),
        chat_group(tokenizer, "What is 1 + 1?", ["2", "two", "3", "11"], [2.0, 1.5, 1.0, -3.0]),
    ]
    tool = Tool(
        "sft",
        str(out),
        "--tokenizer",
        str(tokenizer_dir),
        "--group-size",
        "4",
        "--tasks-per-step",
        "1",
        "--save-top-n-per-group",
        "2",
        "--num-seqs-to-save",
        "4",
        log=tmp_path / "tool.log",
        api_url=api_server.url,
    )
    try:
        wait_registered(api_server.url, 4, tool)
        # 4 lines, at most 2 per batch of one group: 2 steps, announced to environments
        assert register_env(api_server.url, 4)["num_steps"] == 2
        post_groups(api_server.url, groups)
        rc = tool.wait(60)
    finally:
        tool.stop()
    assert rc == 0, tool.output()
    lines = read_jsonl(out)
    assert [set(line) for line in lines] == [{"prefix", "completion", "score"}] * 4
    assert [line["score"] for line in lines] == [1.0, 0.5, 2.0, 1.5]
    prompt = prompt_text(tokenizer, QUESTION)
    assert lines[0]["prefix"] == prompt
    assert lines[0]["completion"].startswith("5")
    assert lines[1]["completion"].startswith("five")
    assert lines[2]["prefix"] == prompt_text(tokenizer, "What is 1 + 1?")
    assert lines[3]["completion"].startswith("two")
    assert "wrote 4 lines" in tool.output()


@pytest.mark.slow
def test_sft_messages_trl_and_filters(api_server, tokenizer, tokenizer_dir: Path, tmp_path: Path):
    groups = [chat_group(tokenizer, QUESTION, ["5", "0", "6", "five"], [1.0, 0.0, -1.0, 0.5])]
    common = ["--tokenizer", str(tokenizer_dir), "--group-size", "4", "--tasks-per-step", "1"]
    # --save-messages, negatives allowed, margin 1.0 above the lowest (-1.0): 1.0 and 0.5
    out = tmp_path / "messages.jsonl"
    rc, log = run_with_groups(
        api_server.url, "sft", out, groups, 4, *common, "--save-messages",
        "--allow-negative-scores", "--minimum-score-diff-max-min", "1.0",
        "--num-seqs-to-save", "2", "--save-top-n-per-group", "4", log=tmp_path / "a.log",
    )  # fmt: skip
    assert rc == 0, log
    lines = read_jsonl(out)
    assert [line["score"] for line in lines] == [1.0, 0.5]
    assert lines[0]["messages"] == groups[0]["messages"][0]
    assert set(lines[0]) == {"messages", "score"}
    # TRL conversational format: only "messages"
    out = tmp_path / "trl.jsonl"
    rc, log = run_with_groups(
        api_server.url, "sft", out, groups, 4, *common, "--format", "trl",
        "--num-seqs-to-save", "2", log=tmp_path / "b.log",
    )  # fmt: skip
    assert rc == 0, log
    lines = read_jsonl(out)
    assert lines == [{"messages": groups[0]["messages"][0]}, {"messages": groups[0]["messages"][3]}]


def test_empty_common_prefix_and_append(api_server, tokenizer, tokenizer_dir: Path, tmp_path):
    """Groups with nothing masked and no common text (upstream crashed) work; with
    --append-to-previous the lines go after the existing ones."""
    texts = ["Apple pie", "Banana split"]
    tokens = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    group = {"tokens": tokens, "masks": tokens, "scores": [1.0, 2.0]}
    out = tmp_path / "sft.jsonl"
    out.write_text('{"prefix": "old", "completion": "line", "score": 1}')  # no final newline
    rc, log = run_with_groups(
        api_server.url, "sft", out, [group], 2, "--tokenizer", str(tokenizer_dir),
        "--tasks-per-step", "1", "--num-seqs-to-save", "2", "--append-to-previous",
        log=tmp_path / "tool.log",
    )  # fmt: skip
    assert rc == 0, log
    assert read_jsonl(out) == [
        {"prefix": "old", "completion": "line", "score": 1},
        {"prefix": "", "completion": "Banana split", "score": 2.0},
        {"prefix": "", "completion": "Apple pie", "score": 1.0},
    ]


def _untouched_server(api_url: str) -> None:
    """Register a trainer and queue one group: a tool that touches the server would reset it."""
    client = httpx.Client(base_url=api_url)
    client.get("/reset_data")
    client.post(
        "/register",
        json={
            "wandb_group": "g",
            "wandb_project": "p",
            "batch_size": 7,
            "max_token_len": 100,
            "checkpoint_dir": "c",
            "save_checkpoint_interval": 1,
            "starting_step": 0,
            "num_steps": 1,
        },
    ).raise_for_status()
    client.post("/scored_data", json={"tokens": [[1]], "masks": [[1]], "scores": [1.0]})
    client.close()


def _assert_untouched(api_url: str) -> None:
    assert httpx.get(api_url + "/info").json()["batch_size"] == 7
    assert httpx.get(api_url + "/status").json()["queue_size"] == 1


def test_refusals_leave_the_server_alone(api_server, tmp_path: Path) -> None:
    _untouched_server(api_server.url)
    existing = tmp_path / "exists.jsonl"
    existing.write_text('{"a": 1}\n')
    for module in ("sft", "dpo"):
        res = subprocess.run(
            [sys.executable, "-m", f"atroposlib.cli.{module}", str(existing),
             "--api-url", api_server.url],
            capture_output=True, text=True, env=tool_env(), timeout=60,
        )  # fmt: skip
        assert res.returncode == 1
        assert "already exists" in res.stderr and "--append-to-previous" in res.stderr
        assert existing.read_text() == '{"a": 1}\n'
    # a tokenizer that cannot be found offline: refused before the server is touched
    fresh = tmp_path / "fresh.jsonl"
    res = subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.sft", str(fresh), "--api-url", api_server.url,
         "--tokenizer", "no-such-org/no-such-tokenizer"],
        capture_output=True, text=True, env=tool_env(), timeout=120,
    )  # fmt: skip
    assert res.returncode == 1
    assert "--tokenizer no-such-org/no-such-tokenizer" in res.stderr
    assert not fresh.exists(), "a refused run leaves no empty file behind"
    # bad flags name themselves
    res = subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.sft", str(fresh), "--num-seqs-to-save", "0"],
        capture_output=True, text=True, env=tool_env(), timeout=60,
    )  # fmt: skip
    assert res.returncode == 2 and "--num-seqs-to-save" in res.stderr
    _assert_untouched(api_server.url)


def test_ctrl_c_leaves_a_valid_file(api_server, tokenizer, tokenizer_dir: Path, tmp_path: Path):
    out = tmp_path / "sft.jsonl"
    tool = Tool(
        "sft", str(out), "--tokenizer", str(tokenizer_dir), "--tasks-per-step", "1",
        "--num-seqs-to-save", "1000", log=tmp_path / "tool.log", api_url=api_server.url,
    )  # fmt: skip
    try:
        wait_registered(api_server.url, 2, tool)
        groups = [
            chat_group(tokenizer, f"What is {i} + 1?", [str(i + 1), "x" * 50], [1.0, 0.5])
            for i in range(10)
        ]
        post_groups(api_server.url, groups)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            not out.exists() or out.read_text().count("\n") < 20
        ):
            time.sleep(0.1)
        tool.proc.send_signal(signal.SIGINT)
        rc = tool.wait(30)
    finally:
        tool.stop()
    assert rc == 130, tool.output()
    lines = read_jsonl(out)
    assert len(lines) == 20
    assert f"interrupted: wrote {len(lines)} lines" in tool.output()


# ----------------------------------------------------------------------------- end to end


def start_env(*flags: str, log: Path) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(
        [sys.executable, str(ARITHMETIC_ENV), "serve", *flags],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=tool_env(),
        cwd=str(REPO),
    )


def stop_proc(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def arithmetic_env(
    api_url: str, serve_url: str, model_dir: Path, log: Path, *extra: str
) -> subprocess.Popen:
    """The arithmetic env serving into ``api_url``, sampling from ``atropos-serve``."""
    return start_env(
        "--env.rollout_server_url", api_url, "--openai.base_url", f"{serve_url}/v1",
        "--openai.model_name", "tiny", "--env.tokenizer_name", str(model_dir),
        "--env.max_answer_tokens", "16", "--env.use_wandb", "false", *extra, log=log,
    )  # fmt: skip


@pytest.mark.slow
def test_sft_end_to_end_with_arithmetic_env(
    start_api, tiny_serve, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """run-api + arithmetic env (``serve``) + atropos-serve (tiny model) + atropos-sft-gen."""
    api = start_api()
    out = tmp_path / "sft.jsonl"
    tool = Tool(
        "sft", str(out), "--api-url", api.url, "--tokenizer", str(tiny_model_dir),
        "--group-size", "4", "--tasks-per-step", "2", "--save-top-n-per-group", "2",
        "--num-seqs-to-save", "6", "--allow-negative-scores", log=tmp_path / "tool.log",
    )  # fmt: skip
    env = None
    try:
        wait_registered(api.url, 8, tool)
        env = arithmetic_env(api.url, tiny_serve.url, tiny_model_dir, tmp_path / "env.log")
        rc = tool.wait(240)
    finally:
        tool.stop()
        if env is not None:
            stop_proc(env)
    env_log = (tmp_path / "env.log").read_text(errors="replace")[-3000:]
    assert rc == 0, tool.output() + env_log
    lines = read_jsonl(out)
    assert len(lines) == 6
    for line in lines:
        assert set(line) == {"prefix", "completion", "score"}
        assert line["score"] in (1.0, 0.0)  # the env's default reward: right or not
        assert "What is" in line["prefix"] and line["prefix"].endswith("assistant\n")
    # the two kept from one group are its best
    for a, b in zip(lines[::2], lines[1::2], strict=True):
        if a["prefix"] == b["prefix"]:
            assert a["score"] >= b["score"]
