"""``atropos-launch --dry-run``'s check of every setting, without starting anything.

* Each environment: its file is imported as the real launch runs it (the environment's Python,
  its working folder, the file's folder first on ``sys.path``), in a child process, and its
  command line (``serve --config <the YAML the launcher writes>`` plus the spec's ``args``) is
  resolved by :func:`atroposlib.envs.cli.resolve_config`: ``config_init()`` < YAML (``env``,
  ``openai``) < flags, validated by the environment's config class. Inference URLs and ports,
  which are only known once the servers run, are stand-ins.
* The GRPO trainer: the ``configs/trainer.yaml`` the launcher writes, built into
  ``example_trainer.config.TrainingConfig`` the way ``atropos-grpo --config`` builds it. A trainer
  ``command`` is the user's own program and is not checked.

Any problem is a :class:`~atroposlib.launch.spec.RunSpecError` of one line naming the spec field
(``environments: <name>: ...`` / ``trainer.config: ...``) and the setting.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from atroposlib.launch.plan import RunPlan, env_config_data, render, server_entry
from atroposlib.launch.spec import RunSpecError

__all__ = ["check_settings"]

#: Seconds allowed to import one environment and resolve its settings.
ENV_CHECK_TIMEOUT_S = 180.0

# Runs in the environment's interpreter: argv = [file, *command line]. Exit 2 with one line on
# stderr for a settings error, 3 when the file cannot be imported or names no environment.
_ENV_CHECK = r"""
import importlib.util, inspect, logging, os, re, sys
logging.disable(logging.WARNING)
file, argv = sys.argv[1], sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(file)))
try:
    spec = importlib.util.spec_from_file_location("_atropos_env_under_check", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    from atroposlib.envs.base import BaseEnv
    from atroposlib.envs.cli import CliError, resolve_config
except BaseException as exc:
    print(f"cannot import {file}: {type(exc).__name__}: {exc}", file=sys.stderr)
    raise SystemExit(3)
ours = {n: c for n, c in vars(module).items()
        if inspect.isclass(c) and issubclass(c, BaseEnv) and c.__module__ == spec.name}
source = open(file, encoding="utf-8").read()
called = [n for n in re.findall(r"(\w+)\.cli\(\)", source) if n in ours]
if called:
    env_cls = ours[called[-1]]
elif len(ours) == 1:
    env_cls = next(iter(ours.values()))
else:
    print(f"{file}: no environment class to check (no `X.cli()` call)", file=sys.stderr)
    raise SystemExit(3)
try:
    resolve_config(env_cls, argv)
except CliError as exc:
    print(exc.message, file=sys.stderr)
    raise SystemExit(2)
"""


def _context(plan: RunPlan) -> dict[str, Any]:
    """Stand-ins for what the launcher learns once run-api and the servers are up."""
    servers, roots = [], []
    for i, component in enumerate(plan.inference):
        root = (component.external_url or f"http://127.0.0.1:{9001 + i}").rstrip("/")
        root = root.removesuffix("/v1")
        base = root + ("" if component.external_url else component.url_suffix)
        roots.append(root)
        servers.append(
            server_entry(component.backend or component.kind, base, component.model_name)
        )
    return {
        "api_url": "http://127.0.0.1:8000",
        "inference_urls": ",".join(roots),
        "synced_inference_urls": ",".join(
            r for r, c in zip(roots, plan.inference, strict=True) if c.synced
        ),
        "inference_url": roots[0] if roots else "",
        "openai_servers": servers,
        "output": str(plan.output),
    }


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return "; ".join(lines[-3:]) if lines else "failed without a message"


def _check_environments(plan: RunPlan, ctx: dict[str, Any], local: bool) -> None:
    seen: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="atropos-launch-check-") as tmp:
        for component in plan.environments:
            if component.group in seen:  # workers of one environment share their settings
                continue
            seen.add(component.group)
            ((rel, data),) = component.files.items()
            config = Path(tmp, Path(rel).name)
            config.write_text(yaml.safe_dump(env_config_data(data, ctx), sort_keys=False))
            argv = [str(a) for a in render(component.argv, ctx)]
            python, file = argv[0], argv[1]
            config_at = argv.index("--config") + 1
            shown = "the run description"  # its env/openai sections are that YAML
            argv[config_at] = str(config)
            try:
                result = subprocess.run(
                    [python, "-c", _ENV_CHECK, file, *argv[2:]],
                    cwd=component.cwd or None,
                    capture_output=True,
                    text=True,
                    timeout=ENV_CHECK_TIMEOUT_S,
                    env={**os.environ, "PYTHONPATH": _pythonpath()},
                )
            except subprocess.TimeoutExpired:
                raise RunSpecError(
                    f"environments: {component.group}: importing {file} and resolving its "
                    f"settings took over {ENV_CHECK_TIMEOUT_S:.0f} s"
                ) from None
            except OSError as exc:
                if not local:  # its Python may exist on the cluster's nodes only
                    print(f"settings: environments: {component.group}: not checked here ({exc})")
                    continue
                raise RunSpecError(f"environments: {component.group}: python: {exc}") from None
            if result.returncode != 0:
                message = _one_line(result.stderr).replace(str(config), shown)
                raise RunSpecError(f"environments: {component.group}: {message}")


def _pythonpath() -> str:
    """The launcher's import path first, so the environment sees the same atroposlib."""
    here = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH", "")
    return here + (os.pathsep + rest if rest else "")


def _check_trainer(plan: RunPlan, ctx: dict[str, Any]) -> None:
    trainer = plan.trainer
    if trainer is None or "configs/trainer.yaml" not in trainer.files:
        return
    try:
        from example_trainer.config import TrainingConfig, build_parser
    except ImportError:  # a core install: the trainer checks its settings when it starts
        return
    from atroposlib.utils.cli import FlagError, ModelFlags

    values = render(trainer.files["configs/trainer.yaml"], ctx)
    flags = ModelFlags(TrainingConfig)
    canonical = {}
    for key, value in values.items():
        name = flags.canonical_key(str(key))
        if name is None:
            raise RunSpecError(f"trainer.config: unknown setting {key}")
        canonical[name] = value
    args = build_parser().parse_args([])
    try:
        flags.build(args, config=canonical, config_path="trainer.config")
    except FlagError as exc:
        message = _one_line(exc.message)
        prefix = "" if "trainer.config" in message else "trainer.config: "
        raise RunSpecError(prefix + message) from None


def check_settings(plan: RunPlan, local: bool = True) -> None:
    """Check every environment's and the GRPO trainer's settings (module docstring); raises
    :class:`RunSpecError` for the first problem. ``local``: the run's processes start on this
    machine (an environment's ``python`` missing here is then an error, not a note)."""
    ctx = _context(plan)
    _check_trainer(plan, ctx)
    _check_environments(plan, ctx, local)
