"""``check_trainer``: run a trainer against a real run-api and a scripted env, and name every
rule of the trainer's half of the contract it breaks.

The check owns every process: run-api (``--store``, so redelivery is the real mechanism),
optionally ``atropos-serve`` with the model, a loopback proxy between the trainer and run-api
(:mod:`atroposlib.testing.proxy`: records the trainer's calls, cuts one ``/batch`` response
mid-way), the scripted env (a thread: ``/register-env``, then the groups of
:mod:`atroposlib.testing.scenario` through ``/scored_data``) and the trainer command. The
trainer learns where everything is from environment variables (:data:`TRAINER_ENV`) and
writes what it trained on to ``$ATROPOS_TRAINER_REPORT`` (:mod:`atroposlib.testing.report`).
Expectations come from :mod:`atroposlib.testing.expected`. The contract, the variables and
what each failure means: ``docs/check-trainer.md``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field

from atroposlib.testing.expected import ExpectedRow, expected_rows, same_sign
from atroposlib.testing.proxy import BatchProxy, ProxyCall
from atroposlib.testing.report import (
    REPORT_ENV,
    ReportedSequence,
    ReportError,
    TrainerReportData,
    read_report,
)
from atroposlib.testing.scenario import Scenario, ScriptedGroup, build_scenario
from atroposlib.utils.api_key import API_KEY_ENV, api_key_headers, resolve_api_key
from atroposlib.utils.processes import ChildProcess, ProcessLaunchError

logger = logging.getLogger(__name__)

__all__ = [
    "RULES",
    "TRAINER_ENV",
    "CheckResult",
    "CheckTrainerOptions",
    "RuleResult",
    "check_trainer",
]

#: The environment variables the trainer command gets (``$NAME`` in its arguments is replaced).
TRAINER_ENV: dict[str, str] = {
    "ATROPOS_API_URL": "run-api's URL (through the check's proxy): register and pull batches here",
    "ATROPOS_INFERENCE_URL": "the atropos-serve the check started (only with --serve): sync "
    "weights to it (POST /reload_weights, policy_version = step)",
    "ATROPOS_CHECK_MODEL": "the model folder to train (transformers format)",
    REPORT_ENV: "the report file to write (atroposlib.testing.TrainerReport)",
    "ATROPOS_CHECK_OUTPUT": "a folder for the trainer's output: save the final model in "
    "final_model/ inside it (transformers format) for the weight-based check",
    "ATROPOS_CHECK_STEPS": "optimizer steps to take: one per batch",
    "ATROPOS_CHECK_BATCH_SIZE": "sequences per batch: register with this batch_size",
    "ATROPOS_CHECK_GROUP_SIZE": "sequences per group (only with --group-size)",
    "ATROPOS_CHECK_MAX_TOKEN_LEN": "the longest sequence sent: register max_token_len >= this",
}

#: Every rule the check reports, in its output's order, with what it means.
RULES: dict[str, str] = {
    "trainer_runs": "the trainer command ran to completion (exit status 0) within the timeout",
    "register": "POST /register with batch_size = ATROPOS_CHECK_BATCH_SIZE and a max_token_len "
    "that admits every group",
    "ack": "every GET /batch after the first batch carries ack=<X-Atropos-Step of the last "
    "batch received>",
    "redelivery": "the batch whose response was lost is fetched again (same ack) and trained once",
    "trained_once": "every sequence handed out is trained exactly once (rows with advantage 0 on "
    "every trained token may be left out)",
    "tokens": "trained on the exact token ids handed out (no re-tokenising, labels aligned)",
    "masks": "exactly the tokens with masks != -100 are trained (never the prompt)",
    "multi_turn_masks": "masked env/tool/user tokens inside a completion are not trained",
    "advantage_sign": "advantages from scores: sign of (score - mean) / std; a group of one "
    "keeps its score; equal scores give 0",
    "advantage_value": "the same, in value (only for a trainer that claims the standard "
    "normalisation: TrainerReport(standard_advantages=True))",
    "explicit_advantages": "a group's advantages (per token, or one per sequence) are used "
    "instead of its scores",
    "set_advantage_to_zero": "the flagged sequence gets advantage 0 (or is left out); the other "
    "members keep the advantages computed with its score counted",
    "policy_version": "reported policy versions are the groups'; with --serve the server "
    "reports the trainer's last step as policy_version",
    "report": "the report exists and is in the format",
    "weights": "the trained weights moved the log-probabilities in the direction of the "
    "advantages (sum of advantage x change in log-prob over trained tokens > 0)",
}

ZERO_TOLERANCE = 1e-6
VALUE_ATOL = 1e-3
VALUE_RTOL = 1e-3
EXAMPLES = 4
CUT_NTH = 2
STARVED_AFTER_S = 5.0


class CheckTrainerOptions(BaseModel):
    """Options of ``atropos-check-trainer`` (the trainer command comes after ``--``)."""

    model: str | None = Field(
        default=None,
        description="Model folder the trainer trains (ATROPOS_CHECK_MODEL); default: a tiny "
        "random Llama with the SmolLM2 tokenizer, built in the work folder (needs torch).",
    )
    group_size: int | None = Field(
        default=None,
        ge=2,
        description="Send only groups of exactly this many sequences, for trainers that need "
        "it (TRL GRPOTrainer: num_generations); batches hold two groups. Default: mixed group "
        "sizes (1 to 5) in batches of 8.",
    )
    serve: bool = Field(
        default=False,
        description="Start atropos-serve with the model (ATROPOS_INFERENCE_URL): the trainer "
        "must sync its weights to it, and the weight-based check reads log-probabilities from "
        "it.",
    )
    workdir: str | None = Field(
        default=None,
        description="Folder for logs, run-api's store, the report and the trainer's output "
        "(default: a new temporary folder; it is kept).",
    )
    timeout: float = Field(
        default=600.0, gt=0, description="Seconds the trainer command may run before it is stopped."
    )


# ------------------------------------------------------------------------------- results


@dataclass
class RuleResult:
    """One rule's outcome: ``pass``, ``fail`` or ``skip`` (not checked, with the reason)."""

    name: str
    status: Literal["pass", "fail", "skip"] = "pass"
    detail: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def description(self) -> str:
        return RULES[self.name]


