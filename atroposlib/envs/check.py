"""``python my_env.py check``: does an environment keep the contract? (``check_env``)

The check runs the environment as ``process`` would, on a few items against a real inference
server, and reports every problem with the method and the field at fault:

* **config**: ``--help`` renders for every command, and the resolved ``--env.*`` /
  ``--openai.*`` settings round-trip through a YAML file (what ``--config`` and
  ``atropos-launch`` hand an env).
* **setup** and **get_next_item** run; an item is returned.
* **collect_trajectories** (then ``postprocess_histories``) runs and returns groups; each group
  is a valid ``ScoredDataGroup`` (``schema.check_group``: field lengths, NaN/inf), of the
  registered size (or its ``group_overrides.group_size``), which the sender would not drop;
  every mask entry is ``-100`` or its token, each sequence trains on something and not on its
  first token (the prompt); ``inference_logprobs`` hold the 1.0 sentinel on masked positions.
* **learning signal** (warnings): groups whose scores are all equal, sequences that reach
  ``max_token_length``, replies that do not end with the end-of-turn token (cut by
  ``max_tokens``).
* **evaluate** runs and returns metrics.

Errors make the check fail (exit 1); warnings are reported and fail only with
``--check.strict``. By default the check starts the embedded ``atropos-serve`` when the
configured server is on this machine and does not answer (``--check.serve``).

From Python (tests)::

    report = check_env(MyEnv, ["--env.group_size", "4", "--openai.base_url", url])
    assert report.ok, report.render()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml
from pydantic import BaseModel, Field, ValidationError

logger = logging.getLogger(__name__)

__all__ = ["CheckOptions", "EnvCheckReport", "Finding", "check_env", "run_check"]

MASK = -100


class CheckOptions(BaseModel):
    """``--check.*``: how ``check`` runs."""

    items: int = Field(default=2, ge=1, description="Items rolled out (one group or more each)")
    evaluate: bool = Field(default=True, description="Run evaluate() once")
    eval_items: int = Field(
        default=4,
        ge=1,
        description="Items evaluate() runs when it goes through run_eval (the rest are skipped)",
    )
    serve: Literal["auto", "never"] = Field(
        default="auto",
        description="auto: start the embedded atropos-serve when the configured server is on "
        "this machine (loopback) and does not answer; never: fail when it does not answer",
    )
    serve_model: str = Field(
        default="",
        description="The model the started atropos-serve loads (default: --openai.model_name)",
    )
    strict: bool = Field(default=False, description="Warnings fail the check too")
    timeout: float = Field(default=900.0, gt=0, description="Seconds for the whole check")


@dataclasses.dataclass
class Finding:
    """One problem: ``level`` (error/warning), ``where`` (the method or setting at fault) and
    what is wrong."""

    level: Literal["error", "warning"]
    where: str
    message: str

    def line(self) -> str:
        return f"{self.level:7} {self.where}: {self.message}"


@dataclasses.dataclass
class EnvCheckReport:
    """What :func:`check_env` found."""

    env: str
    findings: list[Finding] = dataclasses.field(default_factory=list)
    items: int = 0
    groups: int = 0
    sequences: int = 0
    evaluated: dict[str, Any] | None = None
    strict: bool = False
    server: str = ""

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    @property
    def ok(self) -> bool:
        """No errors (and, with ``strict``, no warnings)."""
        return not self.errors and not (self.strict and self.warnings)

    def error(self, where: str, message: str) -> None:
        self.findings.append(Finding("error", where, message))

    def warn(self, where: str, message: str) -> None:
        self.findings.append(Finding("warning", where, message))

    def render(self) -> str:
        """The report as text (one line per finding, then a verdict)."""
        lines = [
            f"check {self.env}: {self.items} item(s), {self.groups} group(s), "
            f"{self.sequences} sequence(s) against {self.server or 'the configured server'}"
        ]
        lines += ["  " + f.line() for f in self.findings]
        if self.evaluated is not None:
            shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in list(self.evaluated.items())[:8])  # fmt: skip
            lines.append(f"  evaluate: {shown}")
        verdict = "ok" if self.ok else "FAILED"
        lines.append(f"{verdict}: {len(self.errors)} error(s), {len(self.warnings)} warning(s)")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- config


def _check_config(env_cls: type, resolved: Any, report: EnvCheckReport) -> None:
    """``--help`` renders; the resolved settings round-trip through YAML."""
    from atroposlib.envs.cli import COMMANDS, CliError, build_parser, resolve_config

    try:
        parser = build_parser(env_cls)
        parser.format_help()
        sub = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
        for command in COMMANDS:
            sub[command].format_help()
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        report.error("config: --help", f"{type(exc).__name__}: {exc}")
        return
    servers = resolved.server_configs
    data: dict[str, Any] = {"env": resolved.env_config.model_dump(mode="json")}
    if isinstance(servers, list) and servers:
        data["openai"] = [s.model_dump(mode="json") for s in servers]
    with tempfile.TemporaryDirectory(prefix="atropos-check-") as tmp:
        path = Path(tmp, "config.yaml")
        try:
            path.write_text(yaml.safe_dump(data, sort_keys=False))
        except yaml.YAMLError as exc:
            report.error("config", f"the settings cannot be written as YAML: {exc}")
            return
        try:
            again = resolve_config(env_cls, [resolved.command, "--config", str(path)])
        except CliError as exc:
            report.error("config", f"the settings do not read back from YAML: {exc.message}")
            return
        except SystemExit as exc:
            report.error("config", f"the settings do not read back from YAML (exit {exc.code})")
            return
    before = resolved.env_config.model_dump(mode="json")
    after = again.env_config.model_dump(mode="json")
    for key in before:
        if before[key] != after.get(key):
            report.error(
                f"config: --env.{key}",
                f"does not round-trip through YAML: {before[key]!r} came back as "
                f"{after.get(key)!r}",
            )


# ---------------------------------------------------------------------------- groups


def _end_tokens(tokenizer: Any) -> set[int]:
    ids = {getattr(tokenizer, "eos_token_id", None)}
    for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<end_of_turn>"):
        try:
            token = tokenizer.convert_tokens_to_ids(name)
        except Exception:  # noqa: BLE001
            continue
        if isinstance(token, int) and token != getattr(tokenizer, "unk_token_id", None):
            ids.add(token)
    return {i for i in ids if isinstance(i, int)}


def _check_one_group(env: Any, group: Any, where: str, report: EnvCheckReport) -> None:
    from atroposlib.envs.group_sender import scored_alike
    from atroposlib.schema import GroupError, ScoredData, check_group

    if not isinstance(group, dict):
        report.error(where, f"returned a {type(group).__name__}, not a ScoredDataGroup (dict)")
        return
    try:
        check_group(ScoredData(**group))
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        report.error(where, f"{field}: {first['msg']}")
        return
    except GroupError as exc:
        report.error(where, str(exc))
        return
    reason = env._check_group(group, abort_on_too_long=False)
    if reason is not None:
        expected = (group.get("group_overrides") or {}).get("group_size", env.config.group_size)
        why = {
            "group_size": f"{len(group['tokens'])} sequences but group_size is {expected} "
            "(set group_overrides.group_size when a group is smaller on purpose)",
        }.get(reason, reason)
        report.error(where, f"the sender would drop this group: {why}")
        return
    report.groups += 1
    tokens, masks, scores = group["tokens"], group["masks"], group["scores"]
    report.sequences += len(tokens)
    logprobs = group.get("inference_logprobs")
    ends = _end_tokens(env.tokenizer)
    budget = getattr(env.config, "max_token_length", 0) or 0
    cut = unterminated = 0
    for i, (seq, mask) in enumerate(zip(tokens, masks, strict=True)):
        bad = next(
            (j for j, (t, m) in enumerate(zip(seq, mask, strict=True)) if m not in (MASK, t)),
            None,
        )
        if bad is not None:
            report.error(
                where,
                f"masks[{i}][{bad}] is {mask[bad]}: a mask entry is -100 (not trained) or the "
                f"token id ({seq[bad]})",
            )
            continue
        trained = [j for j, m in enumerate(mask) if m != MASK]
        if not trained:
            report.error(where, f"masks[{i}]: every position is -100, nothing to train on")
            continue
        if trained[0] == 0:
            lead = next((j for j, m in enumerate(mask) if m == MASK), len(mask))
            report.error(
                where,
                f"masks[{i}]: the prompt is trained on (the first {lead} token(s) carry their "
                "ids); mask the prompt with -100 (ManagedServer / tokenize_for_trainer do)",
            )
        if logprobs is not None:
            wrong = [j for j in range(len(seq)) if mask[j] == MASK and logprobs[i][j] != 1.0]
            if wrong:
                report.warn(
                    where,
                    f"inference_logprobs[{i}][{wrong[0]}] is {logprobs[i][wrong[0]]} on a masked "
                    "position; the convention is 1.0 there",
                )
        if budget and len(seq) >= budget:
            cut += 1
        elif ends and seq[trained[-1]] not in ends:
            unterminated += 1
    if scored_alike(scores):
        report.warn(
            where,
            f"scores: all {len(scores)} equal ({scores[0]}): no learning signal in this group",
        )
    if cut:
        report.warn(
            where,
            f"{cut} of {len(tokens)} sequence(s) reach max_token_length ({budget}): cut by "
            "the budget",
        )
    if unterminated:
        report.warn(
            where,
            f"{unterminated} of {len(tokens)} reply(ies) end without an end-of-turn token: "
            "cut by max_tokens (or a stop string)?",
        )


def _where(exc: BaseException, method: str) -> str:
    """``method`` and the innermost frame of the failure outside the library."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if "/atroposlib/" not in f.filename.replace("\\", "/")]
    at = f" ({Path(own[-1].filename).name}:{own[-1].lineno})" if own else ""
    return f"{method}{at}"


