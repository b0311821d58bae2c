"""One API-key rule and one body cap for every atroposlib service
(``atroposlib.utils.http_guard``): run-api and atropos-serve, each a real process, accept and
refuse the same requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from atroposlib.utils.http_guard import ApiKeyCheck
from tests.conftest import ApiProcess, ServeProcess, start_server

KEY = "guard-Key-4b1e"


def _scope(method: str, path: str, headers: dict[str, str]) -> dict:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }


def test_key_rule() -> None:
    check = ApiKeyCheck(KEY, ("/health",))
    for headers in (
        {"Authorization": f"Bearer {KEY}"},
        {"Authorization": f"bearer  {KEY} "},
        {"X-API-Key": KEY},
        {"Authorization": "Bearer wrong", "X-API-Key": KEY},  # any offered key may match
    ):
        assert check.refusal(_scope("POST", "/x", headers)) is None, headers
    assert check.refusal(_scope("POST", "/x", {})) == "missing"
    for headers in ({"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"X-API-Key": "k"}):
        assert check.refusal(_scope("POST", "/x", headers)) in ("missing", "invalid"), headers
    assert check.refusal(_scope("GET", "/health", {})) is None
    assert check.refusal(_scope("HEAD", "/health", {})) is None
    assert check.refusal(_scope("POST", "/health", {})) == "missing"
    preflight = {"Origin": "http://ui", "Access-Control-Request-Method": "POST"}
    assert check.refusal(_scope("OPTIONS", "/x", preflight)) is None
    assert check.refusal(_scope("OPTIONS", "/x", {})) == "missing"
    assert check.refusal({"type": "websocket", "path": "/health", "headers": []}) == "missing"


@pytest.fixture(scope="module")
def services(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[dict[str, tuple[str, str]]]:
    """run-api and atropos-serve with the same key and a 4 KiB body cap: name -> (url, an
    endpoint that takes a POST body)."""
    log = tmp_path_factory.mktemp("guard") / "run-api.log"
    api = ApiProcess("--api-key", KEY, "--max-request-bytes", "4096", log_path=log).start()
    serve: ServeProcess | None = None
    try:
        serve = start_server(
            tmp_path_factory,
            tiny_model_dir,
            "--dtype",
            "float32",
            "--api-key",
            KEY,
            "--max-request-bytes",
            "4096",
        )
        yield {
            "run-api": (api.url, "/scored_data"),
            "atropos-serve": (serve.url, "/v1/completions"),
        }
    finally:
        api.stop()
        if serve is not None:
            serve.stop()


@pytest.mark.parametrize("service", ["run-api", "atropos-serve"])
def test_both_services_apply_the_same_rule(services, service: str) -> None:
    url, post_path = services[service]
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        head = http.head("/health").status_code
        # open on both; run-api serves HEAD as documented (atropos-serve's route is GET only)
        assert head == 200 if service == "run-api" else head != 401
        refused = [
            {},
            {"Authorization": "Bearer wrong"},
            {"X-API-Key": KEY[:-1]},
            {"Authorization": KEY},  # no scheme
        ]
        for headers in refused:
            assert http.post(post_path, json={}, headers=headers).status_code == 401, headers
        accepted = [
            {"Authorization": f"Bearer {KEY}"},
            {"Authorization": f"BEARER {KEY}"},
            {"X-API-Key": KEY},
        ]
        for headers in accepted:
            reply = http.post(post_path, json={}, headers=headers)
            assert reply.status_code in (400, 422), (headers, reply.status_code, reply.text)
            # past the cap: 413 (counted as the body arrives, whatever Content-Length says)
            big = http.post(post_path, content=b"[" + b"1," * 4096 + b"1]", headers=headers)
            assert big.status_code == 413, (headers, big.text)
