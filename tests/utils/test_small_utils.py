"""Small upstream utilities: best-of-n selection, tool-call parsing, metrics, display, io."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import subprocess
import sys
from typing import Any

import pytest

from atroposlib.utils.best_of_n_selection import select_best_index
from atroposlib.utils.display import display_metrics_table, format_metrics_table
from atroposlib.utils.io import parse_http_response
from atroposlib.utils.metrics import get_std_min_max_avg
from atroposlib.utils.tool_call_parser import extract_tool_call, parse_tool_call


def test_select_best_index_matches_upstream() -> None:
    assert select_best_index([1, 3, 3, 2], [5, 4, 2, 1]) == 2
    assert select_best_index([1, 3, 3, 2], [5, 4, 2, 1], secondary_lower_is_better=False) == 1
    assert select_best_index([1, 3, 3, 0], [5, 4, 2, 1], primary_higher_is_better=False) == 3
    assert select_best_index([2, 2, 2], [1, 1, 1]) == 0  # full tie: the first


@pytest.mark.parametrize(("primary", "secondary"), [([], []), ([1], []), ([1, 2], [1])])
def test_select_best_index_rejects(primary: list, secondary: list) -> None:
    with pytest.raises(ValueError):
        select_best_index(primary, secondary)


def test_parse_tool_call() -> None:
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    assert parse_tool_call(call) == ("f", {"x": 1}, False)
    single = "<tool_call>{'name': 'f', 'arguments': {'x': 'a'}}</tool_call>"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert parse_tool_call(single, tools) == ("f", {"x": "a"}, False)
    unknown = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert parse_tool_call(unknown, [{"name": "f"}]) == ("-ERROR-", {}, True)
    assert parse_tool_call("no call") == ("-ERROR-", {}, True)
    assert parse_tool_call("<tool_call>not json</tool_call>") == ("-ERROR-", {}, True)
    assert parse_tool_call("<tool_call>[1, 2]</tool_call>") == ("-ERROR-", {}, True)


def test_parse_tool_call_improvements() -> None:
    # An apostrophe inside a JSON string broke upstream's blanket quote replacement.
    call = '<tool_call>{"name": "say", "arguments": {"text": "it\'s"}}</tool_call>'
    assert parse_tool_call(call) == ("say", {"text": "it's"}, False)
    # OpenAI-style arguments given as a JSON string are decoded.
    call = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>'
    assert parse_tool_call(call) == ("f", {"x": 2}, False)
    # Python literals (True/None) from models imitating Python.
    call = "<tool_call>{'name': 'f', 'arguments': {'flag': True, 'v': None}}</tool_call>"
    assert parse_tool_call(call) == ("f", {"flag": True, "v": None}, False)


def test_extract_tool_call() -> None:
    assert extract_tool_call("<a>1</a><b>2</b>", ["b", "a"]) == "2"
    assert extract_tool_call("x") is None
    assert extract_tool_call("<tool_call>\n first \n</tool_call><tool_call>2</tool_call>") == (
        "first"
    )
    assert extract_tool_call("<a.b>x</a.b>", ["a.b"]) == "x"  # tag names are not regexes


def test_get_std_min_max_avg() -> None:
    metrics: dict[str, Any] = {"other": 1}
    out = get_std_min_max_avg("r", [1, 2, 3, 4], metrics)
    assert out is metrics
    assert out == {
        "other": 1,
        "r_mean": 2.5,
        "r_std": pytest.approx(1.118033988749895),
        "r_max": 4.0,
        "r_min": 1.0,
    }
    assert get_std_min_max_avg("r", [], {}) == {}


UPSTREAM_TABLE = """\
|Groups|Version|Filter|n-shot|Metric  |   |   Value|   |Stderr|
|------|-------|------|------|--------|---|-------:|---|-----:|
|gsm8k |1      |none  |      |accuracy| ↑ |  0.5000| ± |0.0000|
|gsm8k |1      |none  |      |avg len |   |123.4560| ± |0.0000|"""


def test_metrics_table_matches_upstream(capsys: pytest.CaptureFixture[str]) -> None:
    metrics = {"eval/accuracy": 0.5, "eval/avg_len": 123.456}
    assert format_metrics_table("gsm8k", metrics) == UPSTREAM_TABLE
    display_metrics_table("gsm8k", metrics, 0.0, 2.5)
    out = capsys.readouterr().out
    assert (
        out
        == f"\nEvaluation Results: gsm8k\n{UPSTREAM_TABLE}\nEvaluation completed in 2.50 seconds\n"
    )
    # Empty metrics and non-numeric values do not crash.
    assert format_metrics_table("t", {}).count("\n") == 1
    assert "n/a" in format_metrics_table("t", {"note": "n/a"})


class _AiohttpLike:
    def __init__(self, status: int, body: Any) -> None:
        self.status, self._body = status, body

    def raise_for_status(self) -> None:
        if self.status >= 400:
            err = RuntimeError("bad status")
            err.status = self.status  # type: ignore[attr-defined]
            raise err

    async def json(self) -> Any:
        return self._body

    async def text(self) -> str:
        return str(self._body)


class _HttpxLike:
    def __init__(self, status_code: int, body: Any) -> None:
        self.status_code, self._body = status_code, body
        self.text = str(body)

    def raise_for_status(self) -> None:
        if self.status_code >= 400:
            raise RuntimeError("bad status")

    def json(self) -> Any:
        return self._body


def test_parse_http_response(caplog: pytest.LogCaptureFixture) -> None:
    assert asyncio.run(parse_http_response(_AiohttpLike(200, {"a": 1}))) == {"a": 1}
    assert asyncio.run(parse_http_response(_HttpxLike(200, [1]))) == [1]
    log = logging.getLogger("test.io")
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError):
        asyncio.run(parse_http_response(_AiohttpLike(503, "overloaded"), log))
    assert "Status: 503" in caplog.text and "overloaded" in caplog.text
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError):
        asyncio.run(parse_http_response(_HttpxLike(500, "boom")))
    assert "Status: 500" in caplog.text and "boom" in caplog.text


def test_pin_mmap_threshold_applies_on_glibc_and_respects_the_users_choice(monkeypatch) -> None:
    """atropos-serve pins glibc's mmap threshold so dropped weights go back to the system; a
    value the user set with MALLOC_MMAP_THRESHOLD_ is left alone."""
    import platform
    import sys

    from atroposlib.utils.memory import pin_mmap_threshold

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    on_glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert pin_mmap_threshold() is on_glibc
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    assert pin_mmap_threshold() is False


_WHERE_BLOCKS_GO = """
import ctypes, json
from atroposlib.utils import memory

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]