async def _rollouts(env: Any, options: CheckOptions, report: EnvCheckReport) -> None:
    for k in range(options.items):
        try:
            item = await env.get_next_item()
        except Exception as exc:  # noqa: BLE001
            report.error(_where(exc, "get_next_item"), f"{type(exc).__name__}: {exc}")
            return
        if item is None:
            if k == 0:
                report.error("get_next_item", "returned None: no item to roll out")
            return
        report.items += 1
        where = f"collect_trajectories (item {k})"
        try:
            groups, _backlog = await env.collect_trajectories(item)
            groups = await env.postprocess_histories(groups)
        except Exception as exc:  # noqa: BLE001
            report.error(_where(exc, where), f"{type(exc).__name__}: {exc}")
            continue
        if groups is None:
            report.warn(where, "returned no group (the item was dropped)")
            continue
        for group in groups if isinstance(groups, list) else [groups]:
            if group is None:
                report.warn(where, "returned None in its list of groups")
                continue
            _check_one_group(env, group, where, report)
    if report.items and not report.groups and not report.errors:
        report.error(
            "collect_trajectories",
            f"no group in {report.items} item(s): nothing would reach a trainer",
        )


async def _evaluate(env: Any, report: EnvCheckReport) -> None:
    from atroposlib.envs.base import BaseEnv

    if type(env).evaluate is BaseEnv.evaluate:
        report.warn("evaluate", "not implemented: runs have no held-out measurement")
        return
    try:
        result = await env.evaluate()
    except Exception as exc:  # noqa: BLE001
        report.error(_where(exc, "evaluate"), f"{type(exc).__name__}: {exc}")
        return
    if not result and not env._evaluate_logged:
        report.error("evaluate", f"returned {result!r}: no metrics")
        return
    if isinstance(result, dict):
        report.evaluated = result
        bad = [k for k, v in result.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            report.error("evaluate", f"metric {bad[0]} is {result[bad[0]]}")


# ---------------------------------------------------------------------------- server


def _answers(base_url: str) -> bool:
    from atroposlib.envs.server_handling.server_baseline import server_root

    try:
        return httpx.get(server_root(base_url) + "/health", timeout=3.0).status_code < 500
    except httpx.HTTPError:
        return False


def _start_embedded(resolved: Any, options: CheckOptions, report: EnvCheckReport) -> Any:
    """Make sure the first configured server answers: start atropos-serve in its place when it
    is on this machine and does not (``--check.serve auto``). Returns the started
    ``ChildProcess`` (None when nothing was started).

    Raises:
        ConnectionError: the server does not answer and none was started.
    """
    from atroposlib.backends.registry import _loopback, get_backend
    from atroposlib.launch.runner import free_port
    from atroposlib.utils.processes import ChildProcess

    servers = resolved.server_configs
    if not isinstance(servers, list) or not servers:
        return None
    first = servers[0]
    url = first.base_url or ""
    if _answers(url):
        report.server = url
        return None
    if options.serve == "never" or not _loopback(url):
        why = "--check.serve never" if options.serve == "never" else "it is not on this machine"
        raise ConnectionError(
            f"--openai.base_url {url} does not answer GET /health; start it, or let the check "
            f"start the embedded atropos-serve (not done: {why})"
        )
    port = free_port()
    model = options.serve_model or first.model_name
    command = get_backend("atropos-serve").command(
        model, served_model_name=first.model_name, port=port
    )
    log = Path(tempfile.mkdtemp(prefix="atropos-check-serve-")) / "atropos-serve.log"
    logger.info("%s does not answer: starting atropos-serve (%s) on port %d", url, model, port)
    child = ChildProcess("atropos-serve", command, log).start()
    try:
        child.wait_ready(f"http://127.0.0.1:{port}/health", timeout=300)
    except Exception:
        child.stop()
        raise
    local = f"http://127.0.0.1:{port}/v1"
    for server in servers:
        if _loopback(server.base_url or ""):
            server.base_url = local
    report.server = f"{local} (embedded atropos-serve, {model})"
    return child


# ---------------------------------------------------------------------------- entry points


async def _run(env_cls: type, resolved: Any, options: CheckOptions, report: EnvCheckReport) -> None:
    from atroposlib.envs.cli import build_env

    env = build_env(env_cls, resolved)
    try:
        try:
            await env.setup()
        except Exception as exc:  # noqa: BLE001
            report.error(_where(exc, "setup"), f"{type(exc).__name__}: {exc}")
            return
        await _rollouts(env, options, report)
        if options.evaluate:
            from atroposlib.envs.eval import EVAL_ITEM_LIMIT

            token = EVAL_ITEM_LIMIT.set(options.eval_items)
            try:
                await _evaluate(env, report)
            finally:
                EVAL_ITEM_LIMIT.reset(token)
    finally:
        from atroposlib.envs.runtime import shutdown_env

        await shutdown_env(env)


def run_check(env_cls: type, resolved: Any, options: CheckOptions) -> EnvCheckReport:
    """Run the check on settings already resolved (the ``check`` command's body)."""
    report = EnvCheckReport(env=env_cls.name or env_cls.__name__, strict=options.strict)
    _check_config(env_cls, resolved, report)
    child = None
    started = time.monotonic()
    try:
        child = _start_embedded(resolved, options, report)
        left = options.timeout - (time.monotonic() - started)
        asyncio.run(asyncio.wait_for(_run(env_cls, resolved, options, report), left))
    except TimeoutError:
        report.error("check", f"did not finish within --check.timeout {options.timeout:.0f} s")
    except Exception as exc:  # noqa: BLE001 - e.g. the embedded server did not start
        report.error("check", f"{type(exc).__name__}: {exc}")
    finally:
        if child is not None:
            child.stop()
    return report


def check_env(env_cls: type, argv: Sequence[str] = ()) -> EnvCheckReport:
    """Check ``env_cls`` with the command line ``argv`` (``--env.*``, ``--openai.*``,
    ``--config``, ``--check.*``; without the command name), as ``python env.py check``."""
    from atroposlib.envs.cli import resolve_config

    resolved = resolve_config(env_cls, ["check", *argv])
    return run_check(env_cls, resolved, resolved.command_options)
