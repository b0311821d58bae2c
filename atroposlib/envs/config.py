"""``BaseEnvConfig``: every setting of an environment, with its default and description.

The same fields are the ``--env.*`` command-line flags, the ``env:`` section of a YAML config,
and the env part of CONFIG.md. Field names and defaults are upstream's; the fields after
``custom_thinking_prompt`` are ours (robustness knobs upstream did not have).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, Field, field_validator
from pydantic.fields import FieldInfo

__all__ = ["REASONING_EFFORTS", "BaseEnvConfig", "EvalHandlingEnum", "LocalEnvConfig"]

#: Accepted values of ``reasoning_effort``.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class EvalHandlingEnum(Enum):
    """What training rollouts do while ``evaluate()`` runs."""

    #: Start no new training rollouts until the eval is done (in-flight ones finish).
    STOP_TRAIN = "STOP_TRAIN"
    #: Keep training with at most ``eval_limit_ratio`` of the workers.
    LIMIT_TRAIN = "LIMIT_TRAIN"
    #: Ignore the eval.
    NONE = "NONE"


class BaseEnvConfig(BaseModel):
    """Basic environment configuration (subclass it to add your own fields).

    A subclass changes a default by redeclaring the field with a plain default
    (``group_size: int = 8``): the field keeps its description and bounds from the class that
    declared it, so ``--help``, YAML and CONFIG.md still describe it.
    """

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        fields = cls.model_fields
        changed = False
        for name in cls.__dict__.get("__annotations__", {}):
            info = fields.get(name)
            if info is None or info.description is not None:
                continue
            parent = next(
                (
                    base.model_fields[name]
                    for base in cls.__mro__[1:]
                    if isinstance(base, type)
                    and issubclass(base, BaseModel)
                    and name in base.model_fields
                ),
                None,
            )
            if parent is None:
                continue
            fields[name] = FieldInfo.merge_field_infos(parent, info)
            changed = True
        if changed:
            cls.model_rebuild(force=True)

    group_size: int = Field(
        default=4, ge=1, description="How many responses are grouped together for scoring"
    )
    max_num_workers: int = Field(
        default=-1,
        description="Maximum number of concurrent rollouts; -1 means "
        "max_num_workers_per_node times the number of inference servers",
    )
    max_eval_workers: int = Field(
        default=16, description="Maximum number of workers to use for evaluation"
    )
    max_num_workers_per_node: int = Field(
        default=8, description="Maximum number of workers to use per inference server"
    )
    steps_per_eval: int = Field(
        default=100,
        description="Run evaluate() every time the trainer step crosses a multiple of this "
        "(0 or less: never)",
    )
    eval_version_wait: float = Field(
        default=600.0,
        gt=0,
        description="Seconds an evaluation the trainer pins to a policy version waits for the "
        "inference servers to serve that version before it is refused (run-api's "
        "/eval-request; see docs/compat.md, Evaluations pinned to a policy version)",
    )
    max_token_length: int = Field(
        default=2048,
        gt=0,
        description="Maximum token length used in generations (the generation budget, also "
        "sent to the API; must be positive)",
    )
    eval_handling: EvalHandlingEnum = Field(
        default=EvalHandlingEnum.STOP_TRAIN,
        description="What training does while an eval runs: STOP_TRAIN, LIMIT_TRAIN or NONE",
    )
    eval_limit_ratio: float = Field(
        default=0.5, description="Fraction of training workers allowed during evals (LIMIT_TRAIN)"
    )
    inference_weight: float = Field(
        default=1.0,
        description="Inference weight sent to the API; set to -1 to ignore it if you're doing "
        "something special here.",
    )
    batch_size: int = Field(
        default=-1,
        description="Batch size for training; set by the trainer through the API's /info",
    )
    max_batches_offpolicy: int = Field(
        default=3,
        description="Maximum number of batches to have in the queue before new rollouts pause "
        "(0 or less: no limit)",
    )
    tokenizer_name: str = Field(
        default="NousResearch/DeepHermes-3-Llama-3-3B-Preview",
        description="Hugging Face tokenizer to use (a hub name or a local folder).",
    )
    use_wandb: bool = Field(default=True, description="Whether to use wandb")
    rollout_server_url: str = Field(
        default="http://localhost:8000", description="URL of the rollout server (run-api)"
    )
    total_steps: int = Field(
        default=1000,
        description="Total number of trainer steps to run; -1 takes num_steps from the API",
    )
    wandb_name: str | None = Field(
        default=None,
        description="Name to be grouped by in wandb and sent to the API; defaults to the "
        "environment's class name",
    )
    num_rollouts_to_keep: int = Field(
        default=32, description="Number of rollouts to display on wandb"
    )
    num_rollouts_per_group_for_logging: int = Field(
        default=1,
        description="Number of rollouts per group to keep for logging. If -1, keep all rollouts",
    )
    ensure_scores_are_not_same: bool = Field(
        default=True,
        description="Drop groups whose scores are all identical (groups of one are kept)",
    )
    data_path_to_save_groups: str | None = Field(
        default=None,
        description="If set, every valid group is also written to this JSONL file (an existing "
        "file is never overwritten: _1, _2, ... is added to the name)",
    )
    data_dir_to_save_evals: str | None = Field(
        default=None,
        description="Directory for metrics.json, samples.jsonl and evaluate_config.yaml",
    )
    min_items_sent_before_logging: int = Field(
        default=2,
        description="Minimum number of items sent before logging, if 0 or less, logs every time",
    )
    include_messages: bool = Field(
        default=False,
        description="Whether to include messages in the output transmitted to the trainer",
    )
    min_batch_allocation: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Minimum proportion of a batch this environment should be allocated (0.0-1.0)",
    )
    worker_timeout: float = Field(
        default=600,
        description="Timeout for one rollout, in seconds; -1 means no timeout. A timed-out "
        "rollout is retried (see rollout_retries)",
    )
    thinking_mode: bool = Field(
        default=False,
        description="Whether to enable reasoning/thinking mode in API requests. Automatically "
        "on if reasoning_effort or max_reasoning_tokens are set.",
    )
    reasoning_effort: str | None = Field(
        default=None,
        description="Reasoning effort level: none, minimal, low, medium, high or xhigh "
        "(mapped to low/medium/high for OpenAI models). Default None (not specified).",
    )
    max_reasoning_tokens: int | None = Field(
        default=None,
        ge=1024,
        le=32000,
        description="Maximum tokens for reasoning (1024-32000). Only supported by some "
        "providers (not OpenAI official). Default None (not specified).",
    )
    custom_thinking_prompt: str | None = Field(
        default=None,
        description="Custom system prompt to prepend for thinking mode (not used by BaseEnv "
        "itself).",
    )
    rollout_retries: int = Field(
        default=2,
        ge=0,
        description="How many times a rollout that raises or times out is retried before it "
        "is counted as failed and logged with its traceback",
    )
    send_timeout: float = Field(
        default=900.0,
        gt=0,
        description="Seconds to keep retrying one send to the API while it is down, "
        "restarting, failing (5xx) or full (429) before the data is counted as lost",
    )
    flat_item_retry_prob: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Selective rollouts (GRESO): an item whose last k groups in a row all scored "
        "alike is rolled out again with probability p**k, otherwise skipped before generating "
        "(items recognised by content; a group with a signal resets k). None: every item drawn "
        "is rolled out (upstream)",
    )

    @field_validator("reasoning_effort")
    @classmethod
    def _check_effort(cls, value: str | None) -> str | None:
        if value is not None and value not in REASONING_EFFORTS:
            raise ValueError(f"must be one of {', '.join(REASONING_EFFORTS)}, got {value!r}")
        return value


class LocalEnvConfig(BaseEnvConfig):
    """``BaseEnvConfig`` with the defaults of a local run, which the bundled environments
    share: SmolLM2-135M-Instruct (the tokenizer of the embedded ``atropos-serve``, no Hub
    access), no W&B, 100 trainer steps of 16 sequences, an evaluation every 50 steps.

    An environment's config derives from it and redeclares only what differs
    (``group_size: int = 8``); the env sets ``default_server_configs`` (e.g.
    ``local_server_configs()``) instead of overriding ``config_init``.
    """

    tokenizer_name: str = "SmolLM2-135M-Instruct"
    use_wandb: bool = False
    total_steps: int = 100
    batch_size: int = 16
    steps_per_eval: int = 50
