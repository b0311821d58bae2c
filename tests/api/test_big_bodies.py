"""Request bodies are bounded: gzip is inflated only up to the cap, bodies held at once share a
byte budget (503 + Retry-After past it), and big bodies are parsed outside the server's process
with the same answers as small ones."""

from __future__ import annotations

import gzip
import json
import socket
import zlib

import httpx
import orjson

from tests.api.helpers import group, registration, start_run


def _bomb(inflated: int) -> bytes:
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [comp.compress(b"\0" * (1 << 20)) for _ in range(inflated >> 20)]
    return b"".join(parts) + comp.flush()


def _metrics(client: httpx.Client) -> dict:
    return client.get("/metrics", params={"format": "json"}).json()


def test_gzip_bomb_is_refused_without_inflating_it(start_api) -> None:
    server = start_api("--max-request-bytes", "1M")
    bomb = _bomb(256 << 20)  # 256 KiB on the wire
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for path in ("/scored_data", "/scored_data_list"):
            reply = client.post(path, content=bomb, headers={"Content-Encoding": "gzip"})
            assert reply.status_code == 413, reply.text
            assert "exceeds the limit of 1048576 bytes" in reply.text
            assert "--max-request-bytes" in reply.text
        assert _metrics(client)["refused"]["body_too_large"] == 2
        # the cap counts decompressed bytes: 1M + 1 of JSON whitespace in 1 KiB of gzip
        padded = b" " * (1 << 20) + orjson.dumps(group(1))
        reply = client.post(
            "/scored_data", content=gzip.compress(padded), headers={"Content-Encoding": "gzip"}
        )
        assert reply.status_code == 413
        ok = gzip.compress(b" " * 1000 + orjson.dumps(group(1)))
        assert client.post("/scored_data", content=ok, headers={"Content-Encoding": "gzip"}).json()
        assert client.get("/status").json()["queue_size"] == 1


def test_default_cap_is_64_mib(api: httpx.Client) -> None:
    """The default cap was 256 MiB, under which a 246 KiB gzip body made the parser peak at
    6.4 GB (it takes up to 26x the body); 64 MiB bounds that at about 1.7 GB."""
    headers = {"Content-Encoding": "gzip"}
    padded = b" " * ((64 << 20) - 200) + orjson.dumps(group(1))
    assert len(padded) <= 64 << 20
    reply = api.post("/scored_data", content=gzip.compress(padded, 1), headers=headers)
    assert reply.json() == {"status": "received"}
    over = b" " * (64 << 20) + orjson.dumps(group(1))
    reply = api.post("/scored_data", content=gzip.compress(over, 1), headers=headers)
    assert reply.status_code == 413 and "limit of 67108864 bytes" in reply.text


