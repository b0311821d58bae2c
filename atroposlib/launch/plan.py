"""From a run description to the processes of a run, independent of where they run.

:func:`plan_run` turns a :class:`~atroposlib.launch.spec.RunSpec` into :class:`Component` s:
one ``run-api``, each inference server copy, each environment worker, the trainer. A component
is plain data (it travels to a Ray actor or a Slurm step as JSON): its command, environment,
config files, health path and resources, with **placeholders** for what is only known once the
run starts on real nodes:

``{host}`` / ``{port}``
    the address the component is reached at and the port it listens on (chosen on its node);
``{bind_host}``
    the address it binds;
``{api_url}``, ``{inference_url}``, ``{inference_urls}``
    the API's URL and the inference servers' root URLs, without ``/v1`` (the first; all,
    comma-separated);
``{synced_inference_urls}``
    the root URLs of the inference servers the trainer syncs (comma-separated);
``{openai_servers}``
    (in config files) the list of ``--openai`` server sections, one per inference server;
``{output}``, ``{name}``, ``{index}``
    the run's output folder, the component's name and its index among its copies.

:func:`render` fills them in; every backend uses it, so the commands are the same everywhere.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from atroposlib.backends import WeightSyncUnsupported, get_backend
from atroposlib.launch.spec import InferenceSpec, RunSpec, RunSpecError

__all__ = ["Component", "RunPlan", "plan_run", "render", "server_entry", "sync_target"]

Role = Literal["api", "inference", "env", "trainer"]


class Component(BaseModel):
    """One process of a run (see the module docstring for the placeholders)."""

    name: str = Field(
        description="Unique in the run: run-api, policy (one copy) or policy-0, policy-1 ..., "
        "trainer."
    )
    role: Role
    group: str = Field(description="The spec entry it comes from (restarts count per copy).")
    index: int = 0
    argv: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    files: dict[str, Any] = Field(
        default_factory=dict,
        description="Files written before start: path (under the output folder) -> YAML data.",
    )
    health_path: str | None = Field(
        None, description="GET path that answers 200 when ready (None: running is ready)."
    )
    port: int | None = Field(
        None, description="Port to listen on: None for no port, 0 for a free one."
    )
    url_suffix: str = Field("", description="Appended to http://host:port for its URL.")
    external_url: str | None = Field(None, description="A server the run does not start.")
    cpus: float = 1.0
    gpus: float = 0.0
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom resources (Ray) it needs besides cpus/gpus."
    )
    max_restarts: int = 0
    startup_timeout: float = 60.0
    cwd: str | None = None
    kind: str = Field(
        "", description="Inference kind (atropos-serve, vllm, sglang, trl-vllm-serve, external)."
    )
    backend: str = Field(
        "", description="Inference backend it runs or points at (atroposlib.backends)."
    )
    synced: bool = Field(False, description="Whether the trainer syncs its weights (inference).")
    api_key_env: list[str] = Field(
        default_factory=list,
        description="Environment variables that get the run's key at start, besides "
        "ATROPOS_API_KEY (inference: e.g. VLLM_API_KEY).",
    )
    api_key_flag: str = Field(
        "", description="Flag the run's key is passed with at start (inference: SGLang's)."
    )
    model_name: str = Field("", description="The model name environments ask for (inference).")


class RunPlan(BaseModel):
    """The components of a run, in start order, plus run-wide values."""

    name: str
    output: str
    bind_host: str
    api: Component
    inference: list[Component]
    environments: list[Component]
    trainer: Component | None

    @property
    def components(self) -> list[Component]:
        """Every component, in start order."""
        tail = [self.trainer] if self.trainer is not None else []
        return [self.api, *self.inference, *self.environments, *tail]


def _python(value: str | None) -> str:
    return value or sys.executable


def weight_path(server: InferenceSpec) -> str:
    """How the trainer's weights reach ``server``: ``reload``, ``nccl`` or ``none``.

    Raises:
        WeightSyncUnsupported: the server cannot take weights and ``weight_sync`` is not none.
    """
    chosen = None if server.weight_sync == "auto" else server.weight_sync
    return get_backend(server.backend).resolve_weight_path(chosen)


def _inference_argv(spec: InferenceSpec, run: RunSpec, path: str) -> list[str]:
    model = spec.model or ""
    model_path = run.resolve_path(model)
    if model_path.exists():
        model = str(model_path)
    return get_backend(spec.backend).command(
        model,
        served_model_name=spec.model_name,
        host="{bind_host}",
        port="{port}",
        python=_python(spec.python),
        weight_path=path,
        extra_args=spec.args,
    )


def _inference_env(spec: InferenceSpec, path: str) -> dict[str, str]:
    """The backend's environment (dev mode, plugin folder on ``PYTHONPATH`` ...) with the
    entry's ``env`` over it; a ``PYTHONPATH`` there is kept after the plugin folder."""
    base = {**os.environ, **spec.env}
    env = get_backend(spec.backend).launch_env(weight_path=path, base=base)
    for key, value in spec.env.items():
        if key == "PYTHONPATH" and key in env:
            continue  # already in the backend's PYTHONPATH, after the plugin folder
        env[key] = value
    return env


