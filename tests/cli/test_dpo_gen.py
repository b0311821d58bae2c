"""``atropos-dpo-gen`` against a real ``run-api``: pairs come from one group, the chosen score
exceeds the rejected one by more than the margin, and the line shapes are upstream's (or TRL's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_sft_gen import (
    QUESTION,
    Tool,
    arithmetic_env,
    chat_group,
    prompt_text,
    read_jsonl,
    run_with_groups,
    smollm2_tokenizer,
    stop_proc,
    tool_env,
    wait_registered,
)
from tests.conftest import start_server


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    return smollm2_tokenizer()[0]


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return smollm2_tokenizer()[1]


ANSWERS = ["5", "4", "6", "7"]
SCORES = [1.0, 0.6, -0.5, 0.2]


def _groups(tokenizer: Any, n: int) -> list[dict[str, Any]]:
    return [chat_group(tokenizer, QUESTION, ANSWERS, SCORES) for _ in range(n)]


@pytest.mark.slow
def test_dpo_pairs_exceed_margin_in_both_formats(
    api_server, tokenizer, tokenizer_dir: Path, tmp_path: Path
) -> None:
    # batch = group_size * 8 = 32 sequences = 8 groups of 4
    groups = _groups(tokenizer, 8)
    common = ["--tokenizer", str(tokenizer_dir), "--group-size", "4", "--seed", "1"]
    out = tmp_path / "dpo.jsonl"
    rc, log = run_with_groups(
        api_server.url, "dpo", out, groups, 32, *common, "--num-seqs-to-save", "8",
        "--save-n-pairs-per-group", "2", "--minimum-score-diff-max-min", "0.5",
        log=tmp_path / "a.log",
    )  # fmt: skip
    assert rc == 0, log
    lines = read_jsonl(out)
    assert len(lines) == 8
    prompt = prompt_text(tokenizer, QUESTION)
    by_answer = dict(zip(ANSWERS, SCORES, strict=True))
    for line in lines:
        assert set(line) == {"prefix", "pos", "neg", "score", "neg_score"}
        assert line["prefix"] == prompt
        pos, neg = line["pos"].split("<|im_end|>")[0], line["neg"].split("<|im_end|>")[0]
        assert by_answer[pos] == line["score"] and by_answer[neg] == line["neg_score"]
        assert line["score"] - line["neg_score"] > 0.5
    # positives 1.0 and 0.6 (0.2 is a positive too but only 2 pairs are drawn); the rejected
    # pool is the two lowest (-0.5, 0.2): 1.0 pairs with either, 0.6 only with -0.5 (margin)
    assert {(line["score"], line["neg_score"]) for line in lines} <= {
        (1.0, -0.5),
        (1.0, 0.2),
        (0.6, -0.5),
    }
    assert {line["score"] for line in lines} == {1.0, 0.6}

    # TRL conversational format from the same kind of groups
    out = tmp_path / "trl.jsonl"
    rc, log = run_with_groups(
        api_server.url, "dpo", out, groups, 32, *common, "--num-seqs-to-save", "3",
        "--format", "trl", "--allow-negative-scores", log=tmp_path / "b.log",
    )  # fmt: skip
    assert rc == 0, log
    lines = read_jsonl(out)
    assert len(lines) == 3
    for line in lines:
        assert set(line) == {"prompt", "chosen", "rejected"}
        assert line["prompt"] == [{"role": "user", "content": QUESTION}]
        chosen, rejected = line["chosen"][0]["content"], line["rejected"][0]["content"]
        assert line["chosen"][0]["role"] == line["rejected"][0]["role"] == "assistant"
        assert by_answer[chosen] - by_answer[rejected] > 0.5


def test_dpo_save_messages_shape_and_group_size_check(
    api_server, tokenizer, tokenizer_dir: Path, tmp_path: Path
) -> None:
    groups = _groups(tokenizer, 8)
    out = tmp_path / "dpo.jsonl"
    rc, log = run_with_groups(
        api_server.url, "dpo", out, groups, 32, "--tokenizer", str(tokenizer_dir),
        "--group-size", "4", "--save-messages", "--num-seqs-to-save", "2",
        "--save-n-pairs-per-group", "1", log=tmp_path / "a.log",
    )  # fmt: skip
    assert rc == 0, log
    lines = read_jsonl(out)
    assert len(lines) == 2
    for line in lines:
        assert set(line) == {"pos", "neg", "score", "neg_score"}
        assert line["pos"] == groups[0]["messages"][0] and line["score"] == 1.0
        assert line["neg"] == groups[0]["messages"][2] and line["neg_score"] == -0.5
    res = subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.dpo", str(tmp_path / "x.jsonl"),
         "--group-size", "1"],
        capture_output=True, text=True, env=tool_env(), timeout=60,
    )  # fmt: skip
    assert res.returncode == 2 and "--group-size" in res.stderr


@pytest.mark.slow
@pytest.mark.nightly  # ~90-175 s (real SmolLM2 generation); per commit, the SFT end-to-end test
# runs the same env -> run-api -> tool path and test_dpo_pairs_exceed_margin the DPO pairing
def test_dpo_end_to_end_with_arithmetic_env(
    start_api, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """run-api + arithmetic env (``serve``) + atropos-serve + atropos-dpo-gen.

    Uses the real SmolLM2-135M-Instruct and a graded reward (right 1.0, the answer somewhere
    later in the reply 0.5, wrong 0.0, no number at all -1.0), so groups have distinct scores
    to pair (a random tiny model nearly always answers with words only, and every group would
    score alike).
    """
    pytest.importorskip("torch")
    from atroposlib.inference.models import smollm2_model_dir

    model_dir = smollm2_model_dir()
    serve = start_server(tmp_path_factory, model_dir, "--served-model-name", "tiny")
    api = start_api()
    out = tmp_path / "dpo.jsonl"
    env = None
    tool = Tool(
        "dpo", str(out), "--tokenizer", str(model_dir), "--group-size", "4",
        "--num-seqs-to-save", "2", "--allow-negative-scores", "--minimum-score-diff-max-min",
        "0.25", log=tmp_path / "tool.log", api_url=api.url,
    )  # fmt: skip
    try:
        wait_registered(api.url, 32, tool)
        env = arithmetic_env(
            api.url, serve.url, model_dir, tmp_path / "env.log",
            "--env.partial_credit", "0.5", "--env.format_penalty", "1.0",
        )  # fmt: skip
        rc = tool.wait(420)
    finally:
        tool.stop()
        if env is not None:
            stop_proc(env)
        serve.stop()
    env_log = (tmp_path / "env.log").read_text(errors="replace")[-3000:]
    assert rc == 0, tool.output() + env_log
    lines = read_jsonl(out)
    assert len(lines) == 2
    for line in lines:
        assert set(line) == {"prefix", "pos", "neg", "score", "neg_score"}
        assert "What is" in line["prefix"]
        assert line["score"] - line["neg_score"] > 0.25
        assert {line["score"], line["neg_score"]} <= {1.0, 0.5, 0.0, -1.0}
