"""Request bodies of the trajectory API: validate and serialise scored groups. No HTTP here (no
requests, responses or status codes): the middleware (:mod:`atroposlib.api.middleware`) reads,
caps and decompresses a body with :func:`atroposlib.utils.http_guard.read_body` (shared with
atropos-serve), the env router calls these, and what they raise becomes a response there.

* :func:`prepare_groups` parses, validates and serialises scored groups; what it refuses it
  raises as :class:`~atroposlib.api.queue.Refused` with reason ``bad_json`` (not JSON) or
  ``invalid`` (JSON that is not valid scored data), naming the field.
* :class:`GroupParser` runs it inline, in a worker thread, or for big bodies in a worker
  *process*: parsing holds Python's GIL for about 20 ms per MiB, and done in the server's own
  process a 100 MiB body would freeze ``/status`` and ``/batch`` for seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import anyio
import anyio.to_thread
import orjson
from pydantic import TypeAdapter, ValidationError

from atroposlib.api.errors import Refused
from atroposlib.api.models import INT32_MAX
from atroposlib.api.queue import PreparedGroup
from atroposlib.schema import GroupError, ScoredData, check_group, wire_dict

logger = logging.getLogger("atroposlib.api")

#: Bodies at least this large are parsed in a worker thread.
THREAD_BYTES = 64 * 1024
#: Bodies at least this large are parsed in the worker process (about 80 ms of GIL in-process).
PROCESS_BYTES = 4 << 20

_SCORED_ONE = TypeAdapter(ScoredData)
_SCORED_LIST = TypeAdapter(list[ScoredData])
#: Fields of a group that may hold arbitrary JSON (checked for NaN, huge ints, surrogates).
_FREE_FORM = ("messages", "generation_params", "overrides", "group_overrides", "images")
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what orjson (and the trainer's JSON) can hold


# ------------------------------------------------------------------------ scored groups


def _bad_value(value: Any, loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], str]:
    """Path and description of the first value in ``value`` that JSON cannot carry faithfully
    (NaN/Infinity, an integer outside 64 bits, a string with a lone surrogate), or ``((), "")``.
    """
    if isinstance(value, float):
        return (loc, "is not a finite number") if not math.isfinite(value) else ((), "")
    if isinstance(value, bool):
        return (), ""
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            return loc, "is an integer outside the 64-bit range"
        return (), ""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return loc, "holds a lone surrogate (not valid Unicode)"
        return (), ""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return (), ""
    for key, item in items:
        if isinstance(key, str):
            found = _bad_value(key, loc)
            if found[0]:
                return found
        found = _bad_value(item, (*loc, key))
        if found[0]:
            return found
    return (), ""


def _describe(loc: tuple[Any, ...]) -> str:
    name = str(loc[0])
    return name + "".join(f"[{k!r}]" if isinstance(k, str) else f"[{k}]" for k in loc[1:])


def _invalid(msg: str, loc: tuple[Any, ...] = (), kind: str = "value_error") -> Refused:
    return Refused("invalid", msg, loc, kind)


def _not_json(msg: str) -> Refused:
    return Refused("bad_json", f"request body is not valid JSON: {msg}", kind="json_invalid")


def parse_json(raw: bytes) -> Any:
    """``raw`` parsed as JSON, or :class:`Refused` (``bad_json``).

    NaN and Infinity (which Python's json module, and so ``requests``, writes) are accepted
    here, so that the checks after parsing can name the field instead of failing the body.
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _not_json(str(exc)) from None
    except RecursionError:
        raise _not_json("nested too deeply") from None


def _serialise(group: ScoredData, prefix: tuple[Any, ...]) -> bytes:
    """The group's payload (orjson, fields in upstream's order, then the extension fields it
    sets: :func:`~atroposlib.schema.wire_dict`), or :class:`Refused` naming the value that JSON
    cannot carry."""
    for key in _FREE_FORM:  # orjson writes NaN as null: refuse it instead of changing it
        loc, what = _bad_value(getattr(group, key), (key,))
        if loc:
            raise _invalid(f"{_describe(loc)} {what}", (*prefix, *loc))
    try:
        return orjson.dumps(wire_dict(group))
    except orjson.JSONEncodeError as exc:
        for key, value in group.__dict__.items():
            loc, what = _bad_value(value, (key,))
            if loc:
                raise _invalid(f"{_describe(loc)} {what}", (*prefix, *loc)) from None
        raise _invalid(f"group cannot be stored as JSON: {exc}", prefix) from None


def _declared_group_size(group: ScoredData, prefix: tuple[Any, ...]) -> int | None:
    """``group_overrides.group_size``: the size of the group these sequences belong to (see
    :mod:`atroposlib.api.partials`), or None when not set. Refused unless it is a whole number
    of at least the group's own size."""
    overrides = group.group_overrides
    if not isinstance(overrides, dict) or overrides.get("group_size") is None:
        return None
    value = overrides["group_size"]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    size = len(group.tokens)
    if isinstance(value, bool) or not isinstance(value, int) or not size <= value <= INT32_MAX:
        raise _invalid(
            "group_overrides.group_size is the size of the group these sequences belong to: "
            f"a whole number from the group's own {size} sequences up, got {value!r}",
            (*prefix, "group_overrides", "group_size"),
        )
    return value


def prepare_groups(raw: bytes, many: bool) -> list[PreparedGroup]:
    """Parse, validate and serialise scored groups: one ``ScoredData`` object, or a list of
    them when ``many`` (the decompressed body of ``/scored_data`` or ``/scored_data_list``).

    Parsing and type validation happen in one pass in pydantic-core; each group is then
    serialised once (orjson) into the payload that ``/batch`` will concatenate. Raises
    :class:`~atroposlib.api.queue.Refused` (``bad_json`` or ``invalid``) for anything it refuses.
    """
    try:
        parsed = (_SCORED_LIST if many else _SCORED_ONE).validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise _not_json(first["msg"]) from None
        if not first["loc"] and many:
            raise _invalid("body must be a JSON array of scored groups", kind="list_type") from None
        if not first["loc"]:
            raise _invalid(
                "body must be a JSON object (one scored group)", kind="dict_type"
            ) from None
        details = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors]
        raise Refused("invalid", "invalid request body", errors=details) from None
    groups: list[ScoredData] = parsed if many else [parsed]
    if not groups:
        raise _invalid("body is an empty list: send at least one group")

    prepared = []
    for i, group in enumerate(groups):
        prefix: tuple[Any, ...] = (i,) if many else ()
        try:
            check_group(group)
        except GroupError as exc:
            raise _invalid(exc.msg, (*prefix, *exc.loc)) from None
        prepared.append(
            PreparedGroup(
                env_id=group.env_id,
                size=len(group.tokens),
                longest=max(len(t) for t in group.tokens),
                payload=_serialise(group, prefix),
                policy_version=group.policy_version,
                group_size=_declared_group_size(group, prefix),
            )
        )
    return prepared


