"""The trainer against real processes: run-api, atropos-serve (tiny model), an env in serve mode.

Also: registration retries while run-api starts, resuming continues the step count, and the
quick start runs the whole loop, leaves an output folder and stops every child (also on Ctrl-C).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from example_trainer.api import TrainerAPIClient, TrajectoryAPIError
from tests.conftest import ApiProcess, free_port, start_server

LENGTH_ENV = Path(__file__).with_name("length_env.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}


def _procs_mentioning(text: str) -> list[str]:
    """Command lines of live processes (not zombies) that contain ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        cmdline = " ".join(argv)
        # not a pytest runner (whose argv may mention the text); its children's paths may
        # contain "pytest-of-..." and still count
        runner = "pytest" in (os.path.basename(arg) for arg in argv[:5])
        if text in cmdline and state != "Z" and not runner:
            found.append(cmdline)
    return found


def _wait_gone(text: str, timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = _procs_mentioning(text)
        if not left:
            return []
        time.sleep(0.3)
    return _procs_mentioning(text)


def _pid_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.2)
    return False


def _probe(url: str) -> list[float]:
    """Greedy token logprobs of a fixed prompt: they change when the served weights change."""
    reply = httpx.post(
        url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "What is 2 + 2?",
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 1,
        },
        timeout=60,
    ).json()
    return reply["choices"][0]["logprobs"]["token_logprobs"]


def _metrics(save_path: Path) -> list[dict]:
    return [json.loads(line) for line in (save_path / "metrics.jsonl").read_text().splitlines()]


def _trainer_cmd(model: Path | str, api_url: str, save_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "example_trainer.grpo",
        "--model",
        str(model),
        "--atropos-url",
        api_url,
        "--save-path",
        str(save_path),
        "--seq-len",
        "256",
        "--batch-size",
        "4",
        "--gradient-accumulation-steps",
        "2",
        "--dtype",
        "float32",
        "--lr",
        "1e-3",
        "--batch-timeout",
        "180",
        "--no-progress",
        *extra,
    ]


def _tokenized_groups(n_groups: int, group_size: int = 4) -> list[dict]:
    """Real SmolLM2-tokenized groups as an env would send them, with varied optional fields."""
    from transformers import AutoTokenizer

    from atroposlib.inference.models import smollm2_tokenizer_dir
    from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    groups = []
    for g in range(n_groups):
        tokens, masks, scores, logprobs = [], [], [], []
        for i in range(group_size):
            chat = [
                {"role": "user", "content": f"What is {g} + {i}?"},
                {"role": "assistant", "content": f"The answer is {g + i}" + " really" * i},
            ]
            out = tokenize_for_trainer(tokenizer, chat)
            tokens.append(out["tokens"])
            masks.append(out["masks"])
            scores.append(float(i % 3))
            logprobs.append([1.0 if m == -100 else -0.7 for m in out["masks"]])
        group = {"tokens": tokens, "masks": masks, "scores": scores}
        if g % 2:
            group["inference_logprobs"] = logprobs
            group["overrides"] = [{"set_advantage_to_zero": True}, {"temperature": 0.8}, {}, {}]
        groups.append(group)
    return groups


# ------------------------------------------------------------------------- API client


def test_registration_retries_until_run_api_starts(tmp_path: Path) -> None:
    port = free_port()
    result: dict = {}

    def register() -> None:
        with TrainerAPIClient(f"http://127.0.0.1:{port}") as client:
            result["uuid"] = client.register(
                batch_size=8,
                max_token_len=256,
                checkpoint_dir=str(tmp_path),
                save_checkpoint_interval=1,
                starting_step=5,
                num_steps=10,
                timeout=60,
            )

    thread = threading.Thread(target=register)
    thread.start()
    time.sleep(2.0)  # the trainer is already retrying
    server = ApiProcess(log_path=tmp_path / "api.log", port=port).start()
    try:
        thread.join(60)
        assert isinstance(result.get("uuid"), int)
        assert httpx.get(server.url + "/status").json()["current_step"] == 5
        with TrainerAPIClient(server.url) as client:
            with pytest.raises(TrajectoryAPIError, match="no batch .* within 1 s"):
                client.get_batch(timeout=1, poll=0.2)
    finally:
        server.stop()


