"""Wire types of the trajectory API (field names and validation; no queues, no HTTP).

The scored-group schema (``ScoredData``, ``check_group``, the key lists) is defined once in
:mod:`atroposlib.schema` and re-exported here; this module adds the registration bodies.
Field names, types and defaults are upstream Atropos's.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field

from atroposlib.schema import (
    GROUP_KEYS,
    PER_SEQUENCE_KEYS,
    GroupError,
    ScoredData,
    check_group,
)

__all__ = [
    "GROUP_KEYS",
    "PER_SEQUENCE_KEYS",
    "EnvIdentifier",
    "EvalRequestBody",
    "EvalResultBody",
    "GroupError",
    "RegisterEnv",
    "Registration",
    "ScoredData",
    "check_group",
]

#: Longest env name (``desired_name``) accepted by ``/register-env``.
MAX_NAME_CHARS = 256
#: Longest other text field of a registration (W&B names, checkpoint path).
MAX_TEXT_CHARS = 4096
#: Bounds of registration integers (sizes, steps, intervals): a signed 32-bit int.
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


def valid_unicode(value: str) -> str:
    """``value`` if it can be written as UTF-8; a lone surrogate (``"\\ud800"`` in JSON)
    cannot, and would break every response and log line that carries it."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text holds a lone surrogate (not valid Unicode)") from None
    return value


Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS), AfterValidator(valid_unicode)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), AfterValidator(valid_unicode)]
Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class Registration(BaseModel):
    """``POST /register``: a trainer announces itself and the shape of the batches it wants."""

    wandb_group: Text = Field(description="W&B group that environments should log under.")
    wandb_project: Text = Field(description="W&B project that environments should log under.")
    batch_size: Int32 = Field(description="Number of sequences in each batch handed out.")
    max_token_len: Int32 = Field(
        description="Longest sequence (in tokens) the trainer accepts; longer ones are refused. "
        "A value <= 0 means no limit (upstream's meaning), logged as a warning."
    )
    checkpoint_dir: Text = Field(
        description="Where the trainer saves checkpoints (echoed to envs)."
    )
    save_checkpoint_interval: Int32 = Field(description="Steps between trainer checkpoints.")
    starting_step: Int32 = Field(description="Step to start counting from (resumed runs).")
    num_steps: Int32 = Field(description="Total number of steps the trainer will take.")


class RegisterEnv(BaseModel):
    """``POST /register-env``: an environment joins the run."""

    max_token_length: Int32 = Field(description="The environment's generation budget in tokens.")
    desired_name: Name = Field(description="Name prefix; the API appends `_k` to make it unique.")
    weight: Finite = Field(description="Relative share of inference capacity for this env.")
    group_size: Int32 = Field(description="Sequences per group this env sends.")
    min_batch_allocation: Finite | None = Field(
        default=None,
        description="Guaranteed fraction (0..1) of every batch reserved for this env's data.",
    )
    eval_requests: bool = Field(
        default=False,
        description="Not in upstream: this env answers evaluations a trainer pins to a policy "
        "version (/eval-request). Upstream's run-api ignores the field.",
    )


class EvalRequestBody(BaseModel):
    """``POST /eval-request``: a trainer asks every env to evaluate the weights of a version."""

    policy_version: Int32 = Field(ge=0, description="Version of the weights to evaluate.")
    step: Int32 | None = Field(default=None, description="Trainer step the result belongs to.")


class EvalResultBody(BaseModel):
    """``POST /eval-result``: an env's answer to one evaluation request."""

    request_id: Int32 = Field(description="The request answered (from /status-env).")
    env_id: Int32 = Field(description="The answering env's id.")
    policy_version: Int32 = Field(description="Version of the weights the env evaluated.")
    status: Literal["done", "refused", "failed"] = Field(description="What became of it.")
    metrics: dict[Name, Finite] = Field(
        default_factory=dict, description="The env's evaluation metrics (name -> value)."
    )
    reason: Text = Field(default="", description="Why it was refused or failed.")
    seconds: Finite = Field(default=0.0, ge=0, description="How long the evaluation took.")


class EnvIdentifier(BaseModel):
    """Body of ``/disconnect-env`` and ``/status-env``."""

    env_id: int
