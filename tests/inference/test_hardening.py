"""``atropos-serve`` under hostile or careless clients, driven over HTTP on 127.0.0.1.

Out-of-range sampling parameters are refused at the request (400 naming the field) and never
reach the shared batch, where they used to fail every request generating alongside.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.inference.conftest import SERVED_NAME, start_server

PROMPT_IDS = [504, 3458, 282, 4649, 314]
VOCAB = 49152  # the tiny model's (SmolLM2's tokenizer)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    server = start_server(
        tmp_path_factory,
        tiny_model_dir,
        "--dtype",
        "float32",
        "--served-model-name",
        SERVED_NAME,
        "--max-request-bytes",
        "8M",
    )
    try:
        yield server
    finally:
        server.stop()


# (fields, the field the error must name). Each passes the JSON schema (ints, finite floats).
BAD_SAMPLING = [
    ({"stop_token_ids": [1_000_000], "min_tokens": 2}, "stop_token_ids"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"top_k": 10_000_000_000_000_000_000}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 2**70}, "seed"),
    ({"n": 2**70}, "n"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"min_tokens": 2**70}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -1e300}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"temperature": -1.0}, "temperature"),
]

# Python's JSON parser reads these words as floats; a request must not.
NON_FINITE = ["NaN", "Infinity", "-Infinity"]
FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


def _bodies(fields: dict) -> list[tuple[str, dict]]:
    """The same sampling fields on each generating route."""
    return [
        ("/v1/completions", {"model": SERVED_NAME, "prompt": "x", "max_tokens": 4, **fields}),
        (
            "/v1/chat/completions",
            {
                "model": SERVED_NAME,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 4,
                **fields,
            },
        ),
        ("/generate", {"prompt": {"prompt_token_ids": PROMPT_IDS}, "max_tokens": 4, **fields}),
    ]


async def test_bad_sampling_values_fail_alone_with_a_400_naming_the_field(server):
    long_body = {
        "prompt": {"prompt_token_ids": PROMPT_IDS},
        "n": 2,
        "max_tokens": 400,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        # Requests generating while the bad ones arrive must not notice them.
        long_running = asyncio.create_task(client.post("/generate", json=long_body))
        for _ in range(100):
            if (await client.get("/health")).json()["running"]:
                break
            await asyncio.sleep(0.05)
        for fields, param in BAD_SAMPLING:
            for path, body in _bodies(fields):
                if path == "/v1/chat/completions" and "max_tokens" in fields:
                    body["max_completion_tokens"] = body.pop("max_tokens")
                reply = await client.post(path, json=body)
                assert reply.status_code == 400, (path, fields, reply.text)
                error = reply.json()["error"]
                assert error["param"] == param and param in error["message"], (path, error)
        for name in FLOAT_FIELDS:
            for word in NON_FINITE:
                for path, body in _bodies({}):
                    raw = json.dumps(body)[:-1] + f', "{name}": {word}}}'
                    reply = await client.post(
                        path, content=raw, headers={"content-type": "application/json"}
                    )
                    assert reply.status_code == 400, (path, name, word, reply.text)
                    assert reply.json()["error"]["param"] == name
        chat = _bodies({"logprobs": True, "top_logprobs": 2**70})[1]
        reply = await client.post(chat[0], json=chat[1])
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_logprobs"
        # A top_k past the vocabulary is as good as none (vLLM clamps it too).
        reply = await client.post("/generate", json=_bodies({"top_k": VOCAB * 4})[2][1])
        assert reply.status_code == 200, reply.text
        done = await long_running
    assert done.status_code == 200, done.text
    assert [len(ids) for ids in done.json()["token_ids"]] == [400, 400]
    assert done.json()["finish_reasons"] == ["length", "length"]


def _health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def _wait_until_idle(url: str, deadline_s: float = 120.0) -> dict:
    """Poll /health until nothing runs or waits (a hang guard, not a speed assertion)."""
    import time

    deadline = time.monotonic() + deadline_s
    health = _health(url)
    while (health["running"] or health["waiting"]) and time.monotonic() < deadline:
        time.sleep(0.1)
        health = _health(url)
    return health


def _wait_until_running(url: str, rows: int) -> None:
    import time

    deadline = time.monotonic() + 60
    while _health(url)["running"] < rows and time.monotonic() < deadline:
        time.sleep(0.02)


LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 1.0}
ABANDONED = [
    ("/generate", {"prompt": {"prompt_token_ids": PROMPT_IDS}, "n": 8, **LONG}, 8),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": "go", "n": 8, **LONG}, 8),
    ("/v1/completions", {"model": SERVED_NAME, "prompt": ["a", "b"], "n": 4, **LONG}, 8),
    (
        "/v1/chat/completions",
        {"model": SERVED_NAME, "messages": [{"role": "user", "content": "go"}], "n": 8, **LONG},
        8,
    ),
]


# /generate does not stream (as vLLM's), so it has only the plain case.
ABANDONED_CASES = [
    pytest.param(path, body, rows, stream, id=f"{name}-{'stream' if stream else 'plain'}")
    for (path, body, rows), name in zip(
        ABANDONED, ["generate", "cmpl", "cmpl2", "chat"], strict=True
    )
    for stream in (False, True)
    if not (stream and path == "/generate")
]


@pytest.mark.parametrize("path,body,rows,stream", ABANDONED_CASES)
def test_a_client_that_goes_away_stops_its_generation(server, path, body, rows, stream):
    """Every sequence of an abandoned request is aborted, streaming or not (the auth
    middleware used to hide the disconnect: 5 timed-out n=8 clients kept 40 rows generating
    for minutes)."""
    assert _wait_until_idle(server.url)["running"] == 0
    before = _health(server.url)["stats"]["generated_tokens"]
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=1.0)) as client:
        if stream:
            with client.stream("POST", path, json={**body, "stream": True}) as reply:
                assert reply.status_code == 200
                lines = reply.iter_lines()
                assert next(lines).startswith("data: ")
                _wait_until_running(server.url, rows)
            # Leaving the block closes the connection with the stream unfinished.
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post(path, json=body)
    health = _wait_until_idle(server.url)
    generated = health["stats"]["generated_tokens"] - before
    assert health["running"] == 0 and health["waiting"] == 0
    # Far short of the rows * 2000 tokens a finished request would have generated.
    assert generated < rows * body["max_tokens"] // 2, generated
    # the aborted request's leftovers are handled, not logged as errors by asyncio
    assert "exception was never retrieved" not in server.log_path.read_text(errors="replace")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc")
def test_weight_reloads_do_not_grow_the_server(tmp_path_factory):
    """RSS after 8 reloads stays within 200 MB of RSS after the first. Each leaked model would
    be ~70 MB here (the weights and their prepacked copies): a server that kept the old
    weights grew by ~650 MB per reload of SmolLM2-135M (bench/serve_reload_rss.py)."""
    from atroposlib.inference.models import build_tiny_model

    root = tmp_path_factory.mktemp("wide")
    model = build_tiny_model(root / "a", seed=0, hidden_size=128)
    other = build_tiny_model(root / "b", seed=1, hidden_size=128)
    server = start_server(tmp_path_factory, model, "--served-model-name", SERVED_NAME)
    try:
        body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 8, "n": 2}
        rss = []
        for i in range(9):
            folder = other if i % 2 == 0 else model
            reply = httpx.post(
                server.url + "/reload_weights", json={"path": str(folder)}, timeout=300
            )
            assert reply.status_code == 200, reply.text
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=300).is_success
            rss.append(_rss_mb(server.proc.pid))
        growth = max(rss[1:]) - rss[0]
        assert growth < 200, f"RSS after each reload (MB): {[round(r) for r in rss]}"
    finally:
        server.stop()


LIMIT = 8 << 20


def test_request_bodies_are_bounded(server):
    """413 past --max-request-bytes, whether Content-Length says so or the body just keeps
    coming; compressed bodies are refused (415) rather than misread."""
    big = {"model": SERVED_NAME, "prompt": "x", "max_tokens": 1, "pad": " " * LIMIT}
    reply = httpx.post(server.url + "/v1/completions", json=big, timeout=60)
    assert reply.status_code == 413, reply.text
    error = reply.json()["error"]
    assert "--max-request-bytes" in error["message"] and str(LIMIT) in error["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "prompt": "x", "pad": "'
        for _ in range(9):
            yield b"y" * (1 << 20)
        yield b'"}'

    reply = httpx.post(
        server.url + "/generate",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert reply.status_code == 413, reply.text
    # Just under the limit is read and answered normally.
    fits = {"model": SERVED_NAME, "prompt": "x", "max_tokens": 1, "pad": " " * (LIMIT - 200)}
    assert httpx.post(server.url + "/v1/completions", json=fits, timeout=60).status_code == 200
    gz = httpx.post(
        server.url + "/v1/completions",
        content=__import__("gzip").compress(json.dumps(fits).encode()),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
        timeout=60,
    )
    assert gz.status_code == 415 and gz.json()["error"]["param"] == "content-encoding"
    assert _health(server.url)["status"] == "ok"


def test_prompts_longer_than_the_context_are_refused(server):
    """A 6 MB text prompt is refused (400, context_length_exceeded) without being tokenized;
    one short enough to tokenize but over the context is refused after."""
    for text in ("hello world " * 500_000, "hello world " * 30_000):
        for path, body in _bodies({}):
            if path == "/v1/chat/completions":
                body["messages"][0]["content"] = text
                param = "messages"
            else:
                body["prompt"] = text
                param = "prompt"
            reply = httpx.post(server.url + path, json=body, timeout=120)
            assert reply.status_code == 400, (path, reply.text[:300])
            error = reply.json()["error"]
            assert error["code"] == "context_length_exceeded", (path, error)
            assert "maximum context length" in error["message"]
            if len(text) > 1_000_000:
                assert error["param"] == param
    assert _health(server.url)["status"] == "ok"


def test_web_pages_cannot_drive_a_loopback_server(server):
    """Bound to loopback: a Host other than a loopback name is refused (DNS rebinding), a
    browser request from another origin may not generate or pause, and nothing tells a
    browser it may read answers or send credentials."""
    port = server.url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(server.url + "/health", headers={"host": host}).status_code == 200
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        reply = httpx.get(server.url + "/v1/models", headers={"host": host})
        assert reply.status_code == 421 and "not served here" in reply.text, host
    generate = {"prompt": {"prompt_token_ids": PROMPT_IDS}, "max_tokens": 2}
    evil = {"origin": "http://evil.example"}
    reply = httpx.post(server.url + "/generate", json=generate, headers=evil)
    assert reply.status_code == 403 and "cross-origin" in reply.text
    reply = httpx.post(server.url + "/pause", headers={"sec-fetch-site": "cross-site"})
    assert reply.status_code == 403 and not _health(server.url)["paused"]
    preflight = httpx.options(
        server.url + "/v1/completions",
        headers={**evil, "access-control-request-method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-credentials" not in preflight.headers
    # Scripts and trainers (no Origin) and same-origin pages are served.
    assert httpx.post(server.url + "/generate", json=generate).status_code == 200
    same = {"origin": server.url, "sec-fetch-site": "same-origin"}
    assert httpx.post(server.url + "/generate", json=generate, headers=same).status_code == 200


def test_cors_allows_listed_origins_without_credentials(tmp_path_factory, tiny_model_dir):
    ui = "http://localhost:3000"
    server = start_server(
        tmp_path_factory,
        tiny_model_dir,
        "--served-model-name",
        SERVED_NAME,
        "--cors-allow-origin",
        ui,
        "--api-key",
        "k",
    )
    try:
        preflight = httpx.options(
            server.url + "/generate",
            headers={
                "origin": ui,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == ui
        assert "access-control-allow-credentials" not in preflight.headers
        reply = httpx.post(
            server.url + "/generate",
            json={"prompt": {"prompt_token_ids": PROMPT_IDS}, "max_tokens": 2},
            headers={"origin": ui, "authorization": "Bearer k", "sec-fetch-site": "same-site"},
        )
        assert reply.status_code == 200, reply.text
        assert reply.headers["access-control-allow-origin"] == ui
        assert "access-control-allow-credentials" not in reply.headers
        other = httpx.post(
            server.url + "/generate",
            json={"prompt": {"prompt_token_ids": PROMPT_IDS}, "max_tokens": 2},
            headers={"origin": "http://evil.example", "authorization": "Bearer k"},
        )
        assert other.status_code == 403
    finally:
        server.stop()
