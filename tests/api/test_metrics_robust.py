"""/metrics and /wandb_info stay well-formed whatever names a run carries."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import httpx

from tests.api.helpers import add_env, start_run

#: One Prometheus text-format sample: name, optional labels, value.
_SAMPLE = re.compile(r'^atropos_\w+(\{(\w+="([^"\\\n]|\\[\\"n])*",?)*\})? \S+$')


def test_label_values_are_escaped(api: httpx.Client) -> None:
    start_run(api)
    add_env(api, name='a"b\nc\\d')
    text = api.get("/metrics").text
    for line in text.splitlines():
        assert line.startswith("# ") or _SAMPLE.match(line), line
    assert 'name="a\\"b\\nc\\\\d_0"' in text
    assert api.get("/metrics", params={"format": "json"}).json()["envs"][0]["name"] == (
        'a"b\nc\\d_0'
    )


def test_invalid_unicode_from_an_old_store_does_not_break_metrics(
    start_api, tmp_path: Path
) -> None:
    """A store written before lone surrogates were refused keeps /metrics and /wandb_info up."""
    store = tmp_path / "run.sqlite3"
    server = start_api("--store", str(store))
    with httpx.Client(base_url=server.url) as client:
        start_run(client)
        add_env(client, name="x")
    server.stop()
    with sqlite3.connect(store) as db:  # what an older run-api let in
        db.execute("UPDATE envs SET record = replace(record, '\"x_0\"', '\"x\\ud800_0\"')")
        db.execute("UPDATE meta SET value = replace(value, '\"project\"', '\"p\\udfff\"')")
    server = start_api("--store", str(store))
    with httpx.Client(base_url=server.url) as client:
        reply = client.get("/metrics", params={"format": "json"})
        assert reply.status_code == 200
        assert reply.json()["envs"][0]["name"] == "x\ud800_0"
        reply = client.get("/metrics")
        assert reply.status_code == 200 and 'name="x\\\\ud800_0"' in reply.text
        reply = client.get("/wandb_info")
        assert reply.status_code == 200 and reply.json()["project"] == "p\udfff"
