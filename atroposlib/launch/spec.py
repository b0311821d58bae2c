"""The run description: one YAML file that says what ``atropos-launch`` starts.

A run is the trajectory API (``run-api``), zero or more inference servers, one or more
environments (each any number of worker processes) and, optionally, a trainer. The same file
runs with every backend (``local``, ``ray``, ``slurm``): it names *what* runs and with which
resources; the backend decides *where*, and resolves hosts and ports when the run starts, so
no port or address is written into an environment's flags by hand.

Every field is documented in ``CONFIG.md`` (generated from these models by
``python -m atroposlib.cli.config_docs``). Load a file with :func:`load_run_spec`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "ApiSpec",
    "EnvironmentSpec",
    "InferenceSpec",
    "RunSpec",
    "RunSpecError",
    "SlurmSpec",
    "RaySpec",
    "TrainerSpec",
    "load_run_spec",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RunSpecError(ValueError):
    """A run description that cannot run; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(
            "names are 1-48 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return value


def _check_resources(value: dict[str, float]) -> dict[str, float]:
    for key, amount in value.items():
        if key.upper() in ("CPU", "GPU"):
            raise ValueError(f"{key}: use cpus / gpus, not resources")
        if amount < 0:
            raise ValueError(f"{key}: must be >= 0 (got {amount})")
    return value


_RESOURCES_DOC = (
    "Custom resources each copy needs (ray: Ray custom resources, e.g. {node_pool_env: 1} "
    "to place it on nodes started with --resources; ignored by the local and slurm backends)."
)


class ApiSpec(_Strict):
    """The trajectory API (``run-api``): one process per run."""

    port: int = Field(
        0, ge=0, le=65535, description="Port to listen on (0: a free port, chosen at start)."
    )
    settings: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other run-api setting by its field name (CONFIG.md, run-api), e.g. "
        "{store: run.sqlite, max_staleness: 2, max_queue_sequences: 20000}. host, port and "
        "api_key come from the run description itself.",
    )
    cpus: float = Field(1.0, gt=0, description="CPUs reserved for it (ray, slurm).")
    startup_timeout: float = Field(60.0, gt=0, description="Seconds to wait for /health.")

    @field_validator("settings")
    @classmethod
    def _known_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        from atroposlib.api.settings import ApiSettings

        reserved = {"host", "port", "api_key"} & set(value)
        if reserved:
            raise ValueError(
                f"{', '.join(sorted(reserved))}: set by the run description (bind_host, "
                "api.port, api_key), not in api.settings"
            )
        unknown = sorted(set(value) - set(ApiSettings.model_fields))
        if unknown:
            known = ", ".join(sorted(ApiSettings.model_fields))
            raise ValueError(f"unknown run-api setting(s) {', '.join(unknown)} (known: {known})")
        try:
            ApiSettings(**value)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ValueError(f"{first['loc'][0]}: {first['msg']}") from None
        return value


