"""GSM8K: scoring of hand-written answers, local data, and one ``process`` run end to end."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atroposlib.envs.base import APIServerConfig
from atroposlib.envs.rollout import Sample
from atroposlib.utils.data import load_rows
from environments.gsm8k_server import BUNDLED_GSM8K as GSM8K
from environments.gsm8k_server import GSM8kEnv
from tests.conftest import REPO


def make_env(env_cls, tokenizer_dir: Path, **overrides):
    """An env built the way the CLI builds it, talking to nothing (unit tests of scoring)."""
    config, _ = env_cls.config_init()
    config = config.model_copy(
        update={"tokenizer_name": str(tokenizer_dir), "use_wandb": False, **overrides}
    )
    server = APIServerConfig(
        model_name="tiny", base_url="http://127.0.0.1:9/v1", tokenizer_name=str(tokenizer_dir)
    )
    return env_cls(config, [server], testing=True)


def fake_sample(text: str, n_tokens: int = 20, finish_reason: str = "stop") -> Sample:
    """A completion as the env sees it (token ids are placeholders; only counts matter)."""
    return Sample(
        text=text,
        finish_reason=finish_reason,
        tokens=list(range(5 + n_tokens)),
        masks=[-100] * 5 + list(range(n_tokens)),
        logprobs=[1.0] * 5 + [-0.5] * n_tokens,
        messages=[{"role": "assistant", "content": text}],
    )


def run_env(
    script: str, command: str, out: Path, serve, tokenizer_dir: Path, *extra: str
) -> subprocess.CompletedProcess:
    """``python environments/<script> <command> ...`` against ``serve`` (served as ``tiny``,
    offline, W&B off), run in ``out``."""
    cmd = [
        sys.executable,
        str(REPO / "environments" / script),
        command,
        "--env.use_wandb",
        "false",
        "--env.tokenizer_name",
        str(tokenizer_dir),
        "--openai.base_url",
        serve.url + "/v1",
        "--openai.model_name",
        "tiny",
        "--openai.tokenizer_name",
        str(tokenizer_dir),
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    return subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)


def run_process(script: str, out: Path, serve, tokenizer_dir: Path, *extra: str) -> list[dict]:
    """``python environments/<script> process ...`` against ``serve``; the groups it wrote."""
    data = out / "groups.jsonl"
    proc = run_env(
        script,
        "process",
        out,
        serve,
        tokenizer_dir,
        "--env.data_path_to_save_groups",
        str(data),
        *extra,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    groups = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    assert groups, proc.stderr[-3000:]
    return groups


def assert_valid_groups(groups: list[dict], group_size: int) -> None:
    """Each group: tokens/masks/scores of matching lengths, masks are labels (-100 or the id)."""
    for group in groups:
        n = len(group["tokens"])
        expected = (group.get("group_overrides") or {}).get("group_size", group_size)
        assert n == expected
        assert len(group["masks"]) == n and len(group["scores"]) == n
        for tokens, masks in zip(group["tokens"], group["masks"], strict=True):
            assert len(tokens) == len(masks) > 0
            assert any(m != -100 for m in masks)
            assert all(m in (-100, t) for t, m in zip(tokens, masks, strict=True))
        if group.get("inference_logprobs"):
            assert [len(x) for x in group["inference_logprobs"]] == [
                len(t) for t in group["tokens"]
            ]
        assert all(isinstance(s, float) for s in group["scores"])


@pytest.fixture()
def gsm8k_env(tiny_model_dir: Path):
    return make_env(GSM8kEnv, tiny_model_dir, group_size=4, max_token_length=100)


def test_scores_correct_wrong_and_malformed_answers(gsm8k_env) -> None:
    samples = [
        fake_sample("<think>16-3-4=9; 9*2=18</think> She makes \\boxed{18} dollars."),
        fake_sample("The answer is \\boxed{17}."),
        fake_sample("The answer is 18."),  # no box: upstream gives no credit
        fake_sample("\\boxed{18"),  # truncated
    ]
    group = gsm8k_env.score_samples(samples, "18")
    assert group["scores"] == [1.0, -1.0, -1.0, -1.0]
    assert len(group["tokens"]) == len(group["masks"]) == len(group["inference_logprobs"]) == 4


def test_format_reward_needs_a_number_in_the_box(gsm8k_env) -> None:
    gsm8k_env.config.format_reward = 1.0
    samples = [
        fake_sample("So \\boxed{18}."),  # right and well formed
        fake_sample("So \\boxed{17}."),  # wrong, well formed
        fake_sample("Write it as \\boxed{N}."),  # the placeholder: no credit for the form
        fake_sample("The answer is 18."),
    ]
    group = gsm8k_env.score_samples(samples, "18")
    assert group["scores"] == [2.0, 0.0, -1.0, -1.0]
    # a box holding a digit: a smaller step on the way; the placeholder gets none of it (a run
    # whose replies all ended in \\boxed{N} for a half point had no signal left to leave it)
    gsm8k_env.config.box_reward = 0.5
    samples.append(fake_sample("So \\boxed{17 eggs?}."))
    group = gsm8k_env.score_samples(samples, "18")
    assert group["scores"] == [2.5, 0.5, -1.0, -1.0, -0.5]
    gsm8k_env.config.format_min_tokens = 15  # a bare boxed guess earns no format credit
    samples.append(fake_sample("\\boxed{17}", n_tokens=12))
    group = gsm8k_env.score_samples(samples, "18")
    assert group["scores"] == [2.5, 0.5, -1.0, -1.0, -0.5, -1.0]


def test_format_reward_needs_a_finished_reply_with_one_box(gsm8k_env) -> None:
    """A run learned to repeat '\\boxed{222} \\boxed{222} ...' until the budget cut it off."""
    gsm8k_env.config.format_reward = 1.0
    gsm8k_env.config.box_reward = 0.5
    samples = [
        fake_sample("Half of 36 is \\boxed{18}."),  # ended on its own, one box: full credit
        fake_sample("So \\boxed{222} \\boxed{222} \\boxed{222}", finish_reason="length"),
        fake_sample("Half of 36 is \\boxed{18}.", finish_reason="length"),  # cut off
        fake_sample("First \\boxed{36}, then \\boxed{18}."),  # finished, two boxes
    ]
    group = gsm8k_env.score_samples(samples, "18")
    # a right answer counts (+1) however the reply ends, the format credit only for a finished
    # reply with one box; two boxes parse as the set {36, 18}, which is not the answer
    assert group["scores"] == [2.5, -1.0, 1.0, -1.0]
    # strict_answer: only a well-formed final answer can be right; a loop that repeats the
    # right number in boxes until the budget cuts it off scores as wrong
    gsm8k_env.config.strict_answer = True
    samples.append(fake_sample("So \\boxed{18} \\boxed{18} \\boxed{18}", finish_reason="length"))
    group = gsm8k_env.score_samples(samples, "18")
    assert group["scores"] == [2.5, -1.0, -1.0, -1.0, -1.0]


def test_short_replies_are_replaced_so_groups_stay_whole(tiny_serve, tiny_model_dir: Path) -> None:
    """A reply under min_completion_tokens is dropped; refill_short samples a new one at its
    temperature from the real server, so the group keeps group_size replies (a group of 15
    never packs into a batch of 32 from groups of 16). 0 keeps upstream's short group."""
    import asyncio

    from atroposlib.envs.runtime import shutdown_env

    config, _ = GSM8kEnv.config_init()
    config = config.model_copy(
        update={
            "tokenizer_name": str(tiny_model_dir),
            "use_wandb": False,
            "group_size": 4,
            "max_token_length": 64,
            "min_completion_tokens": 4,
            "max_answer_tokens": 8,
        }
    )
    server = APIServerConfig(
        model_name="tiny",
        base_url=tiny_serve.url + "/v1",
        tokenizer_name=str(tiny_model_dir),
        server_type="atropos-serve",
    )
    env = GSM8kEnv(config, [server])
    messages = env.messages_for("Natalia sold 48 clips. How many?")

    def fake(n_tokens: int, temperature: float) -> Sample:
        sample = fake_sample("x", n_tokens=n_tokens)
        sample.generation_params = {"temperature": temperature}
        return sample

    long_ones = [fake(20, 1.0), fake(20, 1.0)]
    samples = [long_ones[0], fake(2, 0.0), long_ones[1], fake(1, 0.0)]

    async def refill(rounds: int) -> list[Sample]:
        env.config.refill_short = rounds
        try:
            return await env.refill_short_samples(messages, samples)
        finally:
            await shutdown_env(env)

    assert asyncio.run(refill(0)) == samples
    refilled = asyncio.run(refill(2))
    assert len(refilled) == 4 and refilled[:2] == long_ones
    new = refilled[2:]
    # the server's greedy reply, twice: real tokens and log-probs at the dropped temperature
    assert all(s.generation_params.get("temperature") == 0.0 for s in new)
    assert new[0].tokens == new[1].tokens and new[0].logprobs is not None
    assert all(s.trainable_tokens >= 4 for s in new)
    group = env.score_samples(refilled, "72")
    assert group is not None and len(group["tokens"]) == 4
    assert "group_size" not in (group.get("group_overrides") or {})