@dataclass
class CheckResult:
    """Every rule's outcome, where the logs are, and what the run did not cover."""

    rules: list[RuleResult]
    workdir: Path
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.status != "fail" for r in self.rules)

    @property
    def failed(self) -> list[str]:
        """Names of the failed rules."""
        return [r.name for r in self.rules if r.status == "fail"]

    def rule(self, name: str) -> RuleResult:
        return next(r for r in self.rules if r.name == name)

    def render(self) -> str:
        """The readable report ``atropos-check-trainer`` prints."""
        failed = self.failed
        head = "PASS" if not failed else f"FAIL ({len(failed)} of {len(self.rules)} rules)"
        lines = [f"atropos-check-trainer: {head}"]
        for r in self.rules:
            lines.append(f"  {r.status.upper():4}  {r.name:22} {r.description}")
            if r.detail:
                lines.append(f"        {'':22} {r.detail}")
            shown = r.problems[:EXAMPLES]
            for problem in shown:
                lines.append(f"        - {problem}")
            if len(r.problems) > len(shown):
                lines.append(f"        ... and {len(r.problems) - len(shown)} more")
        for note in self.notes:
            lines.append(f"note: {note}")
        lines.append(f"logs, report and trainer output: {self.workdir}")
        return "\n".join(lines)


class _Rules:
    def __init__(self) -> None:
        self.results = {name: RuleResult(name) for name in RULES}

    def fail(self, name: str, problem: str) -> None:
        self.results[name].status = "fail"
        self.results[name].problems.append(problem)

    def skip(self, name: str, reason: str) -> None:
        if self.results[name].status != "fail":
            self.results[name].status = "skip"
            self.results[name].detail = reason

    def detail(self, name: str, text: str) -> None:
        self.results[name].detail = text


# ------------------------------------------------------------------------------ the run


@dataclass
class _Seq:
    """One scripted sequence: where it is in the scenario, and what the contract expects."""

    group: ScriptedGroup
    index: int
    expected: ExpectedRow
    unique_prefix: int = 0

    @property
    def where(self) -> str:
        return f"group {self.group.index} ({self.group.feature}) sequence {self.index}"

    @property
    def rule(self) -> str:
        """The rule an advantage mistake on this sequence breaks."""
        payload = self.group.payload
        overrides = payload.get("overrides") or []
        if any(o.get("set_advantage_to_zero") for o in overrides):
            own = overrides[self.index].get("set_advantage_to_zero")
            if own or payload.get("advantages") is None:
                return "set_advantage_to_zero"
        if payload.get("advantages") is not None:
            return "explicit_advantages"
        return "advantage_sign"