class InferenceSpec(_Strict):
    """One kind of inference server; ``count`` identical copies of it."""

    name: str = Field("policy", description="Name in the status view and log file names.")
    kind: Literal["atropos-serve", "vllm", "sglang", "trl-vllm-serve", "external"] = Field(
        "atropos-serve",
        description="atropos-serve: the embedded server (CPU or GPU). vllm / sglang: their "
        "OpenAI servers, run with `python` below (vllm in dev mode with the /policy_version "
        "middleware and processed log-probs). trl-vllm-serve: TRL's `trl vllm-serve` (vLLM "
        "underneath). external: a server you run yourself, at url. docs/backends.md has "
        "what each gives.",
    )
    server: Literal["openai", "atropos-serve", "vllm", "sglang", "trl-vllm-serve"] | None = Field(
        None,
        description="kind external only: what answers at url. openai (the default): any "
        "OpenAI-compatible endpoint (no token ids; takes no weights). atropos-serve, vllm, "
        "sglang, trl-vllm-serve: that server, started by you as docs/backends.md says, which "
        "the trainer syncs like one the launcher started.",
    )
    weight_sync: Literal["auto", "reload", "nccl", "none"] = Field(
        "auto",
        description="How the trainer's new weights reach this server. auto: the server's "
        "default way (reload). reload: it loads each checkpoint folder the trainer writes (the "
        "folder must be readable at the same path there: same machine, or a shared "
        "filesystem). nccl: vllm / trl-vllm-serve only, the trainer broadcasts its tensors to "
        "vLLM's workers (GPUs). none: never synced, it keeps its weights (rollouts go "
        "off-policy). A run with a trainer refuses a server that cannot take weights (an "
        "OpenAI endpoint) unless this says none.",
    )
    model: str | None = Field(
        None,
        description="Model folder or id (SmolLM2-135M-Instruct is packaged). Required except "
        "for kind external.",
    )
    served_model_name: str | None = Field(
        None,
        description="Name the environments ask for (default: the model folder's name, or the "
        "model id).",
    )
    count: int = Field(1, ge=1, description="How many copies to start.")
    url: str | None = Field(
        None, description="Base URL of an external server (kind external), e.g. http://gpu1:9000."
    )
    port: int = Field(
        0, ge=0, le=65535, description="Port of the first copy (0: free ports chosen at start)."
    )
    gpus: float = Field(0.0, ge=0, description="GPUs reserved for each copy (ray, slurm).")
    cpus: float = Field(1.0, gt=0, description="CPUs reserved for each copy (ray, slurm).")
    resources: dict[str, float] = Field(default_factory=dict, description=_RESOURCES_DOC)
    python: str | None = Field(
        None,
        description="Python interpreter that runs the server (default: the launcher's), e.g. "
        "a separate virtualenv's for vLLM.",
    )
    args: list[str] = Field(
        default_factory=list,
        description="Extra command-line arguments of the server, e.g. [--dtype, float32].",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables of the server."
    )
    startup_timeout: float = Field(
        600.0, gt=0, description="Seconds to wait for the server's health endpoint."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_name(value)

    @field_validator("resources")
    @classmethod
    def _resources(cls, value: dict[str, float]) -> dict[str, float]:
        return _check_resources(value)

    @model_validator(mode="after")
    def _kind_fields(self) -> InferenceSpec:
        if self.kind == "external":
            if not self.url:
                raise ValueError("kind external needs url")
            if not re.match(r"^https?://[^/\s]+", self.url):
                raise ValueError(f"url {self.url!r}: expected http(s)://HOST:PORT")
        else:
            if self.url:
                raise ValueError(f"url is only for kind external (this one is {self.kind})")
            if self.server is not None:
                raise ValueError(f"server is only for kind external (this one is {self.kind})")
            if not self.model:
                raise ValueError(f"kind {self.kind} needs model")
        if self.weight_sync in ("reload", "nccl"):
            from atroposlib.backends import WeightSyncUnsupported, get_backend

            try:
                get_backend(self.backend).resolve_weight_path(self.weight_sync)
            except WeightSyncUnsupported as exc:
                raise ValueError(f"weight_sync {self.weight_sync}: {exc}") from None
        return self

    @property
    def backend(self) -> str:
        """The inference backend (``atroposlib.backends``) this entry runs or points at."""
        if self.kind == "external":
            return self.server or "openai"
        return self.kind

    @property
    def model_name(self) -> str:
        """The name environments send in requests."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return "default"
        return Path(self.model).name if Path(self.model).expanduser().is_dir() else self.model


class EnvironmentSpec(_Strict):
    """One environment: its file, how many worker processes, and its flags."""

    name: str | None = Field(
        None, description="Name in the status view and log file names (default: file's stem)."
    )
    file: str = Field(
        description="The environment's Python file (relative to the run description's folder, "
        "or to the current folder), e.g. environments/arithmetic_server.py."
    )
    workers: int = Field(1, ge=1, description="Worker processes, each `FILE serve`.")
    weight: float | None = Field(
        None,
        gt=0,
        description="Share of each batch this environment should fill (run-api's env weight); "
        "default: the environment's own.",
    )
    env: dict[str, Any] = Field(
        default_factory=dict,
        description="--env.* settings, e.g. {group_size: 8, max_token_length: 512}. "
        "rollout_server_url is filled in by the launcher.",
    )
    openai: dict[str, Any] = Field(
        default_factory=dict,
        description="--openai.* settings for every inference server, e.g. {server_type: "
        "openai}; base_url and model_name are filled in by the launcher.",
    )
    args: list[str] = Field(
        default_factory=list, description="Extra command-line arguments after the others."
    )
    cpus: float = Field(1.0, gt=0, description="CPUs reserved for each worker (ray, slurm).")
    resources: dict[str, float] = Field(default_factory=dict, description=_RESOURCES_DOC)
    max_restarts: int = Field(
        3,
        ge=0,
        description="Restarts allowed per worker after it fails (exit status not 0); past "
        "that the run stops with the worker's log.",
    )
    python: str | None = Field(
        None, description="Python interpreter that runs it (default: the launcher's)."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return None if value is None else _check_name(value)

    @field_validator("resources")
    @classmethod
    def _resources(cls, value: dict[str, float]) -> dict[str, float]:
        return _check_resources(value)

    @field_validator("env", "openai")
    @classmethod
    def _no_reserved(cls, value: dict[str, Any], info: Any) -> dict[str, Any]:
        reserved = {
            "env": {"rollout_server_url"},
            "openai": {"base_url", "model_name"},
        }[info.field_name]
        clash = sorted(reserved & set(value))
        if clash:
            raise ValueError(f"{', '.join(clash)}: filled in by the launcher")
        return value

    @property
    def label(self) -> str:
        """The name used in the status view and log files."""
        return self.name or Path(self.file).stem.removesuffix("_server")


class TrainerSpec(_Strict):
    """The trainer: the GRPO trainer with ``config``, or any ``command``."""

    config: dict[str, Any] = Field(
        default_factory=dict,
        description="GRPO trainer settings (atropos-grpo --help), e.g. {model_name: ..., "
        "training_steps: 20, lr: 1e-6}. atropos_url is filled in, and from the inference "
        "servers it syncs (weight_sync) inference, inference_url, launch_vllm and weight_sync "
        "(inference none when it syncs none).",
    )
    command: list[str] | None = Field(
        None,
        description="Run this command instead of the GRPO trainer. Placeholders {api_url}, "
        "{inference_url}, {inference_urls} (comma-separated), {synced_inference_urls} and "
        "{output} are filled in; the same values are in ATROPOS_API_URL, "
        "ATROPOS_INFERENCE_URLS, ATROPOS_WEIGHT_SYNC_URLS and ATROPOS_RUN_OUTPUT, with "
        "ATROPOS_WEIGHT_SYNC_BACKEND and ATROPOS_WEIGHT_SYNC (reload, nccl) for "
        "atroposlib.backends.weight_sync_client.",
    )
    gpus: float = Field(0.0, ge=0, description="GPUs reserved for it (ray, slurm).")
    cpus: float = Field(1.0, gt=0, description="CPUs reserved for it (ray, slurm).")
    resources: dict[str, float] = Field(default_factory=dict, description=_RESOURCES_DOC)
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables of the trainer."
    )
    python: str | None = Field(
        None, description="Python interpreter that runs it (default: the launcher's)."
    )

    @field_validator("resources")
    @classmethod
    def _resources(cls, value: dict[str, float]) -> dict[str, float]:
        return _check_resources(value)

    @field_validator("config")
    @classmethod
    def _known_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            from example_trainer.config import TrainingConfig
        except ImportError:  # a core install: checked when the trainer starts
            return value
        names = {f: f for f in TrainingConfig.model_fields}
        names.update(
            {i.alias: f for f, i in TrainingConfig.model_fields.items() if i.alias is not None}
        )
        unknown = sorted(k for k in value if str(k).replace("-", "_") not in names)
        if unknown:
            raise ValueError(f"unknown trainer setting(s) {', '.join(unknown)}")
        return value


class RaySpec(_Strict):
    """Settings of the ``ray`` backend."""

    address: str | None = Field(
        None,
        description="Ray cluster to join (ray.init address, e.g. 127.0.0.1:6379 or auto); "
        "default: RAY_ADDRESS, else a local Ray started for the run.",
    )
    namespace: str = Field("atropos", description="Ray namespace of the run's actors.")
    placement_timeout: float = Field(
        120.0,
        gt=0,
        description="Seconds to wait for the cluster to have room for a component group (its "
        "placement group); longer for a cluster that adds nodes on demand.",
    )


class SlurmSpec(_Strict):
    """Settings of the ``slurm`` backend (the generated batch script)."""

    partition: str | None = Field(None, description="sbatch --partition.")
    account: str | None = Field(None, description="sbatch --account.")
    time: str = Field("01:00:00", description="sbatch --time (walltime limit).")
    nodes: int = Field(1, ge=1, description="Nodes to allocate.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (--gpus-per-node).")
    cpus_per_node: int | None = Field(
        None, ge=1, description="CPUs per node (default: what the components ask for)."
    )
    extra: list[str] = Field(
        default_factory=list,
        description="More #SBATCH lines, e.g. ['--qos=high', '--constraint=a100'].",
    )
    setup: list[str] = Field(
        default_factory=list,
        description="Shell lines run before the launcher in the batch script (module load, "
        "source .venv/bin/activate).",
    )


class RunSpec(_Strict):
    """A whole run: API, inference, environments, trainer, and where logs go."""

    name: str = Field("atropos-run", description="Run name (Ray namespace, Slurm job name).")
    output: str = Field(
        "atropos-run",
        description="Folder for logs and what components write (relative to the run "
        "description's folder). logs/NAME.log per process.",
    )
    bind_host: str = Field(
        "127.0.0.1",
        description="Address every component listens on. Loopback by default; 0.0.0.0 to "
        "reach components across nodes (then set api_key).",
    )
    api_key: str | None = Field(
        None,
        description="Shared token run-api and every inference server the run starts require "
        "on every endpoint but /health; passed to every component as ATROPOS_API_KEY (vLLM "
        "also gets VLLM_API_KEY, SGLang --api-key), and every client of the run sends it. "
        "'auto': a random one per run. '${VAR}': read from that environment variable. "
        "Default: none (with bind_host loopback), 'auto' otherwise; an empty key with a "
        "bind_host beyond loopback is refused.",
    )
    api: ApiSpec = Field(default_factory=ApiSpec, description="The trajectory API.")
    inference: list[InferenceSpec] = Field(
        default_factory=list, description="Inference servers (may be empty)."
    )
    environments: list[EnvironmentSpec] = Field(
        min_length=1, description="Environments; each worker is one `serve` process."
    )
    trainer: TrainerSpec | None = Field(
        None,
        description="The trainer. Without one, the run serves until Ctrl-C (a trainer you "
        "start yourself pulls batches from the API URL the status view shows).",
    )
    ray: RaySpec = Field(default_factory=RaySpec, description="ray backend settings.")
    slurm: SlurmSpec = Field(default_factory=SlurmSpec, description="slurm backend settings.")
    base_dir: str = Field(
        ".",
        description="Folder relative paths are resolved against (set by load_run_spec to the "
        "file's folder; rarely written by hand).",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_name(value)

    @model_validator(mode="after")
    def _key_when_wide(self) -> RunSpec:
        if self.bind_host not in LOOPBACK and self.api_key is not None and not self.api_key.strip():
            raise ValueError(
                f"api_key: empty, with bind_host {self.bind_host}: run-api and every inference "
                "server would be open to anyone who reaches this node. Leave api_key out (a "
                "random key is made for the run) or set one"
            )
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> RunSpec:
        labels = [s.name for s in self.inference] + [e.label for e in self.environments]
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise ValueError(f"component names must be unique: {', '.join(dupes)} repeated")
        return self

    def resolve_path(self, path: str) -> Path:
        """``path`` (``~`` expanded) against :attr:`base_dir` unless absolute."""
        p = Path(os.path.expandvars(path)).expanduser()
        return p if p.is_absolute() else (Path(self.base_dir) / p).resolve()

    @property
    def output_dir(self) -> Path:
        """The run's output folder, absolute."""
        return self.resolve_path(self.output)

    def resolved_api_key(self) -> str | None:
        """The API key for this run (``auto`` generated once per call site; see the field)."""
        key = self.api_key
        if key is None:
            if self.bind_host in LOOPBACK:
                return None
            key = "auto"
        if key == "auto":
            import secrets

            return secrets.token_urlsafe(24)
        match = re.fullmatch(r"\$\{(\w+)\}", key)
        if match:
            value = os.environ.get(match.group(1))
            if not value:
                raise RunSpecError(f"api_key: environment variable {match.group(1)} is not set")
            return value
        return key


def load_run_spec(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> RunSpec:
    """Read and validate a run description.

    Args:
        path: the YAML file.
        overrides: top-level fields to replace after reading (e.g. ``{"output": ...}``).

    Raises:
        RunSpecError: the file is missing, not YAML, or a field is wrong (the message names
            the file and the field path, e.g. ``environments[0].workers``).
    """
    import yaml

    file = Path(path).expanduser()
    try:
        data = yaml.safe_load(file.read_text())
    except OSError as exc:
        raise RunSpecError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise RunSpecError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RunSpecError(f"{path}: expected a mapping (api:, inference:, environments:, ...)")
    data = {**data, **(overrides or {})}
    data.setdefault("base_dir", str(file.resolve().parent))
    try:
        return RunSpec.model_validate(data)
    except ValidationError as exc:
        raise RunSpecError(f"{path}: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    """Pydantic's errors as ``field.path: message`` lines."""
    lines = []
    for err in exc.errors():
        where = ""
        for part in err["loc"]:
            where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else str(part))
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(f"{where or 'run'}: {message}")
    return "; ".join(lines)