def test_finish_reward_splits_groups_that_all_miss(gsm8k_env) -> None:
    """The base model loops until the budget cuts 84% of its replies off and almost never
    boxes: nearly every group scored -1 throughout and was dropped as flat. A reply that ends
    on its own is what the well-formed rule needs first."""
    gsm8k_env.config.format_reward = 1.0
    gsm8k_env.config.box_reward = 0.5
    gsm8k_env.config.format_min_tokens = 15
    samples = [
        fake_sample("16 * 16 = 16 * 16 * 16 = 16 * 16", finish_reason="length"),
        fake_sample("She makes 17 dollars."),  # finished, no box, wrong
        fake_sample("It is 17.", n_tokens=12),  # finished, too short for any format credit
        fake_sample("So \\boxed{17}."),  # finished, well formed, wrong
        fake_sample("So \\boxed{18}."),  # finished, well formed, right
        fake_sample("So \\boxed{18}.", finish_reason="abort"),  # an aborted reply: not finished
    ]
    gsm8k_env.config.ensure_scores_are_not_same = True
    group = gsm8k_env.score_samples(samples[:3], "18")
    assert group["scores"] == [-1.0, -1.0, -1.0]
    assert gsm8k_env._check_group(group, False) == "same_scores"  # no signal: dropped
    gsm8k_env.config.finish_reward = 0.5
    group = gsm8k_env.score_samples(samples, "18")
    assert group["scores"] == [-1.0, -0.5, -1.0, 1.0, 3.0, 2.5]
    assert gsm8k_env._check_group(group, False) is None  # kept
    # the best score counts as correct for train/percent_correct
    correct = gsm8k_env._wandb_logging.train_metrics["train/percent_correct"]
    assert correct[-6:] == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_final_temperature_anneals_with_the_trainer_step(gsm8k_env) -> None:
    cfg = gsm8k_env.config
    cfg.temperature, cfg.total_steps = 0.4, 13
    gsm8k_env.curr_step = 6
    assert gsm8k_env.sampling_temperature() == 0.4  # no final_temperature: constant
    cfg.final_temperature = 0.2
    # groups sampled before step 1 at 0.4, for the last step (curr_step 12) at 0.2
    for step, expected in [(0, 0.4), (3, 0.35), (6, 0.3), (12, 0.2), (40, 0.2)]:
        gsm8k_env.curr_step = step
        assert gsm8k_env.sampling_temperature() == pytest.approx(expected)
    # the group says what its samples were drawn at, so the trainer scales its logits by it
    samples = [fake_sample("\\boxed{18}"), fake_sample("no box")]
    for sample in samples:
        sample.generation_params = {"temperature": 0.3}
    assert gsm8k_env.score_samples(samples, "18")["generation_params"] == {"temperature": 0.3}


