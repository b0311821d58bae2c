"""Bad input gets a 4xx naming the problem, never a 500; the server stays correct afterwards."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import pytest

from tests.api.helpers import add_env, env_registration, group, registration, start_run, tags

ENV = 0  # the env registered by the fixture below


def _group(**changes: Any) -> dict[str, Any]:
    body = group(size=2, length=4, env_id=ENV)
    body.update(changes)
    return body


def _raw(data: bytes, **headers: str) -> dict[str, Any]:
    return {"content": data, "headers": {"Content-Type": "application/json", **headers}}


# (id, method, path, request kwargs, expected status, text the error must mention)
CASES: list[tuple[str, str, str, dict[str, Any], int, str]] = [
    ("not json", "POST", "/scored_data", _raw(b"{tokens:"), 400, "not valid JSON"),
    ("empty body", "POST", "/scored_data", _raw(b""), 400, "not valid JSON"),
    ("array for one group", "POST", "/scored_data", {"json": [_group()]}, 422, "JSON object"),
    ("string body", "POST", "/scored_data", {"json": "tokens"}, 422, "JSON object"),
    (
        "missing tokens",
        "POST",
        "/scored_data",
        {"json": {"masks": [[1]], "scores": [1]}},
        422,
        "tokens",
    ),
    (
        "missing masks",
        "POST",
        "/scored_data",
        {"json": {"tokens": [[1]], "scores": [1]}},
        422,
        "masks",
    ),
    (
        "missing scores",
        "POST",
        "/scored_data",
        {"json": {"tokens": [[1]], "masks": [[1]]}},
        422,
        "scores",
    ),
    ("tokens not lists", "POST", "/scored_data", {"json": _group(tokens=[1, 2])}, 422, "tokens"),
    (
        "token is text",
        "POST",
        "/scored_data",
        {"json": _group(tokens=[["a"] * 4] * 2)},
        422,
        "tokens",
    ),
    (
        "score is text",
        "POST",
        "/scored_data",
        {"json": _group(scores=["high", 1.0])},
        422,
        "scores",
    ),
    (
        "empty group",
        "POST",
        "/scored_data",
        {"json": _group(tokens=[], masks=[], scores=[])},
        422,
        "empty",
    ),
    (
        "empty sequence",
        "POST",
        "/scored_data",
        {"json": _group(tokens=[[], [1]], masks=[[], [1]])},
        422,
        "tokens[0] is empty",
    ),
    (
        "masks count",
        "POST",
        "/scored_data",
        {"json": _group(masks=[[-100, 1, 1, 1]])},
        422,
        "masks has 1 entries",
    ),
    (
        "mask length",
        "POST",
        "/scored_data",
        {"json": _group(masks=[[-100, 0, 0], [-100, 0, 0, 0]])},
        422,
        "masks[0]",
    ),
    (
        "scores count",
        "POST",
        "/scored_data",
        {"json": _group(scores=[1.0])},
        422,
        "scores has 1 entries",
    ),
    (
        "advantages count",
        "POST",
        "/scored_data",
        {"json": _group(advantages=[[0.1] * 4])},
        422,
        "advantages has 1",
    ),
    (
        "advantages length",
        "POST",
        "/scored_data",
        {"json": _group(advantages=[[0.1] * 3, [0.1] * 4])},
        422,
        "advantages[0]",
    ),
    (
        "logprobs count",
        "POST",
        "/scored_data",
        {"json": _group(inference_logprobs=[[0.0] * 4] * 3)},
        422,
        "inference_logprobs has 3",
    ),
    (
        "logprobs length",
        "POST",
        "/scored_data",
        {"json": _group(inference_logprobs=[[0.0] * 4, [0.0] * 5])},
        422,
        "inference_logprobs[1]",
    ),
    (
        "overrides count",
        "POST",
        "/scored_data",
        {"json": _group(overrides=[{}])},
        422,
        "overrides has 1",
    ),
    (
        "override not dict",
        "POST",
        "/scored_data",
        {"json": _group(overrides=[1, 2])},
        422,
        "overrides",
    ),
    (
        "message not dict",
        "POST",
        "/scored_data",
        {"json": _group(messages=[["hello"], ["x"]])},
        422,
        "messages",
    ),
    (
        "message without role",
        "POST",
        "/scored_data",
        {"json": _group(messages=[[{"content": "x"}]] * 2)},
        422,
        "role",
    ),
    (
        "messages count",
        "POST",
        "/scored_data",
        {"json": _group(messages=[[{"role": "user", "content": "x"}]] * 3)},
        422,
        "messages has 3",
    ),
    (
        "NaN score",
        "POST",
        "/scored_data",
        _raw(b'{"tokens":[[1]],"masks":[[1]],"scores":[NaN]}'),
        422,
        "scores[0] is not a finite",
    ),
    (
        "inf advantage",
        "POST",
        "/scored_data",
        _raw(b'{"tokens":[[1]],"masks":[[1]],"scores":[1],"advantages":[[Infinity]]}'),
        422,
        "advantages[0][0]",
    ),
    (
        "unknown env_id",
        "POST",
        "/scored_data",
        {"json": _group(env_id=99)},
        422,
        "unknown env_id 99",
    ),
    (
        "negative env_id",
        "POST",
        "/scored_data",
        {"json": _group(env_id=-1)},
        422,
        "unknown env_id -1",
    ),
    ("env_id is text", "POST", "/scored_data", {"json": _group(env_id="zero")}, 422, "env_id"),
    (
        "longer than max_token_len",
        "POST",
        "/scored_data",
        {"json": _group(tokens=[[1] * 65] * 2, masks=[[1] * 65] * 2)},
        422,
        "max_token_len of 64",
    ),
    (
        "group larger than batch",
        "POST",
        "/scored_data",
        {"json": group(size=9)},
        422,
        "can never fit a batch of 8",
    ),
    (
        "distill shape",
        "POST",
        "/scored_data",
        {"json": _group(distill_token_ids=[[[1]], [[1]]], distill_logprobs=[[[0.0]], []])},
        422,
        "distill_logprobs[1]",
    ),
    (
        "bad gzip",
        "POST",
        "/scored_data",
        _raw(b"\x1f\x8b garbage", **{"Content-Encoding": "gzip"}),
        400,
        "Invalid gzip",
    ),
    (
        "truncated gzip",
        "POST",
        "/scored_data",
        _raw(gzip.compress(json.dumps(_group()).encode())[:-12], **{"Content-Encoding": "gzip"}),
        400,
        "Invalid gzip",
    ),
    ("list not array", "POST", "/scored_data_list", {"json": _group()}, 422, "JSON array"),
    ("empty list", "POST", "/scored_data_list", {"json": []}, 422, "empty list"),
    (
        "one bad in list",
        "POST",
        "/scored_data_list",
        {"json": [_group(), _group(scores=[1.0])]},
        422,
        "scores has 1",
    ),
    (
        "register missing field",
        "POST",
        "/register",
        {"json": {"batch_size": 4}},
        422,
        "wandb_group",
    ),
    (
        "register zero batch",
        "POST",
        "/register",
        {"json": registration(batch_size=0)},
        422,
        "batch_size",
    ),
    (
        "register text batch",
        "POST",
        "/register",
        {"json": registration(batch_size="many")},
        422,
        "batch_size",
    ),
    (
        "register-env null name",
        "POST",
        "/register-env",
        {"json": {"max_token_length": 1, "desired_name": None, "weight": 1, "group_size": 1}},
        422,
        "desired_name",
    ),
    (
        "register-env zero group",
        "POST",
        "/register-env",
        {"json": {"max_token_length": 1, "desired_name": "x", "weight": 1, "group_size": 0}},
        422,
        "group_size",
    ),
    (
        "register-env allocation > 1",
        "POST",
        "/register-env",
        {
            "json": {
                "max_token_length": 1,
                "desired_name": "x",
                "weight": 1,
                "group_size": 1,
                "min_batch_allocation": 1.5,
            }
        },
        422,
        "min_batch_allocation",
    ),
    ("status-env no id", "GET", "/status-env", {}, 422, "env_id"),
    ("status-env text id", "GET", "/status-env", {"params": {"env_id": "a"}}, 422, "integer"),
    ("status-env unknown", "POST", "/status-env", {"json": {"env_id": 7}}, 404, "unknown env_id 7"),
    ("status-env body not json", "POST", "/status-env", _raw(b"{"), 400, "not valid JSON"),
    (
        "disconnect unknown",
        "POST",
        "/disconnect-env",
        {"json": {"env_id": 5}},
        404,
        "unknown env_id 5",
    ),
    ("disconnect no body", "POST", "/disconnect-env", {}, 422, "body"),
    # values JSON can carry but a 64-bit JSON encoder (orjson, the trainer's) cannot
    (
        "token >= 2**64",
        "POST",
        "/scored_data",
        _raw(b'{"tokens":[[18446744073709551616]],"masks":[[1]],"scores":[1]}'),
        422,
        "tokens[0][0] is an integer outside the 64-bit range",
    ),
    (
        "mask < -2**63",
        "POST",
        "/scored_data",
        _raw(b'{"tokens":[[1]],"masks":[[-9223372036854775809]],"scores":[1]}'),
        422,
        "masks[0][0]",
    ),
    (
        "env_id >= 2**64",
        "POST",
        "/scored_data",
        _raw(b'{"tokens":[[1]],"masks":[[1]],"scores":[1],"env_id":99999999999999999999999}'),
        422,
        "env_id",
    ),
    (
        "huge int in group_overrides",
        "POST",
        "/scored_data_list",
        {"json": [_group(group_overrides={"seed": 2**70})]},
        422,
        "group_overrides['seed']",
    ),
    (
        "lone surrogate in messages",
        "POST",
        "/scored_data",
        _raw(
            b'{"tokens":[[1]],"masks":[[1]],"scores":[1],'
            b'"messages":[[{"role":"user","content":"a\\ud800"}]]}'
        ),
        400,
        "hex escape",
    ),
    (
        "NaN in generation_params",
        "POST",
        "/scored_data",
        _raw(b'{"tokens":[[1]],"masks":[[1]],"scores":[1],"generation_params":{"t":NaN}}'),
        422,
        "generation_params['t'] is not a finite number",
    ),
    (
        "NaN ref_logprobs",
        "POST",
        "/scored_data",
        _raw(b'{"tokens":[[1]],"masks":[[1]],"scores":[1],"ref_logprobs":[[NaN]]}'),
        422,
        "ref_logprobs[0][0] is not a finite",
    ),
    (
        "NaN distill_logprobs",
        "POST",
        "/scored_data",
        _raw(
            b'{"tokens":[[1]],"masks":[[1]],"scores":[1],"distill_token_ids":[[[1,2]]],'
            b'"distill_logprobs":[[[0.0,NaN]]]}'
        ),
        422,
        "distill_logprobs[0][0][1] is not a finite",
    ),
    (
        "deeply nested list",
        "POST",
        "/scored_data_list",
        _raw(b"[" * 5000 + b"]" * 5000),
        400,
        "not valid JSON",
    ),
    (
        "status-env deeply nested",
        "POST",
        "/status-env",
        _raw(b'{"env_id":' + b"[" * 5000 + b"]" * 5000 + b"}"),
        400,
        "nested too deeply",
    ),
    (
        "status-env GET deeply nested",
        "GET",
        "/status-env",
        _raw(b"[" * 100_000 + b"]" * 100_000),
        400,
        "not valid JSON",
    ),
    ("status-env NaN id", "POST", "/status-env", _raw(b'{"env_id":NaN}'), 422, "integer"),
    (
        "status-env huge query id",
        "GET",
        "/status-env",
        {"params": {"env_id": "9" * 40}},
        404,
        "unknown env_id",
    ),
    (
        "disconnect huge id",
        "POST",
        "/disconnect-env",
        {"json": {"env_id": 2**70}},
        404,
        "unknown env_id",
    ),
    (
        "register deeply nested",
        "POST",
        "/register",
        _raw(b"[" * 100_000 + b"]" * 100_000),
        400,
        "error parsing the body",
    ),
    (
        "register batch 1e30",
        "POST",
        "/register",
        {"json": registration(batch_size=1e30)},
        422,
        "batch_size",
    ),
    (
        "register starting_step 1e30",
        "POST",
        "/register",
        {"json": registration(starting_step=1e30)},
        422,
        "starting_step",
    ),
    (
        "register num_steps 2**64",
        "POST",
        "/register",
        {"json": registration(num_steps=2**64)},
        422,
        "num_steps",
    ),
    (
        "register surrogate project",
        "POST",
        "/register",
        _raw(json.dumps(registration(wandb_project="a\ud800")).encode()),
        422,
        "wandb_project",
    ),
    (
        "register-env surrogate name",
        "POST",
        "/register-env",
        _raw(json.dumps(env_registration(name="a\ud800")).encode()),
        422,
        "desired_name",
    ),
    (
        "register-env long name",
        "POST",
        "/register-env",
        {"json": env_registration(name="n" * 257)},
        422,
        "desired_name",
    ),
    (
        "register-env NaN weight",
        "POST",
        "/register-env",
        _raw(json.dumps(env_registration(weight=float("nan"))).encode()),
        422,
        "weight",
    ),
    (
        "register-env inf allocation",
        "POST",
        "/register-env",
        _raw(json.dumps(env_registration(min_batch_allocation=float("inf"))).encode()),
        422,
        "min_batch_allocation",
    ),
    (
        "register-env huge length",
        "POST",
        "/register-env",
        {"json": env_registration(max_token_length=2**64)},
        422,
        "max_token_length",
    ),
    ("metrics bad format", "GET", "/metrics?format=%ED%A0%80", {}, 422, "format"),
    ("wrong method", "POST", "/batch", {}, 405, "Method Not Allowed"),
    ("unknown path", "GET", "/nope", {}, 404, "Not Found"),
]


@pytest.fixture()
def running(api: httpx.Client) -> httpx.Client:
    start_run(api, batch_size=8, max_token_len=64)
    assert add_env(api, group_size=2) == ENV
    return api


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "mention"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_request_is_a_clear_4xx(
    running: httpx.Client, method: str, path: str, kwargs: dict, status: int, mention: str
) -> None:
    reply = running.request(method, path, **kwargs)
    assert reply.status_code == status, reply.text
    assert mention in reply.text


def test_server_is_still_correct_after_every_bad_request(running: httpx.Client) -> None:
    before = running.get("/metrics", params={"format": "json"}).json()
    for _, method, path, kwargs, _, _ in CASES:
        assert 400 <= running.request(method, path, **kwargs).status_code < 500
    assert running.get("/status").json() == {"current_step": 0, "queue_size": 0}
    assert running.get("/info").json() == {"batch_size": 8, "max_token_len": 64}
    for tag in range(4):
        assert running.post("/scored_data", json=group(2, env_id=ENV, tag=tag)).status_code == 200
    assert tags(running.get("/batch").json()["batch"]) == [0, 1, 2, 3]
    after = running.get("/metrics", params={"format": "json"}).json()
    refused = sum(after["refused"].values()) - sum(before["refused"].values())
    assert refused >= 30
    assert after["accepted_groups"] - before["accepted_groups"] == 4


def test_oversized_body_is_refused(start_api) -> None:
    server = start_api("--max-request-bytes", "2K")
    with httpx.Client(base_url=server.url) as client:
        big = group(size=2, length=500)
        reply = client.post("/scored_data", json=big)
        assert reply.status_code == 413 and "--max-request-bytes" in reply.text
        bomb = gzip.compress(json.dumps(big).encode())
        assert len(bomb) < 2048
        reply = client.post("/scored_data", content=bomb, headers={"Content-Encoding": "gzip"})
        assert reply.status_code == 413
        assert client.post("/scored_data", json=group(size=1)).status_code == 200


def test_max_token_len_zero_means_no_limit_and_says_so(start_api) -> None:
    """Upstream's trainers may register ``max_token_len <= 0`` for "no limit": kept, and the
    server logs a warning instead of silently checking nothing."""
    server = start_api()
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.post("/register", json=registration(4, max_token_len=0)).status_code == 200
        assert client.get("/batch").status_code == 200
        reply = client.post("/scored_data", json=group(size=2, length=5000))
        assert reply.status_code == 200, reply.text
    assert "max_token_len=0: sequences of any length are accepted" in server.log_path.read_text()