def server_entry(backend: str, base_url: str, model_name: str) -> dict[str, Any]:
    """The ``--openai`` section an environment gets for one inference server (``backend``: a
    name of ``atroposlib.backends``; ``external`` means an OpenAI endpoint)."""
    name = "openai" if backend == "external" else backend
    return {"base_url": base_url, "model_name": model_name,
            "server_type": get_backend(name).server_type}  # fmt: skip


def plan_run(spec: RunSpec) -> RunPlan:
    """The components of ``spec`` (commands with placeholders, see the module docstring).

    Raises:
        RunSpecError: an environment file or trainer setting that cannot work.
    """
    output = str(spec.output_dir)
    api = Component(
        name="run-api",
        role="api",
        group="run-api",
        argv=[
            sys.executable,
            "-m",
            "atroposlib.cli.run_api",
            "--host",
            "{bind_host}",
            "--port",
            "{port}",
        ],  # fmt: skip
        env={f"ATROPOS_{k.upper()}": _flag_value(v) for k, v in spec.api.settings.items()},
        health_path="/health",
        port=spec.api.port,
        cpus=spec.api.cpus,
        startup_timeout=spec.api.startup_timeout,
    )
    paths = _weight_paths(spec)
    inference: list[Component] = []
    for index, server in enumerate(spec.inference):
        path = paths[index]
        for i in range(server.count):
            name = server.name if server.count == 1 else f"{server.name}-{i}"
            if server.kind == "external":
                inference.append(
                    Component(
                        name=name,
                        role="inference",
                        group=server.name,
                        index=i,
                        argv=[],
                        external_url=server.url,
                        kind=server.kind,
                        backend=server.backend,
                        synced=path != "none",
                        model_name=server.model_name,
                    )  # fmt: skip
                )
                break  # one URL: count means nothing for a server we do not start
            inference.append(
                Component(
                    name=name,
                    role="inference",
                    group=server.name,
                    index=i,
                    argv=_inference_argv(server, spec, path),
                    env=_inference_env(server, path),
                    health_path="/health",
                    port=server.port + i if server.port else 0,
                    url_suffix="/v1",
                    cpus=server.cpus,
                    gpus=server.gpus,
                    resources=dict(server.resources),
                    startup_timeout=server.startup_timeout,
                    kind=server.kind,
                    backend=server.backend,
                    synced=path != "none",
                    model_name=server.model_name,
                    api_key_env=list(get_backend(server.backend).api_key_env),
                    api_key_flag=get_backend(server.backend).api_key_flag,
                )
            )
    environments: list[Component] = []
    for env in spec.environments:
        file = spec.resolve_path(env.file)
        if not file.is_file():
            alt = Path(env.file).expanduser().resolve()
            if not alt.is_file():
                raise RunSpecError(f"environments: {env.label}: no such file {env.file!r}")
            file = alt
        env_values = dict(env.env)
        if env.weight is not None:
            env_values["inference_weight"] = env.weight
        env_values["rollout_server_url"] = "{api_url}"
        for i in range(env.workers):
            name = env.label if env.workers == 1 else f"{env.label}-{i}"
            config_path = f"configs/{name}.yaml"
            environments.append(
                Component(
                    name=name,
                    role="env",
                    group=env.label,
                    index=i,
                    argv=[
                        _python(env.python),
                        str(file),
                        "serve",
                        "--config",
                        "{output}/" + config_path,
                        *env.args,
                    ],  # fmt: skip
                    files={
                        config_path: {
                            "env": env_values,
                            "openai": "{openai_servers}",
                            "openai_overrides": dict(env.openai),
                        }
                    },  # fmt: skip
                    cpus=env.cpus,
                    resources=dict(env.resources),
                    max_restarts=env.max_restarts,
                    cwd=str(
                        file.parent.parent if file.parent.name == "environments" else file.parent
                    ),  # fmt: skip
                )
            )
    trainer = None
    if spec.trainer is not None:
        trainer = _plan_trainer(spec)
    return RunPlan(
        name=spec.name,
        output=output,
        bind_host=spec.bind_host,
        api=api,
        inference=inference,
        environments=environments,
        trainer=trainer,
    )


def _weight_paths(spec: RunSpec) -> list[str]:
    """Each inference entry's weight path (in a run without a trainer: the one a trainer you
    start yourself would use, ``none`` for servers that take no weights).

    Raises:
        RunSpecError: a run with a trainer whose weights cannot reach one of its servers (an
            OpenAI endpoint without ``weight_sync: none``), or that would sync servers of
            different kinds (one trainer syncs one kind).
    """
    if spec.trainer is None:
        paths = []
        for server in spec.inference:
            try:
                paths.append(weight_path(server))
            except WeightSyncUnsupported:
                paths.append("none")
        return paths
    paths = []
    for index, server in enumerate(spec.inference):
        try:
            paths.append(weight_path(server))
        except WeightSyncUnsupported as exc:
            where = f"inference[{index}] ({server.name}, kind {server.kind})"
            raise RunSpecError(
                f"{where}: the trainer cannot reach this server's weights: {exc}. Write "
                "`weight_sync: none` on this entry to train without syncing it."
            ) from None
    synced = {(s.backend, p) for s, p in zip(spec.inference, paths, strict=True) if p != "none"}
    if len(synced) > 1:
        kinds = ", ".join(f"{b} ({p})" for b, p in sorted(synced))
        raise RunSpecError(
            f"inference: the trainer would sync servers of different kinds ({kinds}); a "
            "trainer syncs one kind: write `weight_sync: none` on the others"
        )
    return paths