def test_length_penalty_when_all_are_correct(gsm8k_env) -> None:
    samples = [fake_sample("\\boxed{18}", n) for n in (10, 60, 80, 95)]
    group = gsm8k_env.score_samples(samples, "18")
    lengths = [len(t) for t in group["tokens"]]  # 15, 65, 85, 100 with max 100
    assert lengths == [15, 65, 85, 100]
    assert group["scores"] == pytest.approx([1.0, 0.7, 0.3, 0.0])


def test_short_completions_are_dropped_and_equal_groups_follow_the_flag(
    gsm8k_env, caplog: pytest.LogCaptureFixture
) -> None:
    samples = [fake_sample("\\boxed{1}", 3), fake_sample("\\boxed{2}"), fake_sample("\\boxed{3}")]
    gsm8k_env.config.ensure_scores_are_not_same = False
    group = gsm8k_env.score_samples(samples, "18")
    assert group["scores"] == [-1.0, -1.0]
    assert group["group_overrides"] == {"group_size": 2}
    assert gsm8k_env._check_group(group, False) is None  # sent as it is
    gsm8k_env.config.ensure_scores_are_not_same = True
    group = gsm8k_env.score_samples(samples, "18")
    gsm8k_env._flat_report = (time.monotonic() - 60, 0)  # last reported a minute ago
    with caplog.at_level(logging.INFO, logger="atroposlib.envs.base"):
        assert gsm8k_env._check_group(group, False) == "same_scores"  # dropped and counted
    assert "scored alike, no learning signal" in caplog.text  # the reason a trainer waits


