"""``run-api --api-key``: every endpoint but the liveness probes needs the key, and every client
(an env process, ``TrainerClient``) sends it from ``ATROPOS_API_KEY``. Real run-api processes."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from atroposlib.api.client import TrainerClient, TrajectoryAPIError
from atroposlib.api.server import create_app
from atroposlib.api.settings import ApiSettings
from atroposlib.cli.run_api import parse_settings
from tests.conftest import ApiProcess
from tests.envs.helpers import COUNTING_ENV, start_env, stop

KEY = "k3y-7f1c9e-Only-For-This-Test"
#: Open without the key: liveness probes (upstream's ``GET /`` and ``GET /health``).
OPEN = {("GET", "/"), ("GET", "/health")}


def _flat(routes: list) -> Iterator:
    """Every route, the routes of included routers too (recent FastAPI keeps an included
    router as one entry of ``app.routes``)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _flat(inner.routes)
        else:
            yield route


def _routes() -> list[tuple[str, str]]:
    """Every (method, path) the application serves, read from the app itself so a route added
    later is checked too (HEAD is Starlette's copy of GET)."""
    app = create_app(ApiSettings())
    found = set()
    for route in _flat(app.routes):
        path = re.sub(r"\{[^}]+\}", "1", route.path)
        for method in getattr(route, "methods", None) or ():
            if method != "HEAD":
                found.add((method, path))
    return sorted(found)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    """run-api with --api-key, logging at debug (access lines and all) so the log test can
    look for the key in everything the server writes."""
    log = tmp_path_factory.mktemp("keyed") / "run-api.log"
    server = ApiProcess("--api-key", KEY, "--log-level", "debug", log_path=log).start()
    yield server
    server.stop()


def test_every_route_needs_the_key(keyed: ApiProcess) -> None:
    routes = _routes()
    assert ("POST", "/scored_data") in routes and ("GET", "/openapi.json") in routes
    assert OPEN <= set(routes)
    wrong = [{"Authorization": "Bearer not-" + KEY}, {"X-API-Key": KEY[:-1]}]
    right = [{"Authorization": f"Bearer {KEY}"}, {"X-API-Key": KEY}]
    with httpx.Client(base_url=keyed.url, timeout=10) as http:
        refused_before = _refused(http)
        for method, path in routes:
            plain = http.request(method, path)
            if (method, path) in OPEN:
                assert plain.status_code == 200, (method, path)
                continue
            assert plain.status_code == 401, (method, path, plain.text)
            assert "requires a key" in plain.json()["detail"]
            assert plain.headers["www-authenticate"].startswith("Bearer")
            for headers in wrong:
                bad = http.request(method, path, headers=headers)
                assert bad.status_code == 401, (method, path, headers)
                assert "invalid API key" in bad.json()["detail"]
            for headers in right:
                assert http.request(method, path, headers=headers).status_code != 401, (
                    method,
                    path,
                    headers,
                )
        # a refused request's body is never read, whatever its size
        big = http.post("/scored_data", content=b"x" * (2 << 20))
        assert big.status_code == 401
        refused = _refused(http) - refused_before
    closed = len(routes) - len(OPEN)
    assert refused == 3 * closed + 1  # no key, two wrong keys per route, the big body


def _refused(http: httpx.Client) -> int:
    metrics = http.get("/metrics", params={"format": "json"}, headers={"X-API-Key": KEY}).json()
    return metrics["refused"].get("unauthorized", 0)


def test_trainer_client_needs_the_right_key(keyed: ApiProcess, monkeypatch) -> None:
    monkeypatch.delenv("ATROPOS_API_KEY", raising=False)
    with TrainerClient(keyed.url) as client, pytest.raises(TrajectoryAPIError) as exc:
        client.status(timeout=5)
    assert "401" in str(exc.value) and "ATROPOS_API_KEY" in str(exc.value)
    monkeypatch.setenv("ATROPOS_API_KEY", KEY)
    with TrainerClient(keyed.url) as client:
        assert "queue_size" in client.status(timeout=5)
    with TrainerClient(keyed.url, api_key="wrong") as client, pytest.raises(TrajectoryAPIError):
        client.status(timeout=5)