def test_client_acknowledges_so_a_lost_batch_comes_again(start_api, tmp_path: Path) -> None:
    """The trainer's client sends ``ack`` with each /batch: a batch whose response never reached
    it (here fetched by someone else, then run-api killed and restarted on its store) is handed
    to it again, then the next one; the loop sees every group once."""
    from tests.api.helpers import add_env, group, tags

    store = tmp_path / "run.sqlite3"
    server = start_api("--store", str(store))
    with TrainerAPIClient(server.url) as client:
        client.register(
            batch_size=4,
            max_token_len=64,
            checkpoint_dir=str(tmp_path),
            save_checkpoint_interval=1,
            starting_step=0,
            num_steps=3,
        )
        with httpx.Client(base_url=server.url, timeout=10) as raw:
            assert raw.get("/batch").json() == {"batch": None}  # opens env registration
            env = add_env(raw, group_size=2)
            for tag in range(1, 7):
                assert raw.post("/scored_data", json=group(2, env_id=env, tag=tag)).is_success
            assert tags(client.get_batch(timeout=10)) == [1, 2]
            assert client.last_step == 1
            # the response of step 2 is lost on its way to the trainer
            lost = raw.get("/batch", params={"ack": 1})
            assert lost.headers["X-Atropos-Step"] == "2"
        server.kill9()
        again = start_api("--store", str(store), port=server.port)
        assert again.port == server.port
        assert tags(client.get_batch(timeout=30)) == [3, 4]
        assert tags(client.get_batch(timeout=10)) == [5, 6]
        assert client.last_step == 3


def test_batch_before_registration_is_an_error(api: httpx.Client) -> None:
    with TrainerAPIClient(str(api.base_url)) as client:
        with pytest.raises(TrajectoryAPIError, match="not registered"):
            client.get_batch(timeout=5)


def test_unreachable_api_gives_up_at_the_deadline() -> None:
    with TrainerAPIClient(f"http://127.0.0.1:{free_port()}") as client:
        with pytest.raises(TrajectoryAPIError, match="is run-api running"):
            client.register(
                batch_size=1,
                max_token_len=1,
                checkpoint_dir="x",
                save_checkpoint_interval=1,
                starting_step=0,
                num_steps=1,
                timeout=1.0,
            )


# --------------------------------------------------------------------- full loop (slow)


@pytest.mark.slow
def test_trainer_env_and_server_end_to_end(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, start_api, tiny_model_dir: Path
) -> None:
    api = start_api()
    server = start_server(
        tmp_path_factory, tiny_model_dir, "--dtype", "float32", "--served-model-name", "tiny"
    )
    env_proc = trainer = None
    save_path = tmp_path / "ckpt"
    try:
        before = _probe(server.url)
        env_log = open(tmp_path / "env.log", "wb")  # noqa: SIM115 - closed below
        env_proc = subprocess.Popen(
            [
                sys.executable,
                str(LENGTH_ENV),
                "serve",
                "--env.rollout_server_url",
                api.url,
                "--env.group_size",
                "4",
                "--env.batch_size",
                "8",
                "--env.total_steps",
                "3",
                "--env.tokenizer_name",
                str(tiny_model_dir),
                "--env.use_wandb",
                "false",
                "--env.steps_per_eval",
                "0",
                "--env.max_token_length",
                "256",
                "--openai.base_url",
                server.url + "/v1",
                "--openai.model_name",
                "tiny",
            ],
            stdout=env_log,
            stderr=subprocess.STDOUT,
            env=ENV,
        )
        trainer = subprocess.run(
            _trainer_cmd(
                tiny_model_dir,
                api.url,
                save_path,
                "--training-steps",
                "3",
                "--inference",
                "atropos-serve",
                "--inference-url",
                server.url,
                "--weight-sync-interval",
                "1",
                "--served-model-name",
                "tiny",
            ),
            capture_output=True,
            text=True,
            env=ENV,
            timeout=400,
        )
        assert trainer.returncode == 0, trainer.stderr[-4000:]
        assert env_proc.wait(60) == 0, (tmp_path / "env.log").read_text()[-3000:]
        env_log.close()

        metrics = _metrics(save_path)
        assert [m["step"] for m in metrics] == [1, 2, 3]
        assert all(math.isfinite(m["loss"]) for m in metrics)
        assert all(m["sync_seconds"] > 0 for m in metrics)
        assert any(m["grad_norm"] > 0 for m in metrics)
        # throughput figures say what they count: positions run (packed, each shared prompt
        # once) are fewer than the batch's tokens, trained ones fewer still
        stepped = [m for m in metrics if m["optimizer_step"]]
        assert stepped
        for m in stepped:
            assert m["trained_tokens_per_s"] < m["computed_tokens_per_s"]
            assert m["computed_tokens_per_s"] < m["batch_tokens_per_s"]
            assert m["mfu"] > 0 and "tokens_per_s" not in m
        # the env sent sampler logprobs: the ratio was computed against them
        assert metrics[0]["offpolicy_fraction"] == pytest.approx(1.0)
        assert metrics[0]["mean_ratio"] == pytest.approx(1.0, abs=0.05)
        for line in ("step 1", "step 3", "sync"):
            assert line in trainer.stderr

        # a server on loopback is synced through shared memory: no step_N folder per sync,
        # the end writes final_model only (resumable)
        assert all(m["sync_through_shm"] == 1.0 for m in metrics)
        # the sync's figure is the sync: the end's final_model is a checkpoint of its own
        assert all(m["sync_seconds"] == m["reload_seconds"] for m in metrics)
        assert [m.get("checkpoint_seconds", 0.0) > 0 for m in metrics] == [False, False, True]
        assert "checkpoint" in trainer.stderr.split("step 3", 1)[1]
        assert not list(save_path.glob("step_*"))
        assert (save_path / "final_model" / "trainer_state.pt").is_file()
        initial = load_file(tiny_model_dir / "model.safetensors")
        final = load_file(save_path / "final_model" / "model.safetensors")
        changed = [k for k in initial if not (initial[k] == final[k]).all()]
        assert len(changed) > len(initial) // 2

        after = _probe(server.url)
        assert after != before  # the server now serves the trained weights
    finally:
        if env_proc is not None and env_proc.poll() is None:
            env_proc.kill()
            env_proc.wait()
        server.stop()
        api.stop()
    assert server.proc.returncode is not None and api.proc.returncode is not None
    assert not _procs_mentioning(str(save_path))


