"""Weight sync through shared memory: ``POST /load_weights_from_shm`` on a real atropos-serve."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.conftest import private_mounts
from tests.inference.conftest import own_tiny_server, reference_logprobs

torch = pytest.importorskip("torch")

PROMPT_IDS = [504, 3458, 282, 4649, 314]


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory, tiny_model_dir):
    yield from own_tiny_server(tmp_path_factory, tiny_model_dir)


def _greedy(url: str) -> tuple[list[int], list[float]]:
    reply = httpx.post(
        url + "/generate",
        json={
            "prompt": {"prompt_token_ids": PROMPT_IDS},
            "logprobs": 0,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return body["token_ids"][0], [list(item[0].values())[0] for item in body["logprobs"][0]]


def _attached_trainer(url: str, model_dir: Path):
    """A float32 copy of the tiny model as the trainer's, and the atropos-serve sync client
    that writes its weights for the server at ``url``."""
    from transformers import AutoModelForCausalLM

    from atroposlib.backends import weight_sync_client

    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    client = weight_sync_client("atropos-serve", url)
    client.attach(trainer)
    return trainer, client


def test_memory_sync_serves_the_trainers_weights(shm_server, tiny_model_dir):
    before_ids, before_lp = _greedy(shm_server.url)
    trainer, client = _attached_trainer(shm_server.url, tiny_model_dir)
    assert client.transport == "shm" and not client.needs_checkpoint
    try:
        for version in (3, 4):  # the second sync reuses the segment
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            seconds = client.sync(None, policy_version=version)
            assert seconds > 0 and client.last_reply["source"] == "shm"
            assert httpx.get(shm_server.url + "/policy_version").json() == {
                "policy_version": version
            }
            ids, served = _greedy(shm_server.url)
            trainer.eval()
            assert served == pytest.approx(reference_logprobs(trainer, PROMPT_IDS, ids), abs=2e-3)
            # and greedy: each served token is the trainer's argmax
            with torch.no_grad():
                logits = trainer(torch.tensor([PROMPT_IDS + ids])).logits[0]
            start = len(PROMPT_IDS) - 1
            assert ids == [int(logits[start + i].argmax()) for i in range(len(ids))]
        assert (ids, served) != (before_ids, before_lp)
        segment = client._writer.path
        assert segment.exists()
    finally:
        client.close()
    assert not segment.exists()


def test_start_lays_out_the_segment_and_serves_the_same_weights(shm_server, tiny_model_dir):
    """A trainer's start pays for the segment (creating and mapping it) by loading its current
    weights under the given version: when the server already serves those weights, what it
    generates does not change, and the first sync reuses the segment."""
    from atroposlib.backends import weight_sync_client

    trainer, first = _attached_trainer(shm_server.url, tiny_model_dir)
    try:
        first.sync(None, policy_version=7)  # the server now serves exactly the trainer's weights
    finally:
        first.close()
    served = _greedy(shm_server.url)
    client = weight_sync_client("atropos-serve", shm_server.url)
    client.attach(trainer)
    try:
        client.start(str(tiny_model_dir), policy_version=7)
        assert client._writer is not None and client._writer.path.exists()
        assert client.last_reply["source"] == "shm" and client.last_reply["policy_version"] == 7
        assert set(client.last_timings) == {"sync_seconds", "shm_write_seconds", "server_seconds"}
        assert httpx.get(shm_server.url + "/policy_version").json() == {"policy_version": 7}
        assert _greedy(shm_server.url) == served
        segment = client._writer.path
        client.sync(None, policy_version=8)
        assert client._writer.path == segment  # the first sync reused it
        assert httpx.get(shm_server.url + "/policy_version").json() == {"policy_version": 8}
    finally:
        client.close()
    assert not segment.exists()
    # no version to load the weights under: start only checks the server
    idle = weight_sync_client("atropos-serve", shm_server.url)
    idle.attach(trainer)
    idle.start(None, policy_version=None)
    assert idle._writer is None
    idle.close()


def test_missing_segment_is_a_400_naming_the_field(shm_server):
    before = httpx.get(shm_server.url + "/policy_version").json()
    reply = httpx.post(
        shm_server.url + "/load_weights_from_shm",
        json={"shm_path": "/dev/shm/atropos-no-such-segment", "policy_version": 99},
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "shm_path" and "no shared-memory segment" in error["message"]
    reply = httpx.post(shm_server.url + "/load_weights_from_shm", json={"policy_version": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "shm_path"
    assert httpx.get(shm_server.url + "/policy_version").json() == before


def test_a_segment_that_does_not_fit_changes_nothing(shm_server, tmp_path):
    from atroposlib.utils.shm_weights import SharedWeightsWriter

    writer = SharedWeightsWriter(directory=tmp_path)
    try:
        path = writer.write([("model.embed_tokens.weight", torch.zeros(3, 3))])
        reply = httpx.post(shm_server.url + "/load_weights_from_shm", json={"shm_path": str(path)})
    finally:
        writer.close()
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "shm_path" and "shape" in reply.text


def test_tied_head_and_dtype_conversion_in_place(tiny_model_dir):
    """A tied LM head follows the embeddings it shares; float32 weights land in bfloat16."""
    from transformers import AutoModelForCausalLM

    from atroposlib.inference.engine import GenerationEngine, _InPlaceUpdate
    from atroposlib.utils.shm_weights import SharedWeightsWriter, read_segment, unique_parameters

    def tied(dtype):
        model = AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, dtype=dtype, tie_word_embeddings=True
        )
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        return model.eval()

    trainer, served = tied(torch.float32), tied(torch.bfloat16)
    with torch.no_grad():
        trainer.model.embed_tokens.weight.mul_(2)
    writer = SharedWeightsWriter()
    try:
        tensors = read_segment(writer.write(unique_parameters(trainer)))
        assert "lm_head.weight" not in tensors  # written once
        fake = SimpleNamespace(model=served, compiled=True)
        GenerationEngine.check_update(fake, tensors)
        GenerationEngine._copy_in_place(fake, _InPlaceUpdate(tensors))
    finally:
        writer.close()
    assert served.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(served.lm_head.weight, trainer.lm_head.weight.to(torch.bfloat16))
    with pytest.raises(ValueError, match="missing"):
        GenerationEngine.check_update(fake, {"model.norm.weight": served.model.norm.weight})


def test_sync_while_generating_swaps_a_filled_spare(shm_server, tiny_model_dir):
    """Idle, new weights are copied in place on the engine's thread (``mode: in_place``); with
    a sequence generating they fill a spare model that is swapped in once it finishes
    (``mode: swap``): the running sequence completes on the old weights and the next request
    runs on the new ones."""
    import threading
    import time

    trainer, client = _attached_trainer(shm_server.url, tiny_model_dir)
    try:
        client.sync(None, policy_version=10)
        assert client.last_reply["mode"] == "in_place"
        long_reply: dict = {}

        def generate_long() -> None:
            reply = httpx.post(
                shm_server.url + "/generate",
                json={
                    "prompt": {"prompt_token_ids": PROMPT_IDS},
                    "max_tokens": 400,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                timeout=300,
            )
            long_reply.update(status=reply.status_code, body=reply.json())

        worker = threading.Thread(target=generate_long)
        worker.start()
        deadline = time.monotonic() + 5
        while httpx.get(shm_server.url + "/health").json().get("running", 0) == 0:
            assert time.monotonic() < deadline, "the long request never started generating"
            time.sleep(0.1)
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        client.sync(None, policy_version=11)
        worker.join(300)
        assert long_reply["status"] == 200
        assert len(long_reply["body"]["token_ids"][0]) == 400
        assert client.last_reply["mode"] == "swap"
        ids, served = _greedy(shm_server.url)
        trainer.eval()
        assert served == pytest.approx(reference_logprobs(trainer, PROMPT_IDS, ids), abs=2e-3)
    finally:
        client.close()


def test_segments_of_killed_trainers_are_deleted_by_the_next_writer(tmp_path):
    """A trainer killed with SIGKILL cannot delete its segment (a model's worth of RAM in
    /dev/shm until reboot): the next writer on the machine does; a live writer's segment and
    files of other names stay. A writer deletes its own at close and when collected."""
    import gc
    import signal
    import subprocess
    import sys
    import textwrap

    from atroposlib.utils.shm_weights import SharedWeightsWriter

    script = textwrap.dedent(
        f"""
        import sys, time, torch
        from atroposlib.utils.shm_weights import SharedWeightsWriter
        writer = SharedWeightsWriter({str(tmp_path)!r})
        print(writer.write([("w", torch.ones(4))]), flush=True)
        time.sleep(600)
        """
    )
    killed = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    alive = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        killed_path = Path(killed.stdout.readline().strip())
        alive_path = Path(alive.stdout.readline().strip())
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        other = tmp_path / "atropos-weights-notapid-x"
        other.write_bytes(b"")
        assert killed_path.exists() and alive_path.exists()
        writer = SharedWeightsWriter(tmp_path)
        assert not killed_path.exists()
        assert alive_path.exists() and other.exists()
        own = writer.write([("w", torch.zeros(2))])
        assert own.exists()
        writer.close()
        assert not own.exists()
        collected = SharedWeightsWriter(tmp_path)
        path = collected.write([("w", torch.zeros(2))])
        del collected
        gc.collect()
        assert not path.exists()
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait(10)


def test_writer_stores_the_readers_dtype_and_the_reader_keeps_one_mapping(tmp_path):
    """``write(dtype=...)`` stores floating-point tensors converted (integers stay); a
    ``SegmentReader`` sees each rewrite of the same file through its kept mapping, a new
    layout of another size, and lets the mapping go once the file is deleted."""
    from atroposlib.utils.shm_weights import SegmentReader, SharedWeightsWriter

    weight = torch.randn(3, 5)
    writer = SharedWeightsWriter(tmp_path)
    reader = SegmentReader()
    try:
        path = writer.write([("w", weight), ("steps", torch.arange(4))], dtype=torch.bfloat16)
        first = reader.read(path)
        assert first["w"].dtype == torch.bfloat16 and first["steps"].dtype == torch.int64
        assert torch.equal(first["w"], weight.to(torch.bfloat16))
        writer.write([("w", weight * 2), ("steps", torch.arange(4))], dtype=torch.bfloat16)
        second = reader.read(path)
        assert torch.equal(second["w"], (weight * 2).to(torch.bfloat16))
        assert second["w"].data_ptr() == first["w"].data_ptr()  # the same mapping
        assert not reader.release_if_gone()
        writer.write([("w", torch.ones(7, 5))])  # float32, another size: laid out anew
        third = reader.read(path)
        assert third["w"].dtype == torch.float32 and torch.equal(third["w"], torch.ones(7, 5))
    finally:
        writer.close()
    assert reader.release_if_gone() and not reader.release_if_gone()
    assert torch.equal(third["w"], torch.ones(7, 5))  # views stay valid while referenced


def test_a_bfloat16_server_gets_bfloat16_weights_and_lets_go_of_the_segment(
    tmp_path_factory, tiny_model_dir
):
    """Against a server that serves in bfloat16, a float32 trainer writes its weights in
    bfloat16 (half the bytes; the rounding the server would do), the served log-probs are
    those of the trainer's weights in bfloat16, and once the trainer closes its segment the
    server drops its kept mapping of it (checked in the server's /proc maps)."""
    import time

    from transformers import AutoModelForCausalLM

    from atroposlib.inference.server import SEGMENT_CHECK_SECONDS
    from atroposlib.utils.shm_weights import read_segment
    from tests.conftest import start_server

    server = start_server(tmp_path_factory, tiny_model_dir, "--dtype", "bfloat16")
    trainer, client = _attached_trainer(server.url, tiny_model_dir)
    maps = Path(f"/proc/{server.proc.pid}/maps")

    def bfloat16_copy() -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        model.load_state_dict(trainer.state_dict())
        return model.eval()

    try:
        for version in (1, 2):
            before = bfloat16_copy()
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            client.sync(None, policy_version=version)
            assert client.last_reply["dtype"] == "bfloat16"
            segment = client._writer.path
            assert {t.dtype for t in read_segment(segment).values()} == {torch.bfloat16}
            assert str(segment) in maps.read_text()  # kept mapped for the next sync
            ids, served = _greedy(server.url)
            expected = reference_logprobs(bfloat16_copy(), PROMPT_IDS, ids)
            # bfloat16 rounding differs between the server's batched, cached steps and one
            # forward pass over the whole sequence (up to 0.063 on a CPU that emulates
            # bfloat16), but the synced weights moved the log-probs by much more than that
            assert served == pytest.approx(expected, abs=0.1)
            stale = reference_logprobs(before, PROMPT_IDS, ids)
            assert max(abs(a - b) for a, b in zip(expected, stale, strict=True)) > 0.3
        client.close()
        deadline = time.monotonic() + SEGMENT_CHECK_SECONDS * 3
        while str(segment) in maps.read_text():
            assert time.monotonic() < deadline, "the server still maps the deleted segment"
            time.sleep(0.2)
    finally:
        client.close()
        server.stop()


def test_a_server_restarted_in_float32_gets_the_weights_again_in_float32(
    tmp_path_factory, tiny_model_dir
):
    """The trainer reads the served dtype once and writes its segment in it. When the server
    was restarted in a wider dtype since (same URL, now float32), the load's reply says so and
    the trainer writes the weights again in float32 at once: the server never serves the
    bfloat16-rounded weights of the first write."""

    from atroposlib.utils.shm_weights import read_segment
    from tests.conftest import ServeProcess, start_server

    first = start_server(tmp_path_factory, tiny_model_dir, "--dtype", "bfloat16")
    second = ServeProcess(
        tiny_model_dir,
        "--dtype",
        "float32",
        log_path=tmp_path_factory.mktemp("serve") / "atropos-serve.log",
    )
    second.port, second.url = first.port, first.url
    trainer, client = _attached_trainer(first.url, tiny_model_dir)
    try:
        client.sync(None, policy_version=1)
        assert client.last_reply["dtype"] == "bfloat16"
        assert {t.dtype for t in read_segment(client._writer.path).values()} == {torch.bfloat16}
        first.stop()
        second.start()
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        client.sync(None, policy_version=2)
        assert client.last_reply["dtype"] == "float32"
        assert {t.dtype for t in read_segment(client._writer.path).values()} == {torch.float32}
        ids, served = _greedy(second.url)
        trainer.eval()
        assert served == pytest.approx(reference_logprobs(trainer, PROMPT_IDS, ids), abs=2e-3)
    finally:
        client.close()
        first.stop()
        second.stop()


_SMALL_SHM_CHECK = """
import os, sys, torch
from transformers import AutoModelForCausalLM
from atroposlib.backends import weight_sync_client
from atroposlib.utils.shm_weights import SegmentSpaceError, SharedWeightsWriter

url, model_dir = sys.argv[1], sys.argv[2]
trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
# the writer alone: refused before a byte is written, nothing left behind (it was SIGBUS)
try:
    SharedWeightsWriter().write(trainer.named_parameters())
except SegmentSpaceError as exc:
    print("writer:", exc.strerror)
print("left:", os.listdir("/dev/shm"))
auto = weight_sync_client("atropos-serve", url)
auto.attach(trainer)
print("auto needs a checkpoint:", auto.needs_checkpoint, auto.transport)
forced = weight_sync_client("atropos-serve", url, transport="shm")
forced.attach(trainer)
try:
    forced.needs_checkpoint
except SegmentSpaceError as exc:
    print("shm:", exc.strerror)
"""


def test_a_dev_shm_too_small_for_the_weights_syncs_through_disk(
    shm_server, tiny_model_dir, tmp_path
):
    """A container's /dev/shm is 64 MiB unless told otherwise, less than SmolLM2-135M's
    weights: writing the segment anyway killed the trainer with SIGBUS (exit 135, no
    message). Run in a mount namespace whose /dev/shm is a 1 MiB tmpfs, against a real
    atropos-serve: ``auto`` syncs through checkpoints, ``shm`` names the fix."""
    import subprocess
    import sys

    script = tmp_path / "check.py"
    script.write_text(_SMALL_SHM_CHECK)
    result = subprocess.run(
        [
            *private_mounts(),
            "sh",
            "-c",
            'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" "$@"',
            sys.executable,
            str(script),
            shm_server.url,
            str(tiny_model_dir),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "writer: the weights need" in out and "/dev/shm has 1 MiB free" in out
    assert "left: []" in out
    assert "auto needs a checkpoint: True disk" in out
    assert "shm: the weights need" in out and "--weight-sync-transport disk" in out
    assert "syncing atropos-serve through checkpoints on disk" in result.stderr
