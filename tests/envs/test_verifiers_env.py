"""``VerifiersEnv``: verifiers 0.4 environments, loaded by name from a taskset package written
for the tests (``tests/envs/verifiers_tasksets``), played with verifiers' own harness (``null``,
its chat program started by ``uv``) and training client against a real ``atropos-serve``
(``POST /inference/v1/generate``), in the verifiers 0.4 virtualenv (``.ci/run`` builds it;
verifiers 0.4 pins ``openai<3``, so it cannot share the main one).

The server runs the scripted model with a tool-capable chat template and Qwen's ``<tool_call>``
tokens, so a group's sequences are known: the trained spans must be exactly the scripted replies
(token ids and end-of-turn token), everything else (prompt, template, tool results) masked.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from atroposlib.schema import ScoredData, check_group
from tests.envs.conftest import start_scripted_server
from tests.envs.test_environment_class import reply_ids, trained_turns
from tests.upstream_envs.scripted_model import build_scripted_model

HERE = Path(__file__).resolve().parent
TASKSETS = HERE / "verifiers_tasksets"
VF_PY = Path(os.environ.get("ATROPOS_VERIFIERS04_PYTHON", "/tmp/verifiers-0.4-venv/bin/python"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VF_PY.exists(), reason=f"the verifiers 0.4 virtualenv is not at {VF_PY} (see .ci/run)"
    ),
]

ADD = '<tool_call>{"name": "add", "arguments": {"a": %d, "b": %d}}</tool_call>'
WORDS = ["apple", "pear", "fig", "plum", "kiwi", "lime"]
PAIRS = [(2, 3), (4, 4), (1, 6)]
RENDERER = json.dumps({"name": "default", "tool_parser": "qwen3"})


def _rules() -> dict[str, list[str]]:
    rules: dict[str, list[str]] = {}
    for a, b in PAIRS:  # tool results first: the later prompt still holds the question
        rules[f"<|im_start|>tool\n{a + b}<|im_end|>"] = [f"The answer is {a + b}."]
    for a, b in PAIRS:
        rules[f"Use the add tool: {a} + {b}."] = [ADD % (a, b), f"It is {a + b + 1}."]
    for word in WORDS:
        rules[f"Reverse the word {word}."] = [word[::-1], f"The word is {word}"]
    return rules


@pytest.fixture(scope="module")
def vf_serve(tmp_path_factory: pytest.TempPathFactory):
    """atropos-serve with the scripted tool user (Qwen-style tool tokens and template)."""
    model = build_scripted_model(
        tmp_path_factory.mktemp("scripted") / "vf",
        _rules(),
        special_tokens=("<tool_call>", "</tool_call>"),
        chat_template=(TASKSETS / "tool_chat_template.jinja").read_text(),
    )
    server = start_scripted_server(tmp_path_factory, model)
    try:
        yield server, model
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer(vf_serve) -> Any:
    return AutoTokenizer.from_pretrained(str(vf_serve[1]))


def _env() -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "PYTHONPATH": str(TASKSETS),
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }


def _run(vf_serve, tmp_path: Path, command: str, *flags: str) -> subprocess.CompletedProcess:
    serve, model = vf_serve
    cmd = [
        str(VF_PY), "-m", "atroposlib.envs.verifiers_env", command,
        "--env.harness", "null",
        "--env.tokenizer_name", str(model),
        "--env.max_tokens_per_turn", "48",
        "--openai.base_url", serve.url + "/v1",
        "--openai.model_name", "tiny",
        "--openai.server_type", "vllm",
        "--openai.api_key", "x",
        *flags,
    ]  # fmt: skip
    return subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
    )


def _process(vf_serve, tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / "groups.jsonl"
    proc = _run(
        vf_serve, tmp_path, "process",
        "--env.total_steps", "1",
        "--env.group_size", "4",
        "--env.eval_items", "0",
        "--env.data_path_to_save_groups", str(out),
        *flags,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def _prompt_of(group: dict, tokenizer: Any) -> str:
    return tokenizer.decode(group["tokens"][0])


def assert_token_exact(group: dict, tokenizer: Any, paths: dict[str, tuple[list[str], float]]):
    """Each sequence follows one known path: its trained spans are exactly the path's replies
    (ids and end-of-turn token), its sampler log-probs sit under them (1.0 elsewhere), its score
    is the path's. Returns the paths seen."""
    check_group(ScoredData(**group))
    seen = set()
    for tokens, masks, logprobs, score in zip(
        group["tokens"], group["masks"], group["inference_logprobs"], group["scores"], strict=True
    ):
        spans = trained_turns(tokens, masks)
        first = tokenizer.decode(spans[0], skip_special_tokens=False)
        name = next(p for p in paths if first.startswith(p))
        replies, expected = paths[name]
        assert spans == [reply_ids(tokenizer, r) for r in replies], (name, spans)
        assert score == pytest.approx(expected)
        for token, mask, logprob in zip(tokens, masks, logprobs, strict=True):
            assert mask in (-100, token)
            if mask == -100:
                assert logprob == 1.0
            else:
                assert logprob <= 0.0
        seen.add(name)
    return seen