@dataclass
class _Run:
    """What happened while the trainer ran."""

    calls: list[ProxyCall] = field(default_factory=list)
    exit_status: int | None = None
    timed_out: bool = False
    starved: bool = False
    seconds: float = 0.0
    env_error: str = ""
    log_tail: str = ""
    before: list[list[float]] | None = None
    after: list[list[float]] | None = None
    weights_note: str = ""
    #: where the log-probabilities came from: "server" (atropos-serve) or "folder"
    probed: str = ""
    served_version: int | None = None


class _ScriptedEnv(threading.Thread):
    """Registers with ``/register-env`` once the trainer took its first batch, then sends the
    scenario's groups in order with ``/scored_data``."""

    def __init__(self, api_url: str, scenario: Scenario) -> None:
        super().__init__(name="atropos-check-env", daemon=True)
        self.api_url = api_url
        self.scenario = scenario
        self.stop = threading.Event()
        self.done = threading.Event()
        self.error = ""

    def run(self) -> None:
        headers = api_key_headers(resolve_api_key(None))
        with httpx.Client(base_url=self.api_url, timeout=30.0, headers=headers) as http:
            try:
                env_id = self._register(http)
                if env_id is None:
                    return
                for group in self.scenario.groups:
                    reply = http.post("/scored_data", json={**group.payload, "env_id": env_id})
                    if reply.status_code != 200:
                        self.error = (
                            f"run-api refused group {group.index} ({group.feature}, "
                            f"{group.size} sequences of up to "
                            f"{max(len(t) for t in group.payload['tokens'])} tokens): HTTP "
                            f"{reply.status_code} {reply.text[:300]}"
                        )
                        return
            except httpx.HTTPError as exc:
                self.error = f"the scripted env could not reach run-api: {exc}"
                return
        self.done.set()

    def _register(self, http: httpx.Client) -> int | None:
        body = {
            "max_token_length": self.scenario.max_token_len,
            "desired_name": "atropos-check-trainer",
            "weight": 1.0,
            "group_size": self.scenario.env_group_size,
        }
        while not self.stop.is_set():
            reply = http.post("/register-env", json=body)
            if reply.status_code == 200 and reply.json().get("status") == "success":
                return int(reply.json()["env_id"])
            self.stop.wait(0.2)  # "wait for trainer to start": until its first /batch
        return None


