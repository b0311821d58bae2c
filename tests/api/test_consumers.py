"""Several trainers on one run-api (the ranks of a multi-process trainer, or two
``TrainerClient``\\ s), each registering and acknowledging: every batch goes to one of them.
Before, an acknowledging trainer got every batch another one had not acknowledged yet, so both
trained on everything. And a trainer whose run-api restarted without its store registers again
instead of failing. Real run-api processes over loopback HTTP."""

from __future__ import annotations

import logging

import httpx
import pytest

from atroposlib.api.client import TrainerClient, TrajectoryAPIError
from tests.api.helpers import add_env, group, registration, tags

REG = {"batch_size": 4, "max_token_len": 64, "num_steps": 10}


def feed(url: str, groups: int, first_tag: int = 0) -> None:
    """Open env registration (a /batch was asked for) and send ``groups`` groups of 2."""
    with httpx.Client(base_url=url, timeout=30) as api:
        env = add_env(api, group_size=2)
        for tag in range(first_tag, first_tag + groups):
            assert api.post("/scored_data", json=group(2, env_id=env, tag=tag)).is_success


def test_each_batch_goes_to_one_rank(api_server) -> None:
    url = api_server.url
    httpx.get(url + "/reset_data")
    ranks = [TrainerClient(url, rank=r) for r in (0, 1)]
    for client in ranks:
        client.register(**REG)
    assert ranks[0].try_batch() is None  # opens env registration
    feed(url, 12)
    got: dict[int, list[list[int]]] = {0: [], 1: []}
    for i in range(6):
        rank = i % 2
        got[rank].append(tags(ranks[rank].get_batch(timeout=10)))
    everything = [t for batches in got.values() for b in batches for t in b]
    assert sorted(everything) == list(range(12))  # each group once, to one rank
    assert httpx.get(url + "/status").json()["current_step"] == 6  # one step per batch

    # rank 1's last response is lost: only rank 1 gets that batch again
    with httpx.Client(base_url=url, timeout=10) as raw:
        feed(url, 4, first_tag=100)
        lost = raw.get("/batch", params={"ack": ranks[1].last_step, "rank": 1})
        assert lost.headers["X-Atropos-Step"] == "7"
    assert tags(ranks[0].get_batch(timeout=10)) == [102, 103]
    again = ranks[1].try_batch()
    assert again is not None and tags(again) == [100, 101] and ranks[1].last_step == 7
    for client in ranks:
        client.close()


def test_two_clients_on_one_rank_do_not_both_train(api_server) -> None:
    """The second one to register takes the rank over (it could be the first one, restarted):
    the first is refused from then on, with a message that says why."""
    url = api_server.url
    httpx.get(url + "/reset_data")
    first, second = TrainerClient(url), TrainerClient(url)
    first.register(**REG)
    assert first.try_batch() is None
    feed(url, 6)
    assert tags(first.get_batch(timeout=10)) == [0, 1]
    second.register(**REG)
    # not acknowledged by the first: handed to the second, as to a restarted trainer
    assert tags(second.get_batch(timeout=10)) == [0, 1]
    with pytest.raises(TrajectoryAPIError, match="registered after this one"):
        first.try_batch()
    assert tags(second.get_batch(timeout=10)) == [2, 3]
    assert tags(second.get_batch(timeout=10)) == [4, 5]
    first.close()
    second.close()


def test_batch_parameters_are_checked(api: httpx.Client) -> None:
    uuid = api.post("/register", json=registration(4)).json()["uuid"]
    for params, where in (({"rank": -1}, "rank"), ({"consumer": "x"}, "consumer")):
        reply = api.get("/batch", params={"ack": 0, **params})
        assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["query", where]
    reply = api.get("/batch", params={"ack": 0, "consumer": uuid + 1})
    assert reply.status_code == 409
    (detail,) = reply.json()["detail"]
    assert detail["type"] == "unknown_consumer" and detail["loc"] == ["query", "consumer"]
    assert "restarted without its store" in detail["msg"]
    assert api.get("/batch", params={"ack": 0, "consumer": uuid}).json() == {"batch": None}


def test_client_registers_again_when_run_api_lost_the_run(
    start_api, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_api()
    client = TrainerClient(server.url)
    client.register(**REG)
    assert client.try_batch() is None
    feed(server.url, 2)
    assert tags(client.get_batch(timeout=10)) == [0, 1] and client.last_step == 1

    server.stop()  # restarted without a store: the registration, the step, the queue are gone
    again = start_api(port=server.port)
    with caplog.at_level(logging.WARNING, logger="atroposlib.api.client"):
        assert client.try_batch() is None  # registered again, at step 1
    assert "registering again at step 1" in caplog.text
    assert httpx.get(again.url + "/info").json()["batch_size"] == 4
    feed(again.url, 2, first_tag=10)
    assert tags(client.get_batch(timeout=10)) == [10, 11] and client.last_step == 2

    httpx.get(again.url + "/reset_data")  # the same after a reset
    assert client.try_batch() is None
    assert httpx.get(again.url + "/status").json()["current_step"] == 2
    client.close()
