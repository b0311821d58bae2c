"""What ``atropos-sft-gen`` and ``atropos-dpo-gen`` are asked to do: one pydantic model each,
the source of their flags, ``--help`` and CONFIG.md tables (:mod:`atroposlib.utils.cli`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

DEFAULT_API_URL = "http://localhost:8000"
DEFAULT_TOKENIZER = "NousResearch/DeepHermes-3-Llama-3-8B-Preview"
#: Groups per batch ``atropos-dpo-gen`` registers for (``batch_size = group_size * 8``).
DPO_GROUPS_PER_BATCH = 8


class DatagenError(Exception):
    """A problem the user can fix (bad flag, unreachable server, file in the way)."""


class DatagenOptions(BaseModel):
    """The options both data tools share (upstream's names and defaults)."""

    filepath: str = Field(
        description="JSONL file to write (refused if it exists, see --append-to-previous)."
    )
    api_url: str = Field(
        DEFAULT_API_URL, description="Trajectory API (run-api) address. Its data is reset at start."
    )
    group_size: int = Field(2, ge=1, description="Sequences per group the environments send.")
    max_token_len: int = Field(
        2048, ge=1, description="Longest sequence (tokens) accepted; registered with the API."
    )
    tokenizer: str = Field(
        DEFAULT_TOKENIZER,
        description="Tokenizer to decode tokens with: a local folder or a Hugging Face name (the "
        "cache is tried first, so it works offline once cached). Use the tokenizer of the model "
        "your environments sample from.",
    )
    save_messages: bool = Field(
        False,
        description="Write each sequence's message list instead of prefix/completion text "
        "(environments must send messages: include_messages).",
    )
    num_seqs_to_save: int = Field(100, ge=1, description="Stop after writing this many lines.")
    allow_negative_scores: bool = Field(
        False,
        description="Keep sequences of any score. Without it only scores > 0 are kept (a score "
        "of exactly 0 is dropped too).",
    )
    minimum_score_diff_max_min: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="Minimum score margin."
    )
    append_to_previous: bool = Field(
        False, description="Append to FILEPATH if it exists instead of refusing to start."
    )
    format: Literal["atropos", "trl"] = Field(
        "atropos",
        description="atropos: upstream's line shapes; trl: shapes TRL trainers read directly "
        "(conversational when the groups carry messages).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Logging level."
    )


class SftOptions(DatagenOptions):
    """``atropos-sft-gen``: the top-scoring sequences of every group."""

    minimum_score_diff_max_min: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="When > 0, keep only sequences scoring more than this above their group's "
        "lowest score.",
    )
    save_top_n_per_group: int = Field(
        3, ge=1, description="Keep at most this many sequences of each group, best first."
    )
    tasks_per_step: int = Field(
        64, ge=1, description="Groups per batch (batch_size = group_size * tasks_per_step)."
    )


class DpoOptions(DatagenOptions):
    """``atropos-dpo-gen``: (chosen, rejected) pairs from the same group."""

    group_size: int = Field(
        2,
        ge=2,
        description="Sequences per group the environments send (at least 2: a pair needs two "
        "sequences of a group).",
    )
    minimum_score_diff_max_min: float = Field(
        0.5,
        ge=0,
        allow_inf_nan=False,
        description="A pair is written only when chosen score - rejected score is more than this.",
    )
    save_n_pairs_per_group: int = Field(
        3, ge=1, description="Draw at most this many pairs from each group."
    )
    seed: int | None = Field(
        None, description="Seed for drawing rejected sequences (reproducible pairs)."
    )