class ParserGone(Exception):
    """The parser process died (killed for memory?) while it held a body."""


def _exit_with_parent(parent: int) -> None:
    """Parser-process initializer: exit when run-api is gone. A run-api killed outright
    (SIGKILL, the OOM killer) cannot stop its parser, which otherwise waits forever on a queue
    nobody writes to (seen: orphaned parser processes after ``kill -9``)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-run-api", daemon=True).start()


class GroupParser:
    """Runs :func:`prepare_groups` where it costs the event loop least.

    Small bodies inline, medium ones in ``threads`` worker threads (validation holds the GIL, so
    more threads only starve the event loop), and bodies of ``PROCESS_BYTES`` or more in one
    worker process, started on first use: parsing there leaves the GIL to ``/batch`` and
    ``/status``, and its peak memory (about 20x the body) is given back when the parse ends.
    """

    def __init__(self, threads: int, process_bytes: int = PROCESS_BYTES) -> None:
        self._limiter = anyio.CapacityLimiter(threads)
        self._process_bytes = process_bytes
        self._pool: ProcessPoolExecutor | None = None
        self._process_lock = anyio.Lock()

    async def __call__(self, raw: bytes, many: bool) -> list[PreparedGroup]:
        """Prepared groups of ``raw``; raises :class:`~atroposlib.api.queue.Refused` or
        :class:`ParserGone`."""
        if len(raw) < THREAD_BYTES:
            return prepare_groups(raw, many)
        if len(raw) < self._process_bytes:
            groups = await anyio.to_thread.run_sync(
                prepare_groups, raw, many, limiter=self._limiter
            )
        else:
            groups = await self._in_process(raw, many)
        for group in groups:
            # Re-home the payload on this thread: bytes allocated by a worker live in its
            # malloc arena between its short-lived parse buffers, which then cannot be reused
            # (measured: 0.50 MiB RSS per 8x2048 group instead of 0.18).
            group.payload = memoryview(group.payload).tobytes()
        return groups

    async def _in_process(self, raw: bytes, many: bool) -> list[PreparedGroup]:
        async with self._process_lock:  # one big body at a time: its memory is ~20x its size
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_exit_with_parent,
                    initargs=(os.getpid(),),
                )
            pool = self._pool
            future = pool.submit(prepare_groups, raw, many)
            try:
                return await asyncio.wrap_future(future)
            except BrokenProcessPool:
                logger.error("The body parser process died (out of memory?); starting a new one")
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
                raise ParserGone from None

    def close(self) -> None:
        """Stop the worker process, if one was started."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