def from_heap(size=4 << 20):
    # is a fresh 4 MiB block (a decode step's temporary) inside the [heap] mapping?
    address = libc.malloc(size)
    try:
        for line in open("/proc/self/maps"):
            if line.rstrip().endswith("[heap]"):
                low, high = (int(x, 16) for x in line.split()[0].split("-"))
                if low <= address < high:
                    return True
        return False
    finally:
        libc.free(address)


seen = {"pinned": (memory.pin_mmap_threshold(), from_heap())[1]}
memory.use_heap_for_temporaries()
seen["heap mode"] = from_heap()
with memory.mapped_allocations():
    seen["loading weights"] = from_heap()
    with memory.heap_for_temporaries():
        seen["re-packing inside a load"] = from_heap()
seen["after the load"] = from_heap()
print(json.dumps(seen))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's malloc settings",
)
def test_temporaries_come_from_the_heap_and_weights_get_their_own_mappings() -> None:
    """atropos-serve pins the mmap threshold so dropped weights go back to the system, then
    (use_heap_for_temporaries) takes each generation step's temporaries from the heap, where
    they reuse pages instead of faulting fresh ones in; weights loaded later (inside
    mapped_allocations) are still mapped on their own. Run in a fresh interpreter: the
    settings are process-wide."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _WHERE_BLOCKS_GO], capture_output=True, text=True, env=env,
        check=True,
    )  # fmt: skip
    assert json.loads(out.stdout) == {
        "pinned": False,
        "heap mode": True,
        "loading weights": False,
        "re-packing inside a load": False,
        "after the load": True,
    }


def test_gather_bounded_keeps_order_limits_concurrency_and_shows_progress(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from atroposlib.utils.concurrency import gather_bounded

    running = peak = 0

    async def work(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01 * (5 - i % 5))
        running -= 1
        return i * i

    results = asyncio.run(gather_bounded([work(i) for i in range(12)], 3, desc="eval"))
    assert results == [i * i for i in range(12)]
    assert peak == 3
    err = capsys.readouterr().err
    assert "eval" in err and "12/12" in err


def test_eval_progress_reads_the_latest_bar(tmp_path) -> None:
    from example_trainer.report import eval_progress

    log = tmp_path / "evaluate.log"
    assert eval_progress(log) is None  # no file yet
    log.write_text("INFO starting\r")
    assert eval_progress(log) is None  # no bar yet
    log.write_text(
        "eval:   0%|          | 0/200 [00:00<?, ?item/s]\r"
        "eval:  60%|######    | 120/200 [01:40<01:07,  1.19item/s]"
    )
    assert eval_progress(log) == "120/200 items, 01:40 elapsed, ~01:07 left"