def _expand(arg: str, variables: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` of the check's variables replaced by their values."""
    return re.sub(
        r"\$(\{)?(ATROPOS_[A-Z_]+)(?(1)\})",
        lambda m: variables.get(m.group(2), m.group(0)),
        arg,
    )


def _clean_env() -> dict[str, str]:
    """Blank every ``ATROPOS_*`` variable but the API key for run-api and atropos-serve, so
    settings from the caller's environment (``ATROPOS_MAX_STALENESS`` ...) do not change the
    run. The key is kept: every party then uses the same one."""
    return {k: "" for k in os.environ if k.startswith("ATROPOS_") and k != API_KEY_ENV}


def _prepare_model(options: CheckTrainerOptions, workdir: Path) -> Path:
    if options.model:
        model = Path(options.model).expanduser().resolve()
        if not (model / "config.json").is_file():
            raise FileNotFoundError(f"--model {model}: no config.json (a transformers folder)")
        return model
    try:
        from atroposlib.inference.models import build_tiny_model
    except ImportError as exc:  # pragma: no cover - the inference extra is not installed
        raise RuntimeError(
            f"building the default tiny model needs torch ({exc}); pass --model FOLDER"
        ) from exc
    return build_tiny_model(workdir / "model", seed=0)


def _vocab_size(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return int(size or 49152)


def check_trainer(
    command: Sequence[str], options: CheckTrainerOptions | None = None, **fields: Any
) -> CheckResult:
    """Run ``command`` (argv; ``$ATROPOS_*`` in its arguments replaced) as the trainer under
    the check, and judge it (the rules: :data:`RULES`).

    ``options`` or keyword ``fields`` of :class:`CheckTrainerOptions`. Raises
    ``ProcessLaunchError`` if run-api or atropos-serve cannot start; everything the trainer
    does wrong is a failed rule in the result, never an exception.
    """
    if options is None:
        options = CheckTrainerOptions(**fields)
    elif fields:
        options = options.model_copy(update=fields)
    if isinstance(command, str):
        raise TypeError(f"command is an argv list, not a string: use ['sh', '-c', {command!r}]")
    if not command:
        raise ValueError("no trainer command given")
    if options.workdir:
        workdir = Path(options.workdir).expanduser().resolve()
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="atropos-check-trainer-"))
    model = _prepare_model(options, workdir)
    scenario = build_scenario(group_size=options.group_size, vocab_size=_vocab_size(model))
    seqs = _scripted_sequences(scenario)
    report_path = workdir / "report.jsonl"
    report_path.unlink(missing_ok=True)
    output = workdir / "trainer-output"
    run = _Run()
    children: list[ChildProcess] = []
    proxy: BatchProxy | None = None
    env: _ScriptedEnv | None = None
    try:
        api = _start_api(workdir, children)
        serve_url = _start_serve(model, workdir, children) if options.serve else None
        if serve_url:
            run.before = _probe_server(serve_url, seqs, run)
        proxy = BatchProxy(api, cut_nth=CUT_NTH).start()
        env = _ScriptedEnv(api, scenario)
        env.start()
        variables = {
            "ATROPOS_API_URL": proxy.url,
            "ATROPOS_CHECK_MODEL": str(model),
            REPORT_ENV: str(report_path),
            "ATROPOS_CHECK_OUTPUT": str(output),
            "ATROPOS_CHECK_STEPS": str(scenario.steps),
            "ATROPOS_CHECK_BATCH_SIZE": str(scenario.batch_size),
            "ATROPOS_CHECK_MAX_TOKEN_LEN": str(scenario.max_token_len),
        }
        if serve_url:
            variables["ATROPOS_INFERENCE_URL"] = serve_url
        if scenario.group_size:
            variables["ATROPOS_CHECK_GROUP_SIZE"] = str(scenario.group_size)
        argv = [_expand(arg, variables) for arg in command]
        # variables this run does not set are blanked, not inherited from the caller
        blank = dict.fromkeys(TRAINER_ENV, "")
        trainer = ChildProcess("trainer", argv, workdir / "trainer.log", env=blank | variables)
        _supervise(trainer, children, proxy, env, scenario, options.timeout, run)
        if serve_url and run.exit_status == 0:
            run.after = _probe_server(serve_url, seqs, run)
            run.served_version = _served_version(serve_url)
    finally:
        if env is not None:
            env.stop.set()
            env.join(10)
            run.env_error = env.error
        if proxy is not None:
            run.calls = sorted(proxy.calls, key=lambda c: c.time)
            proxy.close()
        for child in reversed(children):
            child.stop()
    if not options.serve and run.exit_status == 0:
        _probe_folders(model, output / "final_model", seqs, run)
    result = _judge(scenario, seqs, run, report_path, options, workdir)
    (workdir / "result.txt").write_text(result.render() + "\n")
    return result


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_api(workdir: Path, children: list[ChildProcess]) -> str:
    port = _free_port()
    api = ChildProcess(
        "run-api",
        [sys.executable, "-m", "atroposlib.cli.run_api", "--host", "127.0.0.1", "--port",
         str(port), "--store", str(workdir / "run-api.sqlite3"), "--log-level", "info"],
        workdir / "run-api.log",
        env=_clean_env(),
    )  # fmt: skip
    children.append(api.start())
    url = f"http://127.0.0.1:{port}"
    api.wait_ready(url + "/health", timeout=60)
    return url


def _start_serve(model: Path, workdir: Path, children: list[ChildProcess]) -> str:
    port = _free_port()
    serve = ChildProcess(
        "atropos-serve",
        [sys.executable, "-m", "atroposlib.inference.cli", "--model", str(model), "--port",
         str(port), "--dtype", "float32", "--log-level", "warning"],
        workdir / "atropos-serve.log",
        env={**_clean_env(), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    children.append(serve.start())
    url = f"http://127.0.0.1:{port}"
    serve.wait_ready(url + "/health", timeout=180)
    return url


def _supervise(
    trainer: ChildProcess,
    children: list[ChildProcess],
    proxy: BatchProxy,
    env: _ScriptedEnv,
    scenario: Scenario,
    timeout: float,
    run: _Run,
) -> None:
    """Run the trainer to its end, the timeout, or starvation: it keeps asking for a batch
    that can no longer come (every group was handed out and it received fewer batches than it
    needs, or run-api refused the env's groups)."""
    total = sum(g.size for g in scenario.groups)
    started = time.monotonic()
    try:
        children.append(trainer.start())
    except ProcessLaunchError as exc:
        run.exit_status, run.log_tail = 127, str(exc)
        return
    starving_since: float | None = None
    while trainer.running:
        time.sleep(0.2)
        now = time.monotonic()
        if now - started > timeout:
            run.timed_out = True
            break
        calls = proxy.calls
        handed = {tuple(t) for c in calls if c.batch for g in c.batch for t in g["tokens"]}
        received = {c.step for c in calls if c.batch and not c.cut}
        last = next((c for c in reversed(calls) if c.path == "/batch"), None)
        exhausted = env.done.is_set() and len(handed) >= total
        if (
            (exhausted or env.error)
            and len(received) < scenario.steps
            and last is not None
            and last.batch is None
        ):
            starving_since = starving_since or now
            if now - starving_since > STARVED_AFTER_S:
                run.starved = True
                break
        else:
            starving_since = None
    run.seconds = time.monotonic() - started
    run.exit_status = trainer.stop()
    run.log_tail = trainer.log_tail(2500)


def _scripted_sequences(scenario: Scenario) -> list[_Seq]:
    seqs = [
        _Seq(group, i, row)
        for group in scenario.groups
        for i, row in enumerate(expected_rows(group.payload))
    ]
    for s in seqs:  # shortest beginning no other sequence shares
        u = 1
        while any(o is not s and o.expected.tokens[:u] == s.expected.tokens[:u] for o in seqs):
            u += 1
        s.unique_prefix = u
    return seqs


def _probe_server(url: str, seqs: list[_Seq], run: _Run) -> list[list[float]] | None:
    from atroposlib.testing.probe import server_logprobs

    run.probed = "server"
    try:
        return server_logprobs(url, [s.expected.tokens for s in seqs])
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        run.weights_note = f"could not read log-probabilities from atropos-serve: {exc}"
        return None


def _served_version(url: str) -> int | None:
    try:
        return int(httpx.get(url + "/policy_version", timeout=10).json()["policy_version"])
    except (httpx.HTTPError, KeyError, ValueError, TypeError):
        return None


def _probe_folders(model: Path, final: Path, seqs: list[_Seq], run: _Run) -> None:
    if not (final / "config.json").is_file():
        run.weights_note = (
            "the trainer saved no model in $ATROPOS_CHECK_OUTPUT/final_model and --serve is off"
        )
        return
    try:
        from atroposlib.testing.probe import folder_logprobs

        tokens = [s.expected.tokens for s in seqs]
        run.before = folder_logprobs(model, tokens)
        run.after = folder_logprobs(final, tokens)
        run.probed = "folder"
    except Exception as exc:  # noqa: BLE001 - any loading failure is reported as the rule's
        run.weights_note = f"could not load {final}: {type(exc).__name__}: {exc}"


# -------------------------------------------------------------------------------- judging


def _judge(
    scenario: Scenario,
    seqs: list[_Seq],
    run: _Run,
    report_path: Path,
    options: CheckTrainerOptions,
    workdir: Path,
) -> CheckResult:
    rules = _Rules()
    _judge_process(rules, run, scenario)
    _judge_register(rules, run, scenario)
    _judge_ack(rules, run)
    report = _read(rules, report_path)
    rows = _match(rules, report, seqs) if report is not None else None
    _judge_delivery(rules, run, seqs, rows)
    if rows is None:
        for name in ("tokens", "masks", "multi_turn_masks", "advantage_sign", "advantage_value",
                     "explicit_advantages", "set_advantage_to_zero"):  # fmt: skip
            rules.skip(name, "no report to read")
    else:
        assert report is not None
        _judge_rows(rules, seqs, rows, report.standard_advantages)
    _judge_versions(rules, run, seqs, rows, scenario, options)
    _judge_weights(rules, run, seqs)
    notes = list(scenario.notes)
    if not options.serve:
        notes.append("weight sync to an inference server not checked (--serve is off)")
    return CheckResult(list(rules.results.values()), workdir, notes)


def _judge_process(rules: _Rules, run: _Run, scenario: Scenario) -> None:
    tail = "\n          ".join(run.log_tail.strip().splitlines()[-12:])
    if run.timed_out:
        rules.fail(
            "trainer_runs", f"still running after --timeout; stopped. Log:\n          {tail}"
        )
    elif run.starved and run.env_error:
        rules.fail(
            "trainer_runs",
            "waited for batches run-api could not form: it refused the env's groups (see "
            "'register'); stopped",
        )
    elif run.starved:
        rules.fail(
            "trainer_runs",
            f"waited for a batch after every group had been handed out, having received fewer "
            f"than ATROPOS_CHECK_STEPS={scenario.steps} batches (a lost batch never came back?); "
            "stopped",
        )
    elif run.exit_status != 0:
        rules.fail("trainer_runs", f"exited with status {run.exit_status}. Log:\n          {tail}")
    else:
        rules.detail("trainer_runs", f"{run.seconds:.1f} s")


def _judge_register(rules: _Rules, run: _Run, scenario: Scenario) -> None:
    registrations = [c.register for c in run.calls if c.register is not None]
    if not registrations:
        rules.fail("register", "the trainer never called POST /register at $ATROPOS_API_URL")
        return
    first = registrations[0]
    if first.get("batch_size") != scenario.batch_size:
        rules.fail(
            "register",
            f"registered batch_size={first.get('batch_size')}, not "
            f"ATROPOS_CHECK_BATCH_SIZE={scenario.batch_size}",
        )
    limit = first.get("max_token_len", 0)
    if isinstance(limit, int) and 0 < limit < scenario.max_token_len:
        rules.fail(
            "register",
            f"registered max_token_len={limit}, below ATROPOS_CHECK_MAX_TOKEN_LEN="
            f"{scenario.max_token_len}",
        )
    if run.env_error:
        rules.fail("register", run.env_error)


def _judge_ack(rules: _Rules, run: _Run) -> None:
    batch_calls = [c for c in run.calls if c.path == "/batch"]
    last: int | None = None
    cut_steps = {c.step for c in batch_calls if c.cut}
    checked = 0
    for n, call in enumerate(batch_calls, 1):
        if last is not None:
            checked += 1
            if call.ack is None:
                rules.fail(
                    "ack", f"GET /batch #{n} carried no ack (last batch received: step {last})"
                )
            elif call.ack in cut_steps and call.ack > last:
                rules.fail(
                    "ack",
                    f"GET /batch #{n} acknowledged step {call.ack}, whose response it never "
                    "received complete (read X-Atropos-Step only once the body is read)",
                )
            elif call.ack != last:
                rules.fail(
                    "ack",
                    f"GET /batch #{n} carried ack={call.ack}; the last batch received was step "
                    f"{last}",
                )
        if call.batch and not call.cut:
            last = call.step
    if checked == 0 and rules.results["ack"].status != "fail":
        rules.skip("ack", "the trainer made no GET /batch after receiving a batch")


def _read(rules: _Rules, path: Path) -> TrainerReportData | None:
    if not path.is_file():
        rules.fail(
            "report",
            f"no report at $ATROPOS_TRAINER_REPORT ({path}): write it with "
            "atroposlib.testing.TrainerReport (or report_from_env())",
        )
        return None
    try:
        report = read_report(path)
    except ReportError as exc:
        rules.fail("report", f"{path}: {exc}")
        return None
    if report.writers == 0:
        rules.fail("report", "the report has no 'trainer' record (open it with TrainerReport)")
    claim = "claims" if report.standard_advantages else "does not claim"
    rules.detail(
        "report",
        f"{len(report.sequences)} sequences in {len(set(report.steps))} steps; the trainer "
        f"{claim} the standard normalisation",
    )
    return report


def _match(
    rules: _Rules, report: TrainerReportData, seqs: list[_Seq]
) -> dict[int, list[ReportedSequence]]:
    """Reported rows by the index of the scripted sequence they are (by token prefix)."""
    rows: dict[int, list[ReportedSequence]] = {k: [] for k in range(len(seqs))}
    for row in report.sequences:
        found = None
        for k, s in enumerate(seqs):
            u = s.unique_prefix
            if len(row.tokens) >= u and tuple(row.tokens[:u]) == s.expected.tokens[:u]:
                found = k
                break
        if found is None:
            rules.fail(
                "tokens",
                f"report line {row.line} (step {row.step}): {len(row.tokens)} tokens starting "
                f"{row.tokens[:6]} match no sequence handed out (re-tokenised, or left-padded?)",
            )
        else:
            rows[found].append(row)
    return rows


def _judge_delivery(
    rules: _Rules, run: _Run, seqs: list[_Seq], rows: dict[int, list[ReportedSequence]] | None
) -> None:
    deliveries = [c for c in run.calls if c.batch]
    step_of: dict[tuple[int, ...], int | None] = {}
    for call in deliveries:
        if not call.cut:
            for g in call.batch or []:
                for t in g["tokens"]:
                    step_of.setdefault(tuple(t), call.step)
    cut = next((c for c in deliveries if c.cut), None)
    cut_seqs: set[tuple[int, ...]] = set()
    if cut is None:
        rules.fail("redelivery", "the trainer never fetched a second batch (none was lost)")
    else:
        cut_seqs = {tuple(t) for g in cut.batch or [] for t in g["tokens"]}
        again = [c for c in deliveries if c.time > cut.time and c.step == cut.step and not c.cut]
        if not again:
            later = next((c for c in run.calls if c.path == "/batch" and c.time > cut.time), None)
            if later is None:
                ack = "no later GET /batch"
            else:
                ack = "the next GET /batch carried " + (
                    "no ack" if later.ack is None else f"ack={later.ack}"
                )
            rules.fail(
                "redelivery",
                f"the batch of step {cut.step} (its response was cut mid-way) was never handed "
                f"out again ({ack}): with ack=<last step received>, run-api resends it",
            )
        elif not again[0].redelivered:
            rules.fail("redelivery", f"step {cut.step} came again without X-Atropos-Redelivered")
    if rows is None:
        rules.skip("trained_once", "no report to read")
        if rules.results["redelivery"].status != "fail":
            rules.skip("redelivery", "the batch came again; no report to see it trained once")
        return
    left_out = 0
    for k, s in enumerate(seqs):
        times = len(rows[k])
        key = s.expected.tokens
        # a sequence of the lost batch breaks both rules
        names = ("trained_once", "redelivery") if key in cut_seqs else ("trained_once",)
        problem = ""
        if times > 1:
            steps = ", ".join(str(r.step) for r in rows[k])
            problem = f"{s.where}: trained {times} times (steps {steps})"
        elif times == 0 and key in step_of and not s.expected.no_signal:
            problem = f"{s.where}: handed out at step {step_of[key]}, never trained"
        elif times == 0 and key not in step_of:
            if key not in cut_seqs:  # (the lost batch that never came again: said above)
                problem = f"{s.where}: never handed out to the trainer"
        elif times == 0:
            left_out += 1
        for name in names if problem else ():
            rules.fail(name, problem)
    if left_out:
        rules.detail("trained_once", f"{left_out} sequences with advantage 0 left out, as allowed")


def _judge_rows(
    rules: _Rules, seqs: list[_Seq], rows: dict[int, list[ReportedSequence]], standard: bool
) -> None:
    if not standard:
        rules.skip(
            "advantage_value",
            "the trainer does not claim the standard normalisation (signs checked only)",
        )
    for k, s in enumerate(seqs):
        for row in rows[k]:
            _judge_row(rules, s, row, standard)


def _judge_row(rules: _Rules, s: _Seq, row: ReportedSequence, standard: bool) -> None:
    exp = s.expected
    n, m = len(exp.tokens), len(row.tokens)
    where = f"{s.where} (report line {row.line})"
    for j in range(min(n, m)):
        trained_here = bool(row.trained[j])
        padded_end = j == n - 1 and not trained_here and not exp.trained[j]
        if row.tokens[j] != exp.tokens[j] and not padded_end:
            rules.fail(
                "tokens",
                f"{where}: position {j} is token {row.tokens[j]}, the sequence has "
                f"{exp.tokens[j]} there (labels shifted?)",
            )
            return
    first = next((j for j, t in enumerate(exp.trained) if t), n)
    wrong: dict[str, list[int]] = {}
    for j in range(max(n, m)):
        want = j < n and exp.trained[j]
        got = j < m and bool(row.trained[j])
        if got and not want:
            rule = "masks" if j >= n or j < first else "multi_turn_masks"
            wrong.setdefault(rule + ":extra", []).append(j)
        elif want and not got:
            wrong.setdefault("masks:missing", []).append(j)
        elif want and got:
            e, r = exp.advantages[j], row.advantages[j]
            if not same_sign(e, r, ZERO_TOLERANCE):
                wrong.setdefault(s.rule + ":sign", []).append(j)
            elif standard and abs(r - e) > VALUE_ATOL + VALUE_RTOL * abs(e):
                value_rule = "advantage_value" if s.rule == "advantage_sign" else s.rule
                wrong.setdefault(value_rule + ":value", []).append(j)
    for key, positions in wrong.items():
        rule, kind = key.split(":")
        j = positions[0]
        more = f" (and {len(positions) - 1} more positions)" if len(positions) > 1 else ""
        if kind == "extra":
            what = (
                "a prompt token"
                if j < first
                else (
                    "past the end of the sequence"
                    if j >= n
                    else "an env/tool token inside the completion"
                )
            )
            rules.fail(
                rule, f"{where} position {j}: trained, but it is {what} (masks == -100){more}"
            )
        elif kind == "missing":
            rules.fail(rule, f"{where} position {j}: not trained, but masks[{j}] != -100{more}")
        else:
            e, r = exp.advantages[j], row.advantages[j]
            rules.fail(rule, f"{where} position {j}: advantage {r:+.4f}, expected {e:+.4f}{more}")


def _judge_versions(
    rules: _Rules,
    run: _Run,
    seqs: list[_Seq],
    rows: dict[int, list[ReportedSequence]] | None,
    scenario: Scenario,
    options: CheckTrainerOptions,
) -> None:
    checked = []
    if rows is not None:
        reported = [
            (s, r) for k, s in enumerate(seqs) for r in rows[k] if r.policy_version is not None
        ]
        for s, r in reported:
            want = s.group.payload.get("policy_version")
            if r.policy_version != want:
                rules.fail(
                    "policy_version",
                    f"{s.where} (report line {r.line}): policy_version {r.policy_version}, the "
                    f"group's is {want}",
                )
        if reported:
            checked.append(f"{len(reported)} reported versions")
    if options.serve and run.exit_status == 0:
        if run.served_version != scenario.steps:
            rules.fail(
                "policy_version",
                f"atropos-serve reports policy_version {run.served_version} after the trainer's "
                f"last step ({scenario.steps}): sync with policy_version = step",
            )
        checked.append("the served version")
    if checked:
        rules.detail("policy_version", "checked: " + ", ".join(checked))
    else:
        rules.skip(
            "policy_version",
            "the report carries no policy_version and --serve is off",
        )


def _judge_weights(rules: _Rules, run: _Run, seqs: list[_Seq]) -> None:
    if run.before is None or run.after is None:
        rules.skip("weights", run.weights_note or "the trainer did not finish")
        return
    moved = 0.0
    # per rule: (sum over sequences of the mean of A * change, sum of the mean of |A|)
    sums: dict[str, list[float]] = {}
    for s, before, after in zip(seqs, run.before, run.after, strict=True):
        positions = [j for j, t in enumerate(s.expected.trained) if t and s.expected.advantages[j]]
        if not positions:
            continue
        adv = s.expected.advantages
        change = sum(adv[j] * (after[j] - before[j]) for j in positions) / len(positions)
        scale = sum(abs(adv[j]) for j in positions) / len(positions)
        acc = sums.setdefault(s.rule, [0.0, 0.0])
        acc[0] += change
        acc[1] += scale
        moved = max(moved, max(abs(after[j] - before[j]) for j in positions))
    total, scale = (sum(v[k] for v in sums.values()) for k in (0, 1))
    score = total / scale if scale else 0.0
    parts = ", ".join(f"{name} {v[0] / v[1]:+.4f}" for name, v in sorted(sums.items()))
    detail = f"mean advantage x change in log-prob: {score:+.5f} (by rule: {parts})"
    if moved < 1e-6:
        rules.fail(
            "weights",
            "the log-probabilities served by atropos-serve did not change: the trainer did not "
            "sync its weights to $ATROPOS_INFERENCE_URL"
            if run.probed == "server"
            else "the saved final_model gives the starting model's log-probabilities: the "
            "weights were not trained",
        )
    elif not (math.isfinite(score) and score > 0):
        rules.fail("weights", f"{detail}: the weights moved against the advantages")
    else:
        rules.detail("weights", detail)