@pytest.mark.slow
def test_resume_continues_the_step_count(tmp_path: Path, start_api, tiny_model_dir: Path) -> None:
    save_path = tmp_path / "ckpt"
    for run, (steps, extra) in enumerate(
        [
            ("2", ["--checkpoint-interval", "1", "--use-wandb", "--wandb-mode", "offline"]),
            ("4", ["--resume", "latest", "--kl-coef", "0.05"]),
        ]
    ):
        api = start_api()
        for group in _tokenized_groups(4):
            assert httpx.post(api.url + "/scored_data", json=group).status_code == 200
        result = subprocess.run(
            _trainer_cmd(
                tiny_model_dir,
                api.url,
                save_path,
                "--training-steps",
                steps,
                "--inference",
                "none",
                *extra,
            ),
            capture_output=True,
            text=True,
            env=ENV,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        if run == 1:
            # registered with starting_step 2, then took 2 batches
            assert httpx.get(api.url + "/status").json()["current_step"] == 4
        api.stop()
    metrics = _metrics(save_path)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    # the resumed run penalises drift from the original model, which it has already left
    assert metrics[1]["kl"] == 0.0 and metrics[2]["kl"] > 0 and metrics[3]["kl"] > 0
    assert "resumed from" in result.stderr and "step_2" in result.stderr
    import torch

    state = torch.load(save_path / "step_4" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4 and state["optimizer"]["state"]  # optimizer state carried on
    assert (save_path / "step_3").is_dir() and not (
        save_path / "step_3" / "trainer_state.pt"
    ).exists()
    assert list((save_path / "wandb").glob("offline-run-*")), "W&B offline run not written"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("min_steps", "extra", "reason"),
    [
        ("1", ["--batch-timeout", "600"], "the time its training still had"),
        # below min_steps, and no --batch-timeout (which used to mean waiting without end)
        ("4", [], "2 of min_steps 4 taken"),
    ],
)
def test_time_budget_ends_training_when_no_batch_comes_in_time(
    tmp_path: Path, start_api, tiny_model_dir: Path, min_steps: str, extra: list[str], reason: str
) -> None:
    """``--max-time``: with data for two steps of five, the trainer does not wait for a third
    batch past its budget: step 2 becomes the last (final_model), the reason is logged. Below
    ``--min-steps`` it waits until the budget is spent (and at least a quarter of it), then
    ends all the same, with a warning."""
    api = start_api()
    for group in _tokenized_groups(4):  # two batches of 2 groups
        assert httpx.post(api.url + "/scored_data", json=group).status_code == 200
    save_path = tmp_path / "ckpt"
    started = time.monotonic()
    result = subprocess.run(
        _trainer_cmd(
            tiny_model_dir, api.url, save_path, "--training-steps", "5", "--inference", "none",
            "--max-time", "40", "--min-steps", min_steps, *extra,
        ),
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )  # fmt: skip
    took = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-4000:]
    assert [m["step"] for m in _metrics(save_path)] == [1, 2]
    assert (save_path / "final_model" / "model.safetensors").is_file()
    assert "step 2 is the last one: time budget 40 s: no batch for step 3 within " in result.stderr
    assert reason in result.stderr
    assert took < 120  # not the 600-s batch timeout, nor a wait without end
    api.stop()


