"""Web pages cannot drive a loopback run-api: Host check, no cross-origin writes, CORS opt-in.
Non-browser clients (no Origin, no Sec-Fetch-Site), as upstream's trainers and envs, are not
affected."""

from __future__ import annotations

import httpx

from tests.api.helpers import group, registration, start_run

EVIL = "http://evil.example"


def test_host_header_must_name_this_machine(api: httpx.Client, api_server) -> None:
    port = api_server.port
    for host in (f"127.0.0.1:{port}", "localhost", f"LOCALHOST:{port}", "[::1]:9", "localhost."):
        assert api.get("/status", headers={"Host": host}).status_code == 200, host
    for host in (f"evil.example:{port}", "evil.example", "127.0.0.1.evil.example"):
        reply = api.get("/status", headers={"Host": host})
        assert reply.status_code == 421, host
        assert "--allowed-hosts" in reply.json()["detail"]
    # DNS rebinding: the page's origin and host agree, and both are the attacker's name
    reply = api.post(
        "/scored_data",
        json=group(1),
        headers={"Host": "evil.example", "Origin": "http://evil.example"},
    )
    assert reply.status_code == 421
    assert api.get("/status").json()["queue_size"] == 0


def test_allowed_hosts_flag(start_api) -> None:
    server = start_api("--allowed-hosts", "trainer-box, api.internal")
    with httpx.Client(base_url=server.url) as client:
        assert client.get("/info", headers={"Host": "api.internal:8000"}).status_code == 200
        assert client.get("/info", headers={"Host": "trainer-box"}).status_code == 200
        assert client.get("/info", headers={"Host": "other"}).status_code == 421


def test_cross_origin_pages_cannot_change_state(api: httpx.Client, api_server) -> None:
    start_run(api, batch_size=1)
    assert api.post("/scored_data", json=group(1)).status_code == 200
    own = f"http://127.0.0.1:{api_server.port}"
    refused = [
        ("GET", "/reset_data", {"Sec-Fetch-Site": "cross-site"}),  # <img src=...>, a link
        ("GET", "/reset_data", {"Origin": EVIL}),
        ("GET", "/batch", {"Sec-Fetch-Site": "same-site"}),  # another port of localhost
        ("POST", "/scored_data", {"Origin": EVIL, "Content-Type": "text/plain"}),
        ("POST", "/register", {"Origin": "null"}),
        ("POST", "/reset_data", {"Sec-Fetch-Site": "cross-site", "Origin": EVIL}),
    ]
    for method, path, headers in refused:
        kwargs = {"json": group(1)} if method == "POST" else {}
        reply = api.request(method, path, headers=headers, **kwargs)
        assert reply.status_code == 403, (method, path, headers)
        assert "cross-origin request refused" in reply.json()["detail"]
    assert api.get("/status").json()["queue_size"] == 1  # nothing changed
    # reads are fine from anywhere (without CORS headers a page cannot see them)
    reply = api.get("/status", headers={"Origin": EVIL, "Sec-Fetch-Site": "cross-site"})
    assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers
    # the API's own pages (/docs) and typed URLs still work
    same = {"Origin": own, "Sec-Fetch-Site": "same-origin"}
    assert api.post("/scored_data", json=group(1), headers=same).status_code == 200
    assert api.post("/scored_data", json=group(1), headers={"Origin": own}).status_code == 200
    assert api.get("/batch", headers={"Sec-Fetch-Site": "none"}).json()["batch"]
    # trainers and envs send neither header
    assert api.get("/batch").json()["batch"]
    assert api.get("/reset_data").status_code == 200


def test_cors_is_opt_in(api: httpx.Client, start_api) -> None:
    preflight = {"Origin": EVIL, "Access-Control-Request-Method": "POST"}
    reply = api.options("/scored_data", headers=preflight)
    assert "access-control-allow-origin" not in reply.headers
    assert "access-control-allow-credentials" not in reply.headers

    old = start_api("--cors-allow-origin", "*", "--cors-credentials")
    with httpx.Client(base_url=old.url) as client:  # upstream's behaviour, asked for
        reply = client.options("/scored_data", headers=preflight)
        assert reply.headers["access-control-allow-origin"] == EVIL
        assert reply.headers["access-control-allow-credentials"] == "true"
        reply = client.post("/register", json=registration(), headers={"Origin": EVIL})
        assert reply.status_code == 200
        assert reply.headers["access-control-allow-origin"] == EVIL

    one = start_api("--cors-allow-origin", "http://localhost:3000")
    with httpx.Client(base_url=one.url) as client:
        ok = {"Origin": "http://localhost:3000", "Sec-Fetch-Site": "same-site"}
        reply = client.get("/reset_data", headers=ok)
        assert reply.status_code == 200
        assert reply.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "access-control-allow-credentials" not in reply.headers
        assert client.get("/reset_data", headers={"Origin": EVIL}).status_code == 403
