"""``atropos-serve``'s policy version: ``--policy-version`` start value, ``GET /policy_version``
and ``/health``, set by ``/reload_weights`` (its body's value, else +1) once the new weights are
live, unchanged by a reload that fails."""

from __future__ import annotations

import httpx
import pytest

from tests.inference.conftest import SERVED_NAME, start_server


@pytest.fixture(scope="module")
def versioned_server(tmp_path_factory, tiny_model_dir):
    server = start_server(
        tmp_path_factory,
        tiny_model_dir,
        "--dtype",
        "float32",
        "--served-model-name",
        SERVED_NAME,
        "--policy-version",
        "5",
        "--api-key",
        "sekret",
    )
    try:
        yield server
    finally:
        server.stop()


def _version(client: httpx.Client) -> int:
    reply = client.get("/policy_version")
    assert reply.status_code == 200, reply.text
    assert set(reply.json()) == {"policy_version"}
    return reply.json()["policy_version"]


def test_policy_version_follows_reloads(versioned_server, tiny_model_dir, tiny_model_dir_b):
    headers = {"Authorization": "Bearer sekret"}
    with httpx.Client(base_url=versioned_server.url, headers=headers, timeout=120) as client:
        assert _version(client) == 5
        assert client.get("/health").json()["policy_version"] == 5
        assert httpx.get(versioned_server.url + "/policy_version").status_code == 401

        # no version in the body: +1, reported in the reply and from then on
        reply = client.post("/reload_weights", json={"path": str(tiny_model_dir_b)})
        assert reply.status_code == 200, reply.text
        assert reply.json()["policy_version"] == 6
        assert _version(client) == 6

        # the trainer says which step the weights are
        reply = client.post(
            "/reload_weights", json={"path": str(tiny_model_dir), "policy_version": 42}
        )
        assert (reply.status_code, reply.json()["policy_version"]) == (200, 42)
        assert _version(client) == 42
        assert client.get("/health").json()["policy_version"] == 42

        # a bad version or a reload that fails leaves it alone
        for bad in (-1, "43", 1.5, 1 << 63):
            reply = client.post(
                "/reload_weights", json={"path": str(tiny_model_dir_b), "policy_version": bad}
            )
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"] == "policy_version"
        reply = client.post(
            "/reload_weights", json={"path": str(tiny_model_dir_b / "nope"), "policy_version": 50}
        )
        assert reply.status_code == 400
        assert _version(client) == 42


def test_policy_version_flag_is_validated():
    from atroposlib.inference.cli import parse_settings

    assert parse_settings([]).policy_version == 0
    assert parse_settings(["--policy-version", "7"]).policy_version == 7
    with pytest.raises(SystemExit):
        parse_settings(["--policy-version", "-1"])
