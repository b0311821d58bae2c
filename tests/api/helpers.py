"""Builders for wire payloads used across the API tests."""

from __future__ import annotations

from typing import Any

import httpx


def registration(batch_size: int = 4, max_token_len: int = 2048, **extra: Any) -> dict[str, Any]:
    """A ``/register`` body as upstream trainers send it."""
    body = {
        "wandb_group": "group",
        "wandb_project": "project",
        "batch_size": batch_size,
        "max_token_len": max_token_len,
        "checkpoint_dir": "checkpoints",
        "save_checkpoint_interval": 10,
        "starting_step": 0,
        "num_steps": 100,
    }
    body.update(extra)
    return body


def env_registration(name: str = "env", group_size: int = 2, **extra: Any) -> dict[str, Any]:
    body = {
        "max_token_length": 512,
        "desired_name": name,
        "weight": 1.0,
        "group_size": group_size,
    }
    body.update(extra)
    return body


def group(
    size: int = 2, length: int = 4, env_id: int | None = None, tag: int = 0
) -> dict[str, Any]:
    """A valid scored group of ``size`` sequences of ``length`` tokens. ``tag`` marks it: every
    token of the group is ``tag`` so tests can tell groups apart in batches."""
    return {
        "tokens": [[tag] * length for _ in range(size)],
        "masks": [[-100] + [tag] * (length - 1) for _ in range(size)],
        "scores": [float(i % 2) for i in range(size)],
        "env_id": env_id,
    }


def start_run(client: httpx.Client, batch_size: int = 4, **extra: Any) -> None:
    """Register a trainer and make its first /batch call, which opens env registration."""
    assert client.post("/register", json=registration(batch_size, **extra)).status_code == 200
    assert client.get("/batch").status_code == 200


def add_env(client: httpx.Client, **kwargs: Any) -> int:
    reply = client.post("/register-env", json=env_registration(**kwargs)).json()
    assert reply["status"] == "success", reply
    return reply["env_id"]


def tags(batch: list[dict[str, Any]]) -> list[int]:
    """The tag of each group in a batch (see :func:`group`)."""
    return [g["tokens"][0][0] for g in batch]
