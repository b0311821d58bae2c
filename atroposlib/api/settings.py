"""Settings of the trajectory API server: one pydantic model, the source of ``run-api --help``,
the ``ATROPOS_*`` environment variables and the table in CONFIG.md."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
#: Prefix of the environment variables that set :class:`ApiSettings` fields.
ENV_PREFIX = "ATROPOS_"


def parse_size(value: Any) -> int:
    """``"512M"``, ``"1GiB"``, ``"1.5g"`` or a plain number of bytes -> bytes (binary units)."""
    if isinstance(value, bool):
        raise ValueError("expected a size like 512M or 1G")
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size (examples: 1048576, 512M, 1G, 2GiB)")
    number, unit, _ = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


class ApiSettings(BaseModel):
    """How ``run-api`` serves the trajectory API. Every field is also an environment variable
    ``ATROPOS_<FIELD>`` (e.g. ``ATROPOS_MAX_QUEUE_BYTES=2G``); command-line flags win."""

    host: str = Field(
        "127.0.0.1",
        description="Address to bind. Loopback by default; use 0.0.0.0 to accept remote envs "
        "and trainers (upstream's default).",
    )
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on.")
    store: str | None = Field(
        None,
        description="Path of an SQLite file that makes the queue durable: registrations, envs, "
        "queued groups and the step survive a crash or restart. Unset: in memory only.",
    )
    record: bool = Field(
        False,
        description="Keep every batch handed out in --store (its step, its groups in order, "
        "with their policy versions), so that run-api --replay can serve the run again. The "
        "store then grows by every group trained on. Needs --store.",
    )
    replay: str | None = Field(
        None,
        description="Serve the batches recorded in this store (written with --store PATH "
        "--record) to a trainer again instead of taking groups from envs: in their original "
        "batches and steps, or re-packed (--replay-mode), with their original policy "
        "versions. Envs are refused (409); the store is only read. Not with --store, "
        "--record or --max-staleness.",
    )
    replay_mode: Literal["original", "repack"] = Field(
        "original",
        description="--replay: 'original' hands out each recorded batch as it was (same groups, "
        "same order, same step; the trainer's batch_size is not used); 'repack' packs the "
        "recorded groups, in their recorded order, into batches of the batch_size the trainer "
        "registers, stepping from its starting_step.",
    )
    store_sync: Literal["NORMAL", "FULL"] = Field(
        "NORMAL",
        description="SQLite synchronous mode for --store: NORMAL survives process crashes "
        "(kill -9); FULL also survives power loss, at one fsync per POST.",
    )
    max_queue_sequences: int = Field(
        262_144,
        ge=1,
        description="Most sequences held (queued plus buffered partial groups). Past it, POSTs "
        "get 429 with Retry-After.",
    )
    max_queue_bytes: int = Field(
        1 << 30,
        ge=1,
        description="Most serialised bytes held in the queue (accepts 512M, 2G, ...). Past it, "
        "POSTs get 429 with Retry-After.",
    )
    max_request_bytes: int = Field(
        64 << 20,
        ge=1,
        description="Largest request body accepted, after gzip decompression (accepts 64M, ...). "
        "Larger bodies get 413. It bounds the server's memory: parsing a body takes up to 26x "
        "its size (bodies of 4 MiB or more in one worker process, one at a time; about 6x for "
        "token ids and log-probs, 26x for one-digit tokens), so at most about 1.7 GB at 64M.",
    )
    ingest_budget_bytes: int = Field(
        512 << 20,
        ge=1,
        description="Most bytes of request bodies held at once while they are read, "
        "decompressed and parsed, over all requests (accepts 512M, ...; at least "
        "--max-request-bytes). A request that would pass it gets 503 with Retry-After.",
    )
    max_envs: int = Field(
        1024,
        ge=1,
        le=1 << 20,
        description="Most envs a run can register (disconnected ones count: env ids are never "
        "reused). Past it, /register-env gets 409 until /reset_data.",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        le=(1 << 62),
        description="Most versions a group's policy_version may be behind the weights that will "
        "train on it, as TRL counts staleness: the batch of step s is trained on version s-1, "
        "so when it is formed, queued groups with (s - 1) - policy_version greater than this "
        'are dropped, logged and counted as dropped{reason="stale"} in /metrics (0 keeps only '
        "on-policy groups, 1 allows one step behind). Groups without a policy_version are "
        "never stale. Unset: no limit (upstream's behaviour).",
    )
    retry_after_s: int = Field(
        1, ge=0, description="Seconds sent in Retry-After when the queue is full."
    )
    gzip_level: int = Field(
        1,
        ge=1,
        le=9,
        description="gzip level for /batch responses to clients that accept gzip (1 is fastest; "
        "levels above 3 are capped at 3 when the isal compressor is installed, as by default).",
    )
    ingest_threads: int = Field(
        1,
        ge=1,
        le=64,
        description="Worker threads that decompress, validate and serialise posted groups. "
        "Validation holds Python's GIL, so more threads rarely help and can slow /batch.",
    )
    cors_allow_origin: str = Field(
        "",
        description="Origins (comma-separated, e.g. http://localhost:3000) whose web pages may "
        "read answers and call state-changing endpoints; '*' for any (upstream's behaviour, "
        "with --cors-credentials). Default: none.",
    )
    cors_credentials: bool = Field(
        False,
        description="Allow credentials (cookies) on cross-origin requests from "
        "--cors-allow-origin.",
    )
    allowed_hosts: str = Field(
        "",
        description="Host names (comma-separated) accepted in the Host header besides "
        "localhost, 127.0.0.1 and [::1]. The Host check (against DNS rebinding) is on when "
        "bound to loopback or when names are given; other hosts get 421.",
    )
    api_key: str | None = Field(
        None,
        repr=False,
        description="Shared secret that every request must carry (Authorization: Bearer KEY "
        "or X-API-Key: KEY), else 401; GET and HEAD of /health and / stay open for liveness "
        "probes. "
        "Clients (envs, trainers, tools) send the ATROPOS_API_KEY environment variable. Set it "
        "whenever the API is reachable from other machines (--host other than loopback); "
        "prefer the variable to the flag, which other users of the machine can see in ps. "
        "Unset: no authentication (upstream's behaviour).",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Server log level."
    )

    @field_validator("max_queue_bytes", "max_request_bytes", "ingest_budget_bytes", mode="before")
    @classmethod
    def _sizes(cls, value: Any) -> int:
        return parse_size(value)

    @field_validator("api_key", mode="before")
    @classmethod
    def _key(cls, value: Any) -> Any:
        # HTTP drops whitespace around header values: a key read from a file with its newline
        # must still match what clients send
        if isinstance(value, str):
            value = value.strip()
            if not value:
                raise ValueError("must not be empty (leave it unset for no authentication)")
            if not value.isascii() or not value.isprintable():
                raise ValueError(
                    "must be printable ASCII: HTTP headers cannot carry other characters"
                )
        return value

    @model_validator(mode="after")
    def _store_modes(self) -> ApiSettings:
        if self.record and not self.store:
            raise ValueError("record: needs a store to record into (--store PATH --record)")
        if self.replay:
            clash = [
                name
                for name, given in (
                    ("store", self.store),
                    ("record", self.record),
                    ("max_staleness", self.max_staleness is not None),
                )
                if given
            ]
            if clash:
                raise ValueError(
                    f"replay serves a recorded store as it was: not with {', '.join(clash)}"
                )
        return self

    @field_validator("store_sync", "log_level", "replay_mode", mode="before")
    @classmethod
    def _case(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        if value.lower() in ("original", "repack"):
            return value.lower()
        return value.upper() if value.lower() in ("normal", "full") else value.lower()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> ApiSettings:
        """Settings from ``ATROPOS_*`` variables, then ``overrides`` on top."""
        environ = dict(os.environ if environ is None else environ)
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            key = f"{ENV_PREFIX}{name.upper()}"
            if environ.get(key, "") != "":
                values[name] = environ[key]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)