def test_env_process_and_trainer_run_with_the_key(
    start_api, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The loop with a keyed API: a real env process with only ATROPOS_API_KEY set registers,
    posts groups that are accepted, and TrainerClient (api_key=) gets them as batches; an env
    without the key stops at once with an error that names ATROPOS_API_KEY."""
    api = start_api("--api-key", KEY)
    flags = ["--env.rollout_server_url", api.url, "--env.tokenizer_name", str(tiny_model_dir)]
    with TrainerClient(api.url, api_key=KEY) as trainer:
        trainer.register(
            batch_size=4,
            max_token_len=64,
            checkpoint_dir="",
            save_checkpoint_interval=-1,
            starting_step=0,
            num_steps=2,
            timeout=10,
        )
        assert trainer.try_batch() is None  # opens env registration
        keyless = start_env(
            COUNTING_ENV, "serve", *flags, "--env.num_items", "4", log=tmp_path / "keyless.log"
        )
        proc = start_env(
            COUNTING_ENV,
            "serve",
            *flags,
            "--env.num_items",
            "4",
            log=tmp_path / "env.log",
            extra_env={"ATROPOS_API_KEY": KEY},
        )
        try:
            batches = [trainer.get_batch(timeout=90) for _ in range(2)]
            assert keyless.wait(60) != 0
        finally:
            stop(proc)
            stop(keyless)
    items = sorted(group["tokens"][0][0] - 1000 for batch in batches for group in batch)
    assert items == [0, 1, 2, 3]
    keyless_log = (tmp_path / "keyless.log").read_text()
    assert "401" in keyless_log and "ATROPOS_API_KEY" in keyless_log, keyless_log[-2000:]
    metrics = httpx.get(f"{api.url}/metrics?format=json", headers={"X-API-Key": KEY}).json()
    assert metrics["accepted_groups"] == 4
    assert metrics["refused"].get("unauthorized", 0) >= 1  # the keyless env's registration


def test_key_never_in_run_api_output(keyed: ApiProcess) -> None:
    """Runs after the route test (same server): the debug log has the startup line and an access
    line per request, never the key."""
    with httpx.Client(base_url=keyed.url, timeout=10) as http:
        http.get("/info", headers={"Authorization": f"Bearer {KEY}"})
        http.get("/info", headers={"X-API-Key": KEY + "x"})
    time.sleep(0.2)
    log = keyed.log_path.read_text()
    assert "API key required" in log and '"GET /info HTTP/1.1" 401' in log, log[-2000:]
    assert KEY not in log and KEY[:-1] not in log


def test_key_from_environment_and_bad_keys_not_echoed(capsys) -> None:
    settings, _ = parse_settings([], {"ATROPOS_API_KEY": " from-env\n"})
    assert settings.api_key == "from-env"
    assert "from-env" not in repr(settings)
    assert parse_settings(["--api-key", "flag"], {"ATROPOS_API_KEY": "env"})[0].api_key == "flag"
    assert parse_settings([], {"ATROPOS_API_KEY": ""})[0].api_key is None
    for argv, environ in ((["--api-key", "clé-secrète"], {}), ([], {"ATROPOS_API_KEY": "clé"})):
        with pytest.raises(SystemExit) as exc:
            parse_settings(argv, environ)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert ("--api-key" in err or "ATROPOS_API_KEY" in err) and "printable ASCII" in err
        assert "clé" not in err


def test_open_bind_without_key_warns(tmp_path: Path) -> None:
    server = ApiProcess("--host", "0.0.0.0", log_path=tmp_path / "run-api.log").start()
    server.stop()
    log = server.log_path.read_text()
    assert "no authentication" in log and "--api-key" in log, log