def _quickstart(tmp_path: Path, model: Path, steps: int, api_port: int, inf_port: int, *extra: str):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "example_trainer.quickstart",
            "--model",
            str(model),
            "--env",
            str(LENGTH_ENV),
            "--steps",
            str(steps),
            "--output",
            str(tmp_path / "out"),
            "--api-port",
            str(api_port),
            "--inference-port",
            str(inf_port),
            "--batch-timeout",
            "180",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        cwd=tmp_path,
    )


@pytest.mark.slow
def test_quickstart_runs_the_loop_and_cleans_up(tmp_path: Path, tiny_model_dir: Path) -> None:
    api_port, inf_port = free_port(), free_port()
    # up to 4 steps, but a 1-second time budget ends training once --min-steps (2) are taken:
    # step 2 is the last (final_model, the "after" evaluation) as if it were --steps
    proc = _quickstart(
        tmp_path, tiny_model_dir, 4, api_port, inf_port,
        "--eval", "--eval-every", "1", "--env-arg", "env.num_eval_problems=20",
        "--max-time", "1", "--min-steps", "2",
    )  # fmt: skip
    output, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, output[-4000:]
    out = tmp_path / "out"
    assert (out / "rollouts.jsonl").stat().st_size > 0
    page = (out / "rollouts.html").read_text()
    assert "step 0 &middot;" in page and "mean score" in page  # group headers
    # no checkpoint was asked for and atropos-serve on loopback is synced through shared
    # memory: no step_N per sync, only final_model (keep_checkpoints=0: without optimizer state)
    assert not list((out / "checkpoints").glob("step_*"))
    assert (out / "final_model" / "config.json").is_file()
    assert not (out / "final_model" / "trainer_state.pt").exists()
    records = _metrics(out)
    # the base model's evaluation (step 0), then every step, with the held-out numbers
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all("eval/percent_correct" in r for r in records)
    assert [("reward_mean" in r) for r in records] == [False, True, True]
    for label in ("before", "after"):
        result = json.loads((out / f"eval_{label}.json").read_text())["results"]["all"]
        assert 0.0 <= result["eval/percent_correct"] <= 1.0
        assert len((out / "evals" / label / "samples.jsonl").read_text().splitlines()) == 20
        assert "20/20" in (out / "evals" / label / "evaluate.log").read_text()  # progress bar
    assert (out / "evals" / "step_1" / "metrics.json").is_file()
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "held-out (greedy)" in output and "eval/percent_correct" in output  # the table
    # the three evaluations ran in one evaluation process (env set up once)
    for name in ("run-api.log", "atropos-serve.log", "env.log", "evaluator.log"):
        assert (out / "logs" / name).is_file()
    assert f"Everything is in {out}" in output and "rollouts.html" in output
    assert "steps         2 of up to 4 (time budget 1 s: 0 s left, one more step takes ~" in output
    assert "step 2 is the last one: time budget 1 s" in output
    # the env still rolling out is stopped before the "after" evaluation, not reported failed
    after = output.index("held-out evaluation (after)")
    assert 0 < output.index("env: stopped (training is over") < after
    # the "before" evaluation's time, kept for --resume's budget
    assert records[0]["eval_seconds"] > 0
    # what became of every group: run-api's counters, with what the env dropped before sending
    queue = json.loads((out / "run-api-metrics.json").read_text())
    assert f"run-api: {queue['accepted_groups']} groups accepted" in output
    for reason, count in queue["env_dropped"].items():
        assert "dropped by the env before sending: " in output and f"{reason} {count}" in output
    # stopped before the quickstart exits
    workers = _procs_mentioning("example_trainer.eval_worker")
    assert not [c for c in workers if f"127.0.0.1:{inf_port}/" in c], workers
    for port in (api_port, inf_port):
        assert not _wait_gone(f"--port {port}"), f"a child on port {port} is still running"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