def test_unparseable_gold_gives_no_group(gsm8k_env) -> None:
    assert gsm8k_env.score_samples([fake_sample("\\boxed{1}")], "") is None


def test_local_jsonl_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="dataset_path"):
        load_rows(tmp_path / "missing.jsonl", "train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2"):
        load_rows(bad, "train")


async def test_setup_reads_the_bundled_copy_by_default(gsm8k_env) -> None:
    assert gsm8k_env.config.dataset_path is None  # no path, no Hub: the repository's copy
    gsm8k_env.config.max_eval_items = 50
    await gsm8k_env.setup()
    assert len(gsm8k_env.train) == len(load_rows(GSM8K, "train"))
    assert len(gsm8k_env.test) == 50
    assert gsm8k_env.test[0]["gold_answer"] == "18"  # Janet's ducks
    item = await gsm8k_env.get_next_item()
    assert set(item) >= {"question", "answer"}


async def test_format_instruction_and_worked_examples(gsm8k_env) -> None:
    gsm8k_env.config.system_prompt = ""
    gsm8k_env.config.prompt_suffix = "\n\nWrite the final answer as \\boxed{N}."
    gsm8k_env.config.few_shot = 2
    gsm8k_env.config.max_eval_items = 5
    await gsm8k_env.setup()
    messages = gsm8k_env.messages_for("How many?")
    # no system turn; two worked examples as earlier turns, then the question
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2 + ["user"]
    assert messages[-1]["content"] == "How many?\n\nWrite the final answer as \\boxed{N}."
    for example in messages[1:4:2]:
        assert example["content"].endswith("}.") and "\\boxed{" in example["content"]
        assert "<<" not in example["content"]  # the dataset's calculator notes are gone
    shown = {m["content"].removesuffix(gsm8k_env.config.prompt_suffix) for m in messages[0:4:2]}
    assert not shown & {row["question"] for row in gsm8k_env.train}  # never asked in training
    assert len(gsm8k_env.train) == len(load_rows(GSM8K, "train")) - 2
    # the worked answers are graded like replies: their box holds the gold answer
    for example, asked in zip(messages[1:4:2], gsm8k_env.examples, strict=True):
        group = gsm8k_env.score_samples(
            [fake_sample(example["content"]), fake_sample("no answer")],
            gsm8k_env.gold_for(asked),
        )
        assert group["scores"] == [1.0, -1.0]


@pytest.mark.slow
def test_process_end_to_end(tiny_serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    groups = run_process(
        "gsm8k_server.py",
        tmp_path,
        tiny_serve,
        tiny_model_dir,
        "--env.total_steps",
        "2",
        "--env.group_size",
        "3",
        "--env.max_token_length",
        "48",
    )
    assert len(groups) == 2
    assert_valid_groups(groups, 3)
    assert all(s in (-1.0, 1.0) for g in groups for s in g["scores"])
    # sampled at the env's temperature, as each group tells the trainer
    assert all(g["generation_params"] == {"temperature": 1.0} for g in groups)
    assert groups[0]["messages"][0][0]["role"] == "system"


def test_group_temperatures_share_the_group(gsm8k_env) -> None:
    cfg = gsm8k_env.config
    cfg.temperature, cfg.group_size = 0.4, 16
    assert gsm8k_env.group_temperatures() == [(0.4, 16)]
    cfg.temperatures = [0.3, 0.5]
    assert gsm8k_env.group_temperatures() == [(0.3, 8), (0.5, 8)]
    cfg.temperatures = [0.2, 0.4, 0.6]  # the first ones take the remainder
    assert gsm8k_env.group_temperatures() == [(0.2, 6), (0.4, 5), (0.6, 5)]
    cfg.group_size, cfg.temperatures = 2, [0.3, 0.5, 0.7]  # more temperatures than replies
    assert gsm8k_env.group_temperatures() == [(0.3, 1), (0.5, 1)]
    logged = gsm8k_env._wandb_logging.train_metrics["train/temperature"]
    assert logged[-1] == pytest.approx(0.4)


def test_temperatures_and_final_temperature_are_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "environments" / "gsm8k_server.py"),
            "process",
            "--env.temperatures",
            "0.3",
            "0.5",
            "--env.final_temperature",
            "0.2",
        ],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "temperatures and final_temperature both set" in proc.stderr