def sync_target(spec: RunSpec) -> tuple[str, str] | None:
    """``(backend, weight path)`` of the servers the trainer syncs, or None when it syncs
    none."""
    paths = _weight_paths(spec)
    for server, path in zip(spec.inference, paths, strict=True):
        if path != "none":
            return server.backend, path
    return None


def _plan_trainer(spec: RunSpec) -> Component:
    assert spec.trainer is not None
    t = spec.trainer
    target = sync_target(spec)
    env = {"ATROPOS_API_URL": "{api_url}", "ATROPOS_INFERENCE_URLS": "{inference_urls}",
           "ATROPOS_RUN_OUTPUT": "{output}", **t.env}  # fmt: skip
    if target is not None:
        # what a trainer of its own needs for atroposlib.backends.weight_sync_client(...)
        env.setdefault("ATROPOS_WEIGHT_SYNC_BACKEND", target[0])
        env.setdefault("ATROPOS_WEIGHT_SYNC", target[1])
        env.setdefault("ATROPOS_WEIGHT_SYNC_URLS", "{synced_inference_urls}")
    if t.command:
        return Component(name="trainer", role="trainer", group="trainer", argv=list(t.command),
                         env=env, cpus=t.cpus, gpus=t.gpus,
                         resources=dict(t.resources))  # fmt: skip
    config: dict[str, Any] = {k.replace("-", "_"): v for k, v in t.config.items()}
    config.setdefault("atropos_url", "{api_url}")
    first = next((s for s in spec.inference), None)
    if target is None:
        config.setdefault("inference", "none")
    else:
        backend, path = target
        config.setdefault("inference", backend)
        config.setdefault("inference_url", "{synced_inference_urls}")
        if backend in ("vllm", "trl-vllm-serve"):
            config.setdefault("launch_vllm", False)  # the launcher started it
            config.setdefault("weight_sync", path)
    if first is not None:
        config.setdefault("served_model_name", first.model_name)
        if first.model and "model_name" not in config:
            config["model_name"] = first.model
    if "model_name" in config:
        path_ = spec.resolve_path(str(config["model_name"]))
        if path_.exists():
            config["model_name"] = str(path_)
    for key in ("save_path", "metrics_file"):
        if key in config and not str(config[key]).startswith("{"):
            config[key] = str(_under(spec, str(config[key])))
    config.setdefault("save_path", "{output}/checkpoints")
    config.setdefault("metrics_file", "{output}/metrics.jsonl")
    return Component(
        name="trainer",
        role="trainer",
        group="trainer",
        argv=[
            _python(t.python),
            "-m",
            "example_trainer.grpo",
            "--config",
            "{output}/configs/trainer.yaml",
        ],  # fmt: skip
        env=env,
        files={"configs/trainer.yaml": config},
        cpus=t.cpus,
        gpus=t.gpus,
        resources=dict(t.resources),
    )


def _under(spec: RunSpec, path: str) -> Path:
    """A relative path under the run's output folder (absolute paths stay)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else spec.output_dir / p


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def render(value: Any, ctx: dict[str, Any]) -> Any:
    """``value`` with every ``{key}`` of ``ctx`` filled in (strings, lists and dicts, deeply).

    A string that is exactly one placeholder takes the context value as is (so
    ``"{openai_servers}"`` becomes a list); other text around braces is left alone.
    """
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("{") and stripped.endswith("}") and stripped[1:-1] in ctx:
            found = ctx[stripped[1:-1]]
            return found if not isinstance(found, (int, float)) or isinstance(found, bool) \
                else str(found)  # fmt: skip
        for key, sub in ctx.items():
            token = "{" + key + "}"
            if token in value and isinstance(sub, (str, int, float)):
                value = value.replace(token, str(sub))
        return value
    if isinstance(value, list):
        return [render(v, ctx) for v in value]
    if isinstance(value, dict):
        return {k: render(v, ctx) for k, v in value.items()}
    return value


def env_config_data(files_entry: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """An environment worker's YAML config with its servers filled in: the run's inference
    servers, each with the spec's ``openai`` overrides laid over it."""
    data = render(files_entry, ctx)
    overrides = data.pop("openai_overrides", {}) or {}
    servers = data.get("openai")
    if isinstance(servers, list) and servers:
        data["openai"] = [{**s, **overrides} for s in servers]
    elif overrides:
        data["openai"] = overrides
    else:
        data.pop("openai", None)
    return data


def describe(component: Component) -> str:
    """The component's command line, for logs."""
    return shlex.join(component.argv)
