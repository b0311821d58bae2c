"""Persistence for the trajectory queue: in memory (default, fastest) or SQLite (durable).

The queue (:mod:`atroposlib.api.queue`) holds the truth in memory and tells its store about
every change *before* it acknowledges it. :class:`MemoryStore` ignores the news;
:class:`SqliteStore` writes each change in one transaction to an embedded SQLite database in WAL
mode, so after a crash or ``kill -9`` a restart on the same file finds every acknowledged group
either still queued or already handed out in a batch, never both and never neither.

A store knows nothing about packing rules: it persists groups (opaque serialised payloads with
their size and env), env records and a few metadata values. A group handed out in a batch that
the trainer has not yet acknowledged (``GET /batch?ack=``) stays in the store, marked with the
step of its batch, until the acknowledgement comes; that is what lets a restarted server serve a
lost batch again.

One process at a time: :class:`SqliteStore` takes an exclusive lock on ``PATH.lock`` beside the
database (:class:`StoreLock`), and a second ``run-api`` on the same file stops with
:class:`StoreInUse` naming the holder, instead of serving the same groups twice.

With ``record=True`` (``run-api --record``) every batch handed out is also written to a
``batches`` table (its step, its groups in order, their payloads and policy versions), and
kept: :func:`read_recording` reads it back for ``run-api --replay``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

try:
    import fcntl
except ImportError:  # pragma: no cover - platforms without POSIX locks: no store lock
    fcntl = None  # type: ignore[assignment]


@dataclass(slots=True)
class StoredGroup:
    """A group as the queue keeps it: serialised once at ingest, served as-is. Its
    ``policy_version`` (also in the payload) is kept beside it for the staleness check."""

    gid: int
    env_id: int | None
    size: int
    payload: bytes
    policy_version: int | None = None


@dataclass
class StoredState:
    """Everything a store hands back at start-up."""

    meta: dict[str, Any] = field(default_factory=dict)
    envs: list[dict[str, Any]] = field(default_factory=list)
    queued: list[StoredGroup] = field(default_factory=list)
    buffered: list[StoredGroup] = field(default_factory=list)
    #: batches handed out but not acknowledged: step -> its groups, in batch order
    inflight: dict[int, list[StoredGroup]] = field(default_factory=dict)


class QueueStore(Protocol):
    """What the queue needs from persistence. Each method is one atomic change."""

    def load(self) -> StoredState: ...

    def put_meta(self, values: dict[str, Any]) -> None: ...

    def put_env(self, env_id: int, record: dict[str, Any]) -> None: ...

    def insert(self, groups: list[StoredGroup], buffered: bool) -> None: ...

    def merge(self, removed: list[int], merged: StoredGroup) -> None: ...

    def promote(self, gids: list[int]) -> None: ...

    def take(self, gids: list[int], meta: dict[str, Any], step: int | None = None) -> None: ...

    def take_inflight(self, gids: list[int], step: int, meta: dict[str, Any]) -> None: ...

    def release(self, gids: list[int]) -> None: ...

    def clear(self, meta: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MemoryStore:
    """No persistence: the in-memory queue is the only copy (upstream's behaviour)."""

    durable = False

    def load(self) -> StoredState:
        return StoredState()

    def put_meta(self, values: dict[str, Any]) -> None:
        pass

    def put_env(self, env_id: int, record: dict[str, Any]) -> None:
        pass

    def insert(self, groups: list[StoredGroup], buffered: bool) -> None:
        pass

    def merge(self, removed: list[int], merged: StoredGroup) -> None:
        pass

    def promote(self, gids: list[int]) -> None:
        pass

    def take(self, gids: list[int], meta: dict[str, Any], step: int | None = None) -> None:
        pass

    def take_inflight(self, gids: list[int], step: int, meta: dict[str, Any]) -> None:
        pass

    def release(self, gids: list[int]) -> None:
        pass

    def clear(self, meta: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS envs (env_id INTEGER PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    gid INTEGER PRIMARY KEY,
    env_id INTEGER,
    size INTEGER NOT NULL,
    buffered INTEGER NOT NULL DEFAULT 0,
    payload BLOB NOT NULL,
    served_step INTEGER,
    policy_version INTEGER
);
CREATE TABLE IF NOT EXISTS batches (
    step INTEGER NOT NULL,
    pos INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    env_id INTEGER,
    size INTEGER NOT NULL,
    policy_version INTEGER,
    payload BLOB NOT NULL,
    PRIMARY KEY (step, pos)
);
"""

#: Copies a group, as it is handed out, into the recording (``batches``).
_RECORD = (
    "INSERT INTO batches(step, pos, gid, env_id, size, policy_version, payload) "
    "SELECT ?, ?, gid, env_id, size, policy_version, payload FROM groups WHERE gid=?"
)


class StoreInUse(RuntimeError):
    """Another process holds the store's lock."""


class StoreLock:
    """A POSIX record lock on ``PATH.lock`` beside a store file: exclusive for a server that
    writes the store, shared for readers (``run-api --replay``). The lock belongs to the
    process (opening the same store again in one process succeeds) and goes away with it, also
    on ``kill -9``: a stale lock file is never a problem.

    Raises:
        StoreInUse: Another process holds a conflicting lock (the message names its pid).
    """

    def __init__(self, store_path: Path, shared: bool = False) -> None:
        self.path = store_path.with_name(store_path.name + ".lock")
        self._fd: int | None = None
        if fcntl is None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            use = "read" if shared else "open"
            raise StoreInUse(
                f"the store {store_path} is in use by another process (pid {holder}; lock "
                f"{self.path}): one run-api at a time can serve a store, or the groups would "
                f"be handed out twice. Stop that process, or {use} another --store"
            ) from None
        if not shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let go of the lock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SqliteStore:
    """Durable store in one SQLite file (WAL journal), locked for this process
    (:class:`StoreLock`).

    ``synchronous="NORMAL"`` (default) survives a crash or ``kill -9`` of the server; use
    ``"FULL"`` to also survive power loss, at the price of an fsync per acknowledged POST.
    ``record=True`` keeps every batch handed out (see the module doc).

    Raises:
        StoreInUse: Another process has the store open.
    """

    durable = True

    def __init__(self, path: str | Path, synchronous: str = "NORMAL", record: bool = False) -> None:
        if synchronous.upper() not in ("NORMAL", "FULL"):
            raise ValueError("synchronous must be NORMAL or FULL")
        self.path = Path(path)
        self.record = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file_lock = StoreLock(self.path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            str(self.path), check_same_thread=False, isolation_level=None, timeout=30.0
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(groups)")}
        if "served_step" not in columns:  # a store written before acknowledgements existed
            self._db.execute("ALTER TABLE groups ADD COLUMN served_step INTEGER")
        if "policy_version" not in columns:  # a store written before policy versions existed
            self._db.execute("ALTER TABLE groups ADD COLUMN policy_version INTEGER")

    def _tx(self, statements: list[tuple[str, Any]]) -> None:
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in statements:
                    if isinstance(params, list):
                        cur.executemany(sql, params)
                    else:
                        cur.execute(sql, params)
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")

    @staticmethod
    def _meta_rows(values: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
        return (
            "INSERT INTO meta(key, value) VALUES(?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            [(k, json.dumps(v)) for k, v in values.items()],
        )

    def load(self) -> StoredState:
        with self._lock:
            meta = {k: json.loads(v) for k, v in self._db.execute("SELECT key, value FROM meta")}
            envs = [
                json.loads(r)
                for (r,) in self._db.execute("SELECT record FROM envs ORDER BY env_id")
            ]
            state = StoredState(meta=meta, envs=envs)
            rows = self._db.execute(
                "SELECT gid, env_id, size, buffered, payload, served_step, policy_version "
                "FROM groups ORDER BY served_step, rowid"
            )
            for gid, env_id, size, buffered, payload, served_step, version in rows:
                group = StoredGroup(gid, env_id, size, bytes(payload), version)
                if served_step is not None:
                    state.inflight.setdefault(served_step, []).append(group)
                else:
                    (state.buffered if buffered else state.queued).append(group)
            return state

    def put_meta(self, values: dict[str, Any]) -> None:
        self._tx([self._meta_rows(values)])

    def put_env(self, env_id: int, record: dict[str, Any]) -> None:
        self._tx(
            [
                (
                    "INSERT INTO envs(env_id, record) VALUES(?, ?) "
                    "ON CONFLICT(env_id) DO UPDATE SET record=excluded.record",
                    (env_id, json.dumps(record)),
                )
            ]
        )

    def insert(self, groups: list[StoredGroup], buffered: bool) -> None:
        self._tx(
            [
                (
                    "INSERT INTO groups(gid, env_id, size, buffered, payload, policy_version) "
                    "VALUES(?,?,?,?,?,?)",
                    [
                        (g.gid, g.env_id, g.size, int(buffered), g.payload, g.policy_version)
                        for g in groups
                    ],
                )
            ]
        )

    def merge(self, removed: list[int], merged: StoredGroup) -> None:
        self._tx(
            [
                ("DELETE FROM groups WHERE gid=?", [(gid,) for gid in removed]),
                (
                    "INSERT INTO groups(gid, env_id, size, buffered, payload, policy_version) "
                    "VALUES(?,?,?,0,?,?)",
                    (merged.gid, merged.env_id, merged.size, merged.payload, merged.policy_version),
                ),
            ]
        )

    def promote(self, gids: list[int]) -> None:
        self._tx([("UPDATE groups SET buffered=0 WHERE gid=?", [(g,) for g in gids])])

    def _recorded(self, gids: list[int], step: int | None) -> list[tuple[str, Any]]:
        """The statement that records ``gids`` as the batch of ``step`` (none when not
        recording, or when the groups are dropped rather than handed out)."""
        if not self.record or step is None:
            return []
        return [(_RECORD, [(step, pos, gid) for pos, gid in enumerate(gids)])]

    def take(self, gids: list[int], meta: dict[str, Any], step: int | None = None) -> None:
        """Forget groups: handed out in the batch of ``step`` (recorded with ``record``), or
        dropped (``step`` None)."""
        self._tx(
            [
                *self._recorded(gids, step),
                ("DELETE FROM groups WHERE gid=?", [(gid,) for gid in gids]),
                self._meta_rows(meta),
            ]
        )

    def take_inflight(self, gids: list[int], step: int, meta: dict[str, Any]) -> None:
        """Hand groups out in the batch of ``step`` but keep them until :meth:`release`."""
        self._tx(
            [
                *self._recorded(gids, step),
                ("UPDATE groups SET served_step=? WHERE gid=?", [(step, gid) for gid in gids]),
                self._meta_rows(meta),
            ]
        )

    def release(self, gids: list[int]) -> None:
        """Forget groups whose batch the trainer acknowledged."""
        self._tx([("DELETE FROM groups WHERE gid=?", [(gid,) for gid in gids])])

    def clear(self, meta: dict[str, Any]) -> None:
        self._tx(
            [
                ("DELETE FROM groups", ()),
                ("DELETE FROM batches", ()),
                ("DELETE FROM envs", ()),
                ("DELETE FROM meta", ()),
                self._meta_rows(meta),
            ]
        )

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._file_lock.release()


class Recording:
    """The batches a store recorded (``run-api --store PATH --record``), read as they are
    needed, so a recording larger than memory can be replayed. The store stays locked (shared)
    while it is open, so no run-api can write it meanwhile.

    Raises:
        FileNotFoundError: No such file.
        StoreInUse: A run-api is serving that store right now.
        ValueError: Not a store, or one that recorded no batches (written without ``--record``).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no store at {self.path}")
        self._file_lock = StoreLock(self.path, shared=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(str(self.path), check_same_thread=False)
            self._db.execute("PRAGMA query_only=1")
            tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master")}
            steps: list[int] = []
            if "batches" in tables:
                steps = [r[0] for r in self._db.execute("SELECT DISTINCT step FROM batches")]
        except sqlite3.DatabaseError as exc:
            self.close()
            raise ValueError(f"{self.path} is not a run-api store: {exc}") from None
        if not steps:
            self.close()
            raise ValueError(
                f"{self.path} recorded no batches: run-api records the batches it hands out "
                "with --store PATH --record"
            )
        #: the steps of the recorded batches, in order
        self.steps: list[int] = sorted(steps)

    def batch(self, step: int) -> list[StoredGroup]:
        """The groups of the batch of ``step``, in the order they were handed out."""
        with self._lock:
            rows = self._db.execute(
                "SELECT gid, env_id, size, payload, policy_version FROM batches WHERE step=? "
                "ORDER BY pos",
                (step,),
            ).fetchall()
        return [StoredGroup(g, e, n, bytes(p), v) for g, e, n, p, v in rows]

    def close(self) -> None:
        """Close the file and let go of its lock (idempotent)."""
        db = getattr(self, "_db", None)
        if db is not None:
            db.close()
            self._db = None
        self._file_lock.release()