def test_other_endpoints_take_small_bodies_only(api: httpx.Client) -> None:
    body = json.dumps(registration(pad="x" * (2 << 20))).encode()
    reply = api.post("/register", content=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == 413 and "for this endpoint" in reply.text
    # gzip bodies are decompressed for every endpoint, as upstream
    zipped = gzip.compress(json.dumps(registration()).encode())
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    reply = api.post("/register", content=zipped, headers=headers)
    assert reply.status_code == 200 and isinstance(reply.json()["uuid"], int)
    assert api.get("/info").json()["batch_size"] == 4


def test_gzip_members_and_browser_path(api: httpx.Client) -> None:
    """Concatenated gzip members are one body; a request with Origin (the framework path)
    gets the same treatment as the fast lane."""
    start_run(api, batch_size=2)
    raw = orjson.dumps(group(2, tag=7))
    two_members = gzip.compress(raw[:10]) + gzip.compress(raw[10:])
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    assert api.post("/scored_data", content=two_members, headers=headers).status_code == 200
    browser = {**headers, "Origin": api.base_url.scheme + "://" + api.base_url.netloc.decode()}
    reply = api.post("/scored_data", content=gzip.compress(raw), headers=browser)
    assert reply.status_code == 200, reply.text
    bad = api.post("/scored_data", content=b"\x1f\x8bnope", headers=browser)
    assert bad.status_code == 400 and bad.text == "Invalid gzip payload"
    batch = api.get("/batch").json()["batch"]
    assert batch[0]["tokens"] == group(2, tag=7)["tokens"]


def test_bodies_held_at_once_share_a_budget(start_api) -> None:
    server = start_api(
        "--max-request-bytes", "1M", "--ingest-budget-bytes", "1M", "--retry-after-s", "3"
    )
    body = orjson.dumps(group(2, length=20_000))  # ~160 KB
    with socket.create_connection(("127.0.0.1", server.port)) as slow:
        # a client that sends most of a 900 KB body, then stalls
        slow.sendall(
            b"POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            b"\r\nContent-Length: 921600\r\n\r\n" + b" " * 900_000
        )
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for _ in range(50):  # the server reads the stalled body at its own pace
                reply = client.post("/scored_data", content=body)
                if reply.status_code == 503:
                    break
            assert reply.status_code == 503, reply.text
            assert reply.headers["retry-after"] == "3"
            assert "--ingest-budget-bytes" in reply.text
            assert _metrics(client)["refused"]["busy"] >= 1
    # the stalled client went away: its share of the budget is back
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(50):
            reply = client.post("/scored_data", content=body)
            if reply.status_code == 200:
                break
        assert reply.status_code == 200, reply.text


def test_big_body_parsed_out_of_process_answers_the_same(start_api) -> None:
    """Bodies of 4 MiB or more are parsed in a worker process: same acceptance, same errors."""
    server = start_api()
    n = 1_200_000  # ~5 MiB of JSON per group
    with httpx.Client(base_url=server.url, timeout=120) as client:
        start_run(client, batch_size=1, max_token_len=2 * n)
        big = {"tokens": [[5] * n], "masks": [[-100] * n], "scores": [0.5]}
        raw = orjson.dumps(big)
        assert len(raw) > 4 << 20
        bad_score = raw.replace(b'"scores":[0.5]', b'"scores":[NaN]')
        reply = client.post("/scored_data", content=bad_score)
        assert reply.status_code == 422 and "scores[0] is not a finite" in reply.text
        huge_int = raw.replace(b"[5,", b"[18446744073709551616,", 1)
        reply = client.post("/scored_data", content=huge_int)
        assert reply.status_code == 422, reply.text
        assert "tokens[0][0]" in reply.text and "64-bit" in reply.text
        reply = client.post("/scored_data", content=raw[:-1])
        assert reply.status_code == 400 and "not valid JSON" in reply.text
        assert client.post("/scored_data", content=raw).json() == {"status": "received"}
        served = client.get("/batch").json()["batch"][0]
        assert served["tokens"] == big["tokens"] and served["scores"] == [0.5]


def test_parser_process_exits_when_run_api_is_killed(start_api) -> None:
    """``kill -9`` of run-api leaves no parser process behind (it used to wait forever)."""
    import time

    import psutil

    server = start_api()
    n = 1_200_000
    with httpx.Client(base_url=server.url, timeout=120) as client:
        start_run(client, batch_size=1, max_token_len=2 * n)
        raw = orjson.dumps({"tokens": [[5] * n], "masks": [[-100] * n], "scores": [0.5]})
        assert client.post("/scored_data", content=raw).json() == {"status": "received"}
    api = psutil.Process(server.proc.pid)
    parsers = [
        p for p in api.children(recursive=True) if "multiprocessing" in " ".join(p.cmdline())
    ]
    assert parsers, [p.cmdline() for p in api.children(recursive=True)]
    server.kill9()
    deadline = time.monotonic() + 15
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in parsers):
        assert time.monotonic() < deadline, "the parser process outlived run-api"
        time.sleep(0.2)