@pytest.mark.slow
def test_quickstart_evaluates_the_last_step_when_the_budget_ends_a_wait(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The env stops once run-api holds data for its total_steps (2; it sends a little ahead),
    well short of --steps 6: the trainer's wait for the next batch ends with the time budget,
    and the last step's weights get the "after" evaluation. The output folder held an earlier
    run: its files are moved aside, so the new run's records are its own."""
    out = tmp_path / "out"
    (out / "final_model").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
    (out / "eval_before.json").write_text("{}")
    (out / "notes.txt").write_text("mine")  # not a run's file: stays
    proc = _quickstart(
        tmp_path, tiny_model_dir, 6, free_port(), free_port(),
        "--eval", "--env-arg", "env.num_eval_problems=10", "--env-arg", "env.total_steps=2",
        "--max-time", "75", "--min-steps", "2",
    )  # fmt: skip
    output, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, output[-4000:]
    found = re.search(
        r"step (\d) is the last one: time budget 1 min 15 s: no batch for step (\d) within", output
    )
    assert found, output[-4000:]
    last = int(found.group(1))
    assert 2 <= last < 6 and int(found.group(2)) == last + 1
    assert f"steps         {last} of up to 6 (time budget 1 min 15 s: no batch for step" in output
    records = _metrics(out)
    # the trainer's steps, then the "after" evaluation of the last step's weights (not step 7
    # of the earlier run)
    assert [r["step"] for r in records] == [0, *range(1, last + 1), last]
    assert "eval/percent_correct" in records[-1] and "reward_mean" not in records[-1]
    assert (out / "eval_after.json").is_file() and (out / "final_model" / "config.json").is_file()
    assert "held-out (greedy)" in output
    (earlier,) = (out / "previous").iterdir()
    assert f"{out} held an earlier run: moved to {earlier}" in output
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 7, "loss": 1.0}\n'
    assert sorted(p.name for p in earlier.iterdir()) == [
        "eval_before.json", "final_model", "metrics.jsonl",
    ]  # fmt: skip
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_quickstart_ctrl_c_stops_every_child(tmp_path: Path, tiny_model_dir: Path) -> None:
    api_port, inf_port = free_port(), free_port()
    proc = _quickstart(tmp_path, tiny_model_dir, 50, api_port, inf_port)
    env_log = tmp_path / "out" / "logs" / "env.log"
    deadline = time.monotonic() + 180
    while not (env_log.is_file() and "Registered env" in env_log.read_text(errors="replace")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted" in output
    # the closing summary says the run stopped early, not that it finished
    assert "atropos-quickstart stopped after" in output and "finished in" not in output
    for port in (api_port, inf_port):
        assert not _wait_gone(f"--port {port}"), f"a child on port {port} is still running"
    assert not _wait_gone(str(tmp_path / "out"))


@pytest.mark.nightly  # per-commit CI budget; the reaper itself: test_inference_process.py
@pytest.mark.slow
def test_quickstart_repeated_ctrl_c_exits_quietly(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Three Ctrl-C in a row: one line per interrupt, no traceback, exit 130, children gone."""
    api_port, inf_port = free_port(), free_port()
    proc = _quickstart(tmp_path, tiny_model_dir, 50, api_port, inf_port)
    env_log = tmp_path / "out" / "logs" / "env.log"
    deadline = time.monotonic() + 180
    while not (env_log.is_file() and "Registered env" in env_log.read_text(errors="replace")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    for _ in range(3):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert "interrupted again; exiting now" in output
    for port in (api_port, inf_port):
        assert not _wait_gone(f"--port {port}", 10), f"a child on port {port} is still running"
    assert not _wait_gone(str(tmp_path / "out"), 10)


@pytest.mark.nightly  # per-commit CI budget; the reaper itself: test_inference_process.py
@pytest.mark.slow
def test_quickstart_sigkill_still_stops_every_child(tmp_path: Path, tiny_model_dir: Path) -> None:
    """SIGKILL leaves quickstart no chance to clean up; its reaper stops run-api, atropos-serve
    and the env anyway."""
    api_port, inf_port = free_port(), free_port()
    proc = _quickstart(tmp_path, tiny_model_dir, 50, api_port, inf_port)
    env_log = tmp_path / "out" / "logs" / "env.log"
    deadline = time.monotonic() + 180
    while not (env_log.is_file() and "Registered env" in env_log.read_text(errors="replace")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    for port in (api_port, inf_port):
        assert _procs_mentioning(f"--port {port}"), f"no child on port {port}"
    assert _procs_mentioning(str(tmp_path / "out"))  # the env
    proc.kill()
    proc.wait(10)
    for port in (api_port, inf_port):
        assert not _wait_gone(f"--port {port}", 10), f"a child on port {port} outlived SIGKILL"
    assert not _wait_gone(str(tmp_path / "out"), 10)


@pytest.mark.slow
def test_trainer_restarts_vllm_on_each_sync(
    tmp_path: Path, start_api, tiny_model_dir: Path
) -> None:
    """The trainer's vLLM path end to end, with a stand-in ``vllm`` package on PYTHONPATH."""
    package = tmp_path / "fakepkg" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(
        f"import runpy\nrunpy.run_path({str(Path(__file__).with_name('fake_vllm.py'))!r}, "
        "run_name='__main__')\n"
    )
    api = start_api()
    for group in _tokenized_groups(6):
        assert httpx.post(api.url + "/scored_data", json=group).status_code == 200
    record = tmp_path / "launches.jsonl"
    port = free_port()
    result = subprocess.run(
        _trainer_cmd(
            tiny_model_dir,
            api.url,
            tmp_path / "ckpt",
            "--training-steps",
            "3",
            "--inference",
            "vllm",
            "--vllm-port",
            str(port),
            "--weight-sync-interval",
            "1",
            "--served-model-name",
            "policy",
            "--weight-sync",
            "restart",
        ),
        capture_output=True,
        text=True,
        env={**ENV, "PYTHONPATH": str(tmp_path / "fakepkg"), "FAKE_VLLM_RECORD": str(record)},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    launches = [json.loads(line) for line in record.read_text().splitlines()]
    # launched on the base model, relaunched after steps 1 and 2; none after the last step
    assert [Path(x["model"]).name for x in launches] == [tiny_model_dir.name, "step_1", "step_2"]
    assert {x["served_model_name"] for x in launches} == {"policy"}
    metrics = _metrics(tmp_path / "ckpt")
    assert [m["reload_seconds"] > 0 for m in metrics] == [True, True, False]
    for launch in launches:  # every server the trainer launched, and its children, are gone
        assert _pid_gone(launch["pid"]) and _pid_gone(launch["grandchild"])
    assert not _procs_mentioning(f"--port {port}")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--env", "no_such_env"], "--env 'no_such_env': not found"),
        (["--env", "missing.py"], "--env 'missing.py': no such file"),
        (
            ["--batch-size", "6", "--group-size", "4"],
            "--batch-size '6': must be a multiple of --group-size (4)",
        ),
        (["--steps", "0"], "--steps '0': Input should be greater than or equal to 1"),
        (["--recipe", "nope"], "--recipe 'nope': Input should be 'arithmetic-learn' or"),
        (["--env-arg", "env.x"], "--env-arg 'env.x': expected FLAG=VALUE"),
        (["--trainer-arg", "nope=1"], "--trainer-arg 'nope=1': expected FIELD=VALUE"),
        # a value that starts with "-" is attached with "=" (--env-arg=--env.x=1)
        (["--env-arg", "--env.x=1"], "argument --env-arg/--env_arg: expected one argument"),
        (["--resume"], "--resume: no run to resume"),
        (["--max-time", "soon"], "--max-time 'soon': Value error, not a duration: 'soon' ("),
        (["--max-time", "0"], "--max-time '0': Value error, a duration must be positive"),
        (["--trainer", "trl", "--max-time", "60"], "--max-time: only with --trainer grpo"),
    ],
)
def test_quickstart_bad_flags_are_named(tmp_path: Path, argv: list[str], message: str) -> None:
    """A bad flag is a usage error, as in every atroposlib command: exit 2, the flag named,
    before anything starts."""
    result = subprocess.run(
        [sys.executable, "-m", "example_trainer.quickstart", "--output", str(tmp_path), *argv],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert f"atropos-quickstart: error: {message}" in result.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started
    if "not found" in message:
        assert "arithmetic" in result.stderr  # lists the known environments


def test_quickstart_reports_a_bad_flag_before_loading_torch_or_the_api(tmp_path: Path) -> None:
    """Flags are checked before the heavy imports (torch, transformers, the API server's
    modules: seconds on a small CPU), so a typo is answered at once."""
    code = (
        "import sys\n"
        "from example_trainer.quickstart import parse_args\n"
        "try:\n"
        f"    parse_args(['--output', {str(tmp_path)!r}, '--steps', '0'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 2, exc.code\n"
        "heavy = ('torch', 'transformers', 'atroposlib.api.server')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "--steps '0'" in result.stderr
    assert result.stdout.strip() == "[]"