def test_the_verifiers_04_virtualenv_is_installed() -> None:
    out = subprocess.run(
        [str(VF_PY), "-c", "import verifiers, atroposlib, uv; print(verifiers.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == "0.4.0", out.stderr[-2000:]


def test_a_single_turn_taskset_processes_token_exact_groups(vf_serve, tokenizer, tmp_path) -> None:
    (group,) = _process(vf_serve, tmp_path, "--env.taskset", "vf-reverse")
    prompt = _prompt_of(group, tokenizer)
    word = next(w for w in WORDS if f"Reverse the word {w}." in prompt)
    # reward = correct (weight 1) + short (weight 0.5, replies of at most 8 characters)
    right, wrong = word[::-1], f"The word is {word}"
    paths = {right: ([right], 1.0 + 0.5), "The word": ([wrong], 0.5 * (len(wrong) <= 8))}
    assert_token_exact(group, tokenizer, paths)
    assert group["policy_version"] == 0  # the server's version, stamped through the span
    assert group["generation_params"] == {"temperature": 1.0, "max_tokens": 48}
    assert group["messages"][0][0] == {"role": "user", "content": f"Reverse the word {word}."}


def test_a_multi_turn_tool_taskset_masks_the_tool_results(vf_serve, tokenizer, tmp_path) -> None:
    groups = _process(vf_serve, tmp_path, "--env.taskset", "vf-adder", "--env.renderer", RENDERER)
    (group,) = groups
    prompt = _prompt_of(group, tokenizer)
    a, b = next(p for p in PAIRS if f"Use the add tool: {p[0]} + {p[1]}." in prompt)
    paths = {
        "<tool_call>": ([ADD % (a, b), f"The answer is {a + b}."], 1.0),
        "It is": ([f"It is {a + b + 1}."], 0.0),
    }
    assert_token_exact(group, tokenizer, paths)
    for tokens, masks, messages in zip(
        group["tokens"], group["masks"], group["messages"], strict=True
    ):
        if len(trained_turns(tokens, masks)) == 2:
            # the tool's answer is in the sequence, masked, and in the messages as a tool turn
            text = tokenizer.decode(tokens)
            assert f"<|im_start|>tool\n{a + b}<|im_end|>" in text
            tool = [m for m in messages if m["role"] == "tool"]
            assert tool and tool[0]["content"] == str(a + b)
            call = messages[1]["tool_calls"][0]["function"]
            assert call["name"] == "add" and json.loads(call["arguments"]) == {"a": a, "b": b}


def test_the_library_api_logs_each_reward_term_and_maps_the_policy_span(
    vf_serve, tokenizer, tmp_path
) -> None:
    serve, model = vf_serve
    proc = subprocess.run(
        [str(VF_PY), str(HERE / "verifiers_driver.py"), serve.url + "/v1", str(model), "vf-reverse"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    metrics = result["metrics"]
    # one metric per reward term (unweighted) and per verifiers metric, and the total reward
    for name in ("train/correct", "train/short", "train/reply_chars", "train/reward"):
        assert name in metrics, sorted(metrics)
    assert metrics["train/failed_episodes"] == 0.0
    group = result["group"]
    assert metrics["train/reward"] == pytest.approx(sum(group["scores"]) / len(group["scores"]))
    assert metrics["train/correct"] == pytest.approx(
        sum(s >= 1.0 for s in group["scores"]) / len(group["scores"])
    )
    assert result["span"] == {"start": 0, "end": 0}
    assert result["mapped_versions"] == [3]  # a sequence's version is its span's start
    assert result["dropped"] == []
    assert (len(result["eval_answers"]), result["train_tasks"]) == (2, 4)
    # greedy (evaluation): the scripted model writes the reply whose first token id is lowest
    expected = []
    for answer in result["eval_answers"]:
        replies = [answer, f"The word is {answer[::-1]}"]
        reply = min(replies, key=lambda r: tokenizer.encode(r, add_special_tokens=False))
        expected.append(float(reply == answer) + 0.5 * (len(reply) <= 8))
    evaluation = result["eval"]
    assert evaluation["eval/mean_reward"] == pytest.approx(sum(expected) / len(expected))
    assert evaluation["eval/failed_rate"] == 0.0
    assert "eval/correct" in evaluation and "eval/reply_chars" in evaluation


def test_check_passes_and_bad_settings_name_their_flag(vf_serve, tmp_path) -> None:
    check = _run(
        vf_serve, tmp_path, "check",
        "--env.taskset", "vf-reverse",
        "--env.group_size", "4",
        "--env.eval_items", "1",
        "--check.serve", "never",
        "--check.items", "1",
        "--check.eval_items", "1",
    )  # fmt: skip
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    openai = _run(
        vf_serve, tmp_path, "process", "--env.taskset", "vf-reverse",
        "--openai.server_type", "openai", "--env.total_steps", "1",
    )  # fmt: skip
    assert openai.returncode != 0
    assert "--openai.server_type openai: VerifiersEnv needs" in openai.stderr
    missing = _run(
        vf_serve, tmp_path, "process", "--env.taskset", "vf-nowhere", "--env.total_steps", "1"
    )
    assert missing.returncode != 0
    assert "--env.taskset 'vf-nowhere'" in missing.stderr
    assert "not found" in missing.stderr