@pytest.mark.slow
def test_process_samples_a_group_at_several_temperatures(
    tiny_serve, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``--env.temperatures 1.0 0``: two replies sampled, one greedy, and the group says which
    per sequence, so the trainer scores each as drawn (temperature 0 counts as 1 there)."""
    import httpx

    from atroposlib.trainer import rows_from_batch, sample_temperature

    groups = run_process(
        "gsm8k_server.py",
        tmp_path,
        tiny_serve,
        tiny_model_dir,
        "--env.total_steps",
        "2",
        "--env.group_size",
        "3",
        "--env.max_token_length",
        "32",
        "--env.temperatures",
        "1.0",
        "0",
        "--env.min_completion_tokens",
        "0",
    )
    assert len(groups) == 2
    assert_valid_groups(groups, 3)
    for group in groups:
        assert "generation_params" not in group
        assert [sample_temperature(group, i) for i in range(3)] == [1.0, 1.0, 0.0]
        # the greedy reply is what the server answers a greedy request for the same chat
        chat = group["messages"][2]
        reply = httpx.post(
            tiny_serve.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": chat[:-1], "temperature": 0, "max_tokens": 32},
            timeout=60,
        ).json()["choices"][0]["message"]["content"]
        assert reply == chat[-1]["content"]
    rows = rows_from_batch(groups)
    assert [row.temperature for row in rows] == [1.0, 1.0, 0.0] * 2


@pytest.mark.slow
def test_evaluation_budget_apart_from_training(
    tiny_serve, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``--env.eval_max_answer_tokens``: evaluate() replies get their own budget; training
    replies keep ``max_answer_tokens``."""
    budget = ["--env.max_answer_tokens", "4", "--env.eval_max_answer_tokens", "16"]
    groups = run_process(
        "gsm8k_server.py",
        tmp_path,
        tiny_serve,
        tiny_model_dir,
        "--env.total_steps",
        "1",
        "--env.group_size",
        "2",
        "--env.min_completion_tokens",
        "0",
        *budget,
    )
    replies = [sum(m != -100 for m in masks) for g in groups for masks in g["masks"]]
    assert replies and max(replies) <= 4
    out = tmp_path / "evals"
    proc = run_env(
        "gsm8k_server.py",
        "evaluate",
        tmp_path,
        tiny_serve,
        tiny_model_dir,
        "--env.max_eval_items",
        "3",
        "--env.data_dir_to_save_evals",
        str(out),
        *budget,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config_general"]["generation_parameters"]["max_tokens"] == 16
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3
    # the random tiny model rarely stops early: its replies run past the training budget
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    lengths = [
        len(tokenizer(s["messages"][-1]["content"], add_special_tokens=False)["input_ids"])
        for s in samples
    ]
    assert max(lengths) > 4, lengths


@pytest.mark.slow
def test_serve_reports_flat_groups_to_run_api(
    start_api, tiny_serve, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The random tiny model never boxes an answer: every group scores -1 throughout and is
    dropped before sending (ensure_scores_are_not_same). The env says so with /status-env, so
    run-api's /metrics and a waiting trainer see why no batch comes."""
    import httpx

    from atroposlib.api.client import TrainerClient, TrajectoryAPIError
    from tests.envs.helpers import start_env, stop

    api = start_api()
    with TrainerClient(api.url, api_key="", long_poll=0.5) as client:
        client.register(batch_size=4, max_token_len=512, num_steps=2)
        assert client.try_batch() is None  # opens env registration
        proc = start_env(
            str(REPO / "environments" / "gsm8k_server.py"),
            "serve",
            "--env.rollout_server_url",
            api.url,
            "--openai.base_url",
            f"{tiny_serve.url}/v1",
            "--openai.model_name",
            "tiny",
            "--openai.tokenizer_name",
            str(tiny_model_dir),
            "--env.tokenizer_name",
            str(tiny_model_dir),
            "--env.use_wandb",
            "false",
            "--env.group_size",
            "2",
            "--env.max_token_length",
            "16",
            "--env.min_completion_tokens",
            "0",
            "--env.ensure_scores_are_not_same",
            "true",
            log=tmp_path / "env.log",
        )
        try:
            deadline = time.monotonic() + 120
            dropped: dict = {}
            while time.monotonic() < deadline and dropped.get("same_scores", 0) < 2:
                time.sleep(1.0)
                metrics = httpx.get(f"{api.url}/metrics", params={"format": "json"}).json()
                dropped = metrics["env_dropped"]
            assert dropped.get("same_scores", 0) >= 2, (tmp_path / "env.log").read_text()[-3000:]
            assert metrics["accepted_groups"] == 0
            with pytest.raises(TrajectoryAPIError, match=r"same_scores \(all replies scored"):
                client.get_batch(timeout=1.5)
        finally:
            stop(proc)
