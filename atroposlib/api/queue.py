"""The trajectory queue: the trainer's registration, scored groups, batches and the step counter.

:class:`TrajectoryQueue` is a plain, thread-safe object (no HTTP, no JSON parsing of requests):
the env router validates and serialises each group once (:mod:`atroposlib.api.ingest`), then
calls :meth:`TrajectoryQueue.add_groups`; a trainer's ``GET /batch`` is
:meth:`TrajectoryQueue.take_batch`, which hands out the stored payloads. Every change goes to the
:class:`~atroposlib.api.store.QueueStore` before it is acknowledged. Its parts live beside it:
the envs in :mod:`atroposlib.api.registry`, held parts of one prompt's group in
:mod:`atroposlib.api.partials`, which groups make a batch in :mod:`atroposlib.api.packing`, the
counters in :mod:`atroposlib.api.metrics`.

Semantics (see ``docs/compat.md`` for how they differ from upstream):

* Registration is an explicit flag. The first ``/register`` configures the run; later ones only
  add a requester id. Groups may arrive before ``/register``; they wait in the queue.
* Batches go out FIFO, one per ``take_batch`` call; the step advances only then.
* Delivery is at-most-once for a trainer that does not acknowledge (upstream's behaviour: a
  batch whose response is lost is gone). A trainer that passes ``ack`` (``GET /batch?ack=N``:
  "I have received every batch up to step N") gets at-least-once delivery: each batch it is
  handed stays stored until acknowledged, and a request whose ``ack`` is behind a batch
  already handed out gets that batch again (same groups, same step) instead of a new one, also
  after a restart of a server with a durable store.
* Several trainers (the ranks of a multi-process trainer) form one consumer group: every batch
  goes to exactly one of them. Acknowledgements and redelivery are per ``rank`` (default 0):
  a rank gets only its own unacknowledged batches again. A rank is served to one registered
  trainer at a time (``consumer``: the uuid ``/register`` returned), the one registered last
  (a restarted trainer takes its rank's unacknowledged batches over); an earlier one that still
  asks for that rank is refused (``superseded``), so no batch goes to two trainers.
* A group shorter than its env's ``group_size`` is served as the group it is, unless it is a
  part of one prompt's group (:mod:`atroposlib.api.partials`): such parts are held and merged
  once they add up to their group, and released as they are whenever a trainer asks for a
  batch the queue cannot fill, so no part waits while the trainer waits. A long-polled
  ``/batch`` (``take_batch(release_partials=False)`` while it waits) releases them only when
  they would let a batch form, so parts arriving during its wait can complete their group.
* The queue is bounded in sequences and bytes; past the bound, :class:`QueueFull` is raised and
  the HTTP layer answers 429 with ``Retry-After``.
* Policy versions (``policy_version``, the trainer step whose weights generated a group) are
  kept with each group. With ``max_staleness=K`` (``run-api --max-staleness``), when a batch is
  formed for step ``s`` (the step it is handed out as: batches handed out so far, this one
  included; the trainer trains it on the weights of version ``s - 1``) every queued group whose
  :func:`staleness` is more than ``K`` is dropped
  (``stale``) before the batch is chosen; groups without a version are never stale. A batch
  handed out again to an acknowledging trainer is not re-checked.
* Nothing is dropped silently: every refused or dropped group is counted by reason.

What the queue refuses it raises as :class:`Refused` with a reason (the metric label); it knows
no status codes and writes no response bodies: the HTTP layer maps reasons to status codes in
one table and frames batches (``{"batch": [...]}``) around the payloads :class:`Batch` carries.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from atroposlib.api.errors import QueueFull, Refused, UnknownEnv
from atroposlib.api.metrics import QueueCounters
from atroposlib.api.models import RegisterEnv, Registration
from atroposlib.api.packing import PackItem, exact_fill, pack_batch
from atroposlib.api.partials import PartialGroups, declared_group_size, merge_payloads, part_of
from atroposlib.api.registry import MIN_ENV_WEIGHT, EnvRegistry
from atroposlib.api.store import MemoryStore, QueueStore, Recording, StoredGroup

__all__ = [
    "MIN_ENV_WEIGHT",
    "Batch",
    "PreparedGroup",
    "QueueFull",
    "QueueLimits",
    "Refused",
    "TrajectoryQueue",
    "UnknownEnv",
    "ahead_of_trainer",
    "staleness",
]

logger = logging.getLogger(__name__)


def ahead_of_trainer(step: int, policy_version: int) -> bool:
    """Whether a group's ``policy_version`` is newer than any weights the trainer can have made:
    it has been handed ``step`` batches, so its newest weights are version ``step`` when it
    counts one step per batch. Such a group is taken, counted and logged (see
    ``docs/compat.md``): a trainer that counts several optimizer steps per batch, or an
    inference server this run's trainer does not sync, makes them."""
    return policy_version > step


def staleness(batch_step: int, policy_version: int) -> int:
    """How many versions the weights that made a group (``policy_version``) are behind the
    weights that will train on it, as TRL counts it (``AsyncGRPOTrainer``: current version minus
    the sample's ``model_version``). The batch of ``batch_step`` is trained on the weights of
    version ``batch_step - 1`` (the trainer has taken ``batch_step - 1`` steps), so this is
    ``batch_step - 1 - policy_version``: 0 for on-policy data. The one definition the queue
    uses (``--max-staleness K`` drops a group when this is more than ``K``: 0 keeps on-policy
    groups only); it must not decrease as ``policy_version`` grows."""
    return batch_step - 1 - policy_version


@dataclass(frozen=True)
class QueueLimits:
    """Bounds that keep the server's memory in check."""

    max_sequences: int = 1_000_000
    max_bytes: int = 1 << 30
    retry_after_s: int = 1
    max_envs: int = 1024


@dataclass(slots=True)
class PreparedGroup:
    """A validated group, serialised once, ready to be queued."""

    env_id: int | None
    size: int
    longest: int
    payload: bytes
    policy_version: int | None = None
    #: ``group_overrides.group_size``: the size of the group these sequences belong to
    group_size: int | None = None


class Batch(list):
    """The serialised groups of one batch, in order, with the step the batch was handed out
    for and whether it is a repeat of an unacknowledged one."""

    def __init__(self, payloads: list[bytes], step: int, redelivered: bool = False) -> None:
        super().__init__(payloads)
        self.step = step
        self.redelivered = redelivered


class _Queued:
    """The groups waiting for a batch, in arrival order, with the sums the packer and
    ``/status-env`` read (kept as groups come and go, never recomputed)."""

    def __init__(self, track_versions: bool) -> None:
        self.groups: dict[int, StoredGroup] = {}
        self.sequences = 0
        self.bytes = 0
        self.sequences_by_env = Counter[Any]()
        self.sizes_by_env: dict[Any, Counter[int]] = {}
        self._track_versions = track_versions
        # (policy_version, gid) of queued groups that carry a version, oldest first, when a
        # staleness limit is set; entries of groups no longer queued are skipped when popped
        self._versions: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, group: StoredGroup) -> None:
        self.groups[group.gid] = group
        self.sequences += group.size
        self.bytes += len(group.payload)
        self.sequences_by_env[group.env_id] += group.size
        self.sizes_by_env.setdefault(group.env_id, Counter())[group.size] += 1
        if self._track_versions and group.policy_version is not None:
            heapq.heappush(self._versions, (group.policy_version, group.gid))

    def remove(self, group: StoredGroup) -> None:
        del self.groups[group.gid]
        self.sequences -= group.size
        self.bytes -= len(group.payload)
        self.sequences_by_env[group.env_id] -= group.size
        if not self.sequences_by_env[group.env_id]:
            del self.sequences_by_env[group.env_id]
        sizes = self.sizes_by_env[group.env_id]
        sizes[group.size] -= 1
        if not sizes[group.size]:
            del sizes[group.size]
            if not sizes:
                del self.sizes_by_env[group.env_id]

    def pop_older_than(self, is_stale: Any) -> list[StoredGroup]:
        """Take out the queued groups whose version ``is_stale(version)`` says is too old
        (``is_stale`` must only get truer as versions get older)."""
        stale: list[StoredGroup] = []
        while self._versions and is_stale(self._versions[0][0]):
            _, gid = heapq.heappop(self._versions)
            group = self.groups.get(gid)
            if group is not None:
                stale.append(group)
        for group in stale:
            self.remove(group)
        return stale


class TrajectoryQueue:
    """Thread-safe queue of scored groups with upstream Atropos's registration semantics."""

    def __init__(
        self,
        store: QueueStore | None = None,
        limits: QueueLimits | None = None,
        max_staleness: int | None = None,
    ) -> None:
        self.store: QueueStore = store or MemoryStore()
        self.limits = limits or QueueLimits()
        #: Most steps a group's ``policy_version`` may be behind the batch it goes into
        #: (:func:`staleness`); None: no limit (upstream's behaviour).
        self.max_staleness = max_staleness
        self._lock = threading.RLock()
        #: a recorded run served again (:meth:`replay`), and whether re-packed
        self._recording: Recording | None = None
        self._repack = False
        #: counters and gauges of ``/metrics`` (not persisted: this process's lifetime)
        self.counters = QueueCounters()
        self._started_at = time.time()
        #: called (in the thread that changed it) after every change that can let a batch form:
        #: groups queued, an env disconnected, a registration, a reset (long-polled ``/batch``)
        self.on_change: Callable[[], None] | None = None
        self._init_state()
        self._restore()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # ------------------------------------------------------------------ state
    def _init_state(self) -> None:
        self.registration: dict[str, Any] | None = None
        self.step = 0
        self.started = False
        self.requesters: list[int] = []
        self.registry = EnvRegistry(self.limits.max_envs)
        self._queued = _Queued(track_versions=self.max_staleness is not None)
        self._partials = PartialGroups()
        # batches handed out to an acknowledging trainer, not yet acknowledged: step -> groups,
        # and the rank each went to
        self._inflight: dict[int, list[StoredGroup]] = {}
        self._inflight_rank: dict[int, int] = {}
        # rank -> the consumer (a /register uuid) it is served to
        self._owners: dict[int, int] = {}
        # whether a group ahead of the trainer was reported in this run's log
        self._ahead_logged = False
        self._latest: bytes | None = None
        self._next_gid = 1
        # replay: the recorded batches not handed out yet, oldest first
        self._replay_steps: list[int] = []

    def _meta(self) -> dict[str, Any]:
        return {
            "registration": self.registration,
            "step": self.step,
            "started": self.started,
            "requesters": [str(r) for r in self.requesters],
            "inflight_ranks": {str(s): r for s, r in self._inflight_rank.items() if r},
            "rank_owners": {str(r): str(c) for r, c in self._owners.items()},
        }

    def _restore(self) -> None:
        state = self.store.load()
        if not state.meta and not state.queued and not state.buffered and not state.inflight:
            return
        self.registration = state.meta.get("registration")
        self.step = int(state.meta.get("step", 0))
        self.started = bool(state.meta.get("started", False))
        self.requesters = [int(r) for r in state.meta.get("requesters", [])]
        self.registry = EnvRegistry(self.limits.max_envs, state.envs)
        for group in state.queued:
            self._queued.add(group)
        self._inflight = dict(sorted(state.inflight.items()))
        ranks = {int(s): int(r) for s, r in state.meta.get("inflight_ranks", {}).items()}
        self._inflight_rank = {step: ranks.get(step, 0) for step in self._inflight}
        self._owners = {int(r): int(c) for r, c in state.meta.get("rank_owners", {}).items()}
        inflight = [g for groups in self._inflight.values() for g in groups]
        gids = [g.gid for g in state.queued + state.buffered + inflight]
        self._next_gid = max(gids, default=0) + 1
        for group in state.buffered:
            self._restore_part(group)
        if state.queued:
            self._latest = state.queued[-1].payload
        logger.info(
            "Restored from store: step %d, %d queued groups (%d sequences), %d held parts, "
            "%d unacknowledged batches, %d envs, trainer %s",
            self.step,
            len(self._queued),
            self._queued.sequences,
            len(self._partials),
            len(self._inflight),
            len(self.registry),
            "registered" if self.registration else "not registered",
        )

    def _restore_part(self, group: StoredGroup) -> None:
        """Hold a part read back from the store again, or queue it if it is no longer one."""
        env = self.registry.connected_record(group.env_id)
        part = None
        if env is not None:
            declared = declared_group_size(orjson.loads(group.payload))
            part = part_of(group, declared, env["group_size"])
        if part is None:
            self.store.promote([group.gid])
            self._queued.add(group)
            return
        complete = self._partials.add(part)
        if complete:
            self._queue_parts(complete, "merged")

    def replay(self, recording: Recording, repack: bool = False) -> None:
        """Serve ``recording`` (a store's recorded batches) instead of groups from envs, which
        are refused from now on (``replay``, 409). Original (default): each recorded batch is
        handed out as it was, with its recorded step, the first one after the trainer's
        ``starting_step``. ``repack``: the recorded groups, in their recorded order, are packed
        into batches of the registered ``batch_size``, as if they had just arrived. Policy
        versions are the recorded ones; nothing is stale."""
        with self._lock:
            self._recording = recording
            self._repack = repack
            self.max_staleness = None
            self._replay_steps = list(recording.steps)

    @property
    def replaying(self) -> bool:
        """Whether this queue serves a recorded run (:meth:`replay`)."""
        return self._recording is not None

    def _refuse_in_replay(self, what: str) -> None:
        if self._recording is not None:
            self.refused["replay"] += 1
            raise Refused(
                "replay",
                f"this run-api replays the batches recorded in {self._recording.path} "
                f"(run-api --replay) and takes no {what}",
            )

    @property
    def registered(self) -> bool:
        """Whether a trainer has called ``/register`` (since the last reset)."""
        return self.registration is not None

    @property
    def batch_size(self) -> int:
        """Sequences per batch (``-1`` before ``/register``)."""
        return int(self.registration["batch_size"]) if self.registration else -1

    @property
    def envs(self) -> list[dict[str, Any]]:
        """The env records of this run (:class:`~atroposlib.api.registry.EnvRegistry`)."""
        return self.registry.records

    def evaluators(self) -> dict[int, str]:
        """Env id -> name of the connected envs that take pinned evaluations."""
        with self._lock:
            return self.registry.evaluators()

    @property
    def dropped(self) -> Counter[str]:
        """Accepted groups dropped later, by reason."""
        return self.counters.dropped

    @property
    def refused(self) -> Counter[str]:
        """Refused requests or groups, by reason."""
        return self.counters.refused

    # ----------------------------------------------------------- registration
    def register_trainer(self, reg: Registration) -> dict[str, int]:
        """``/register``: the first call configures the run; later calls only get a new uuid."""
        with self._lock:
            if self.registration is None:
                self.registration = reg.model_dump()
                self.step = reg.starting_step
                self.started = False
                self._drop_unservable()
                logger.info(
                    "Trainer registered: batch_size=%d max_token_len=%d starting_step=%d "
                    "num_steps=%d",
                    reg.batch_size,
                    reg.max_token_len,
                    reg.starting_step,
                    reg.num_steps,
                )
                if reg.max_token_len <= 0:
                    logger.warning(
                        "max_token_len=%d: sequences of any length are accepted (upstream's "
                        "meaning of a value <= 0); register a positive value to have longer "
                        "sequences refused",
                        reg.max_token_len,
                    )
            elif reg.model_dump() != self.registration:
                logger.warning(
                    "Another /register with different settings; keeping the first registration "
                    "(call /reset_data to start a new run)"
                )
            requester = uuid.uuid4().int
            self.requesters.append(requester)
            self.store.put_meta(self._meta())
            self._changed()
            return {"uuid": requester}

    def _drop_unservable(self) -> None:
        """Groups queued before registration that can never fit a batch are dropped, counted."""
        assert self.registration is not None
        batch, limit = self.batch_size, int(self.registration["max_token_len"])
        for group in list(self._queued.groups.values()):
            reason = None
            if group.size > batch:
                reason = "larger_than_batch"
            elif limit > 0:
                tokens = orjson.loads(group.payload)["tokens"]
                if max(len(t) for t in tokens) > limit:
                    reason = "too_long"
            if reason:
                self._queued.remove(group)
                self.store.take([group.gid], self._meta())
                self.dropped[reason] += 1
                logger.warning("Dropped group %d queued before /register: %s", group.gid, reason)

    def register_env(self, req: RegisterEnv) -> dict[str, Any]:
        """``/register-env``: add an env once the trainer has fetched its first batch."""
        with self._lock:
            self._refuse_in_replay("environments")
            if not self.started:
                return {"status": "wait for trainer to start"}
            try:
                record = self.registry.add(req)
            except Refused as exc:
                self.refused[exc.reason] += 1
                raise
            env_id = record["registered_id"]
            self.store.put_env(env_id, record)
            logger.info(
                "Env registered: id=%d name=%s group_size=%d weight=%g",
                env_id,
                record["real_name"],
                req.group_size,
                req.weight,
            )
            reg = self.registration or {}
            return {
                "status": "success",
                "env_id": env_id,
                "wandb_name": record["real_name"],
                "checkpoint_dir": reg.get("checkpoint_dir", ""),
                "starting_step": self.step,
                "checkpoint_interval": reg.get("save_checkpoint_interval", -1),
                "num_steps": reg.get("num_steps", -1),
            }

    def disconnect_env(self, env_id: int) -> dict[str, str]:
        """Mark an env disconnected. Its held parts are queued as they are."""
        with self._lock:
            record = self.registry.disconnect(env_id)
            self.store.put_env(env_id, record)
            released = self._partials.release(env_id)
            for parts in released:
                self._queue_parts(parts, "disconnected")
            if released:
                logger.info(
                    "Env %d disconnected; queued its held parts as %d group(s)",
                    env_id,
                    len(released),
                )
            self._changed()  # its parts are queued, and its minimum allocation no longer holds
            return {"status": "success"}

    # ------------------------------------------------------------ read-only
    def wandb_info(self) -> dict[str, Any]:
        """``/wandb_info``: the W&B group and project the trainer registered."""
        reg = self.registration or {}
        return {"group": reg.get("wandb_group"), "project": reg.get("wandb_project")}

    def info(self) -> dict[str, int]:
        """``/info``: batch size and longest sequence (``-1`` each before ``/register``)."""
        if not self.registration:
            return {"batch_size": -1, "max_token_len": -1}
        return {
            "batch_size": self.batch_size,
            "max_token_len": int(self.registration["max_token_len"]),
        }

    def status(self) -> dict[str, int]:
        """``/status``: the step and the number of queued groups."""
        with self._lock:
            return {"current_step": self.step, "queue_size": len(self._queued)}

    def fill(self) -> tuple[int, int, int]:
        """Sequences queued, sequences held (parts of groups) and ``batch_size``: what a waiting
        trainer waits for."""
        with self._lock:
            return self._queued.sequences, self._partials.sequences, self.batch_size

    def status_env(self, env_id: int) -> dict[str, Any]:
        """Upstream's per-env view of the queue, used by envs to throttle themselves. Held
        parts count as queued: the env's throttle must see what run-api holds for it."""
        with self._lock:
            record = self.registry.get(env_id)
            sizes_by_env = self._queued.sizes_by_env
            max_group_size = max(
                (max(sizes) for sizes in sizes_by_env.values() if sizes), default=1
            )
            max_group_size = max(max_group_size, 1)
            own_sizes = sizes_by_env.get(env_id)
            env_group_size = max(record["group_size"], max(own_sizes) if own_sizes else 0, 1)
            held = Counter(self._queued.sequences_by_env)
            held.update(self._partials.sequences_by_env)
            own = held.get(env_id, 0)

            available = 0
            if max_group_size > 1:
                minimum_seqs = self.registry.minimum_sequences(max(self.batch_size, 0))
                for other, seqs in held.items():
                    if other == env_id or seqs <= 0:
                        continue
                    packed = math.ceil(seqs / max_group_size) * max_group_size
                    available += max(0, packed - minimum_seqs.get(other, 0))

            queue_size = (own + available) // env_group_size
            if self._unpackable():
                # A batch's worth of sequences is queued but no set of whole groups makes
                # exactly one batch (e.g. groups of 16, 15 and 15 for a batch of 32, after an
                # env dropped a few short completions): counted as queued, it made envs stop
                # generating while the trainer waited for a batch that could never form.
                queue_size = 0
            return {
                "current_step": self.step,
                "queue_size": queue_size,
                "unallocated_fraction": self.registry.unallocated_fraction(),
                "self_queue_size": own // env_group_size,
                "max_group_size": max_group_size,
                "env_weight": self.registry.env_weight(env_id),
            }

    def report_env_drops(self, env_id: int, counts: dict[str, int]) -> None:
        """Record what env ``env_id`` says it dropped before sending, by reason (its running
        totals, sent with ``/status-env``): a trainer waiting for a batch learns why none
        comes, although the envs are running."""
        with self._lock:
            self.counters.env_dropped_by_env[str(env_id)] = Counter(counts)

    def env_dropped(self) -> Counter[str]:
        """Groups the envs reported dropping before sending, by reason, summed."""
        with self._lock:
            return self.counters.env_dropped()

    def latest_example(self) -> bytes | None:
        """Serialised last group that entered the queue (``None`` before any did)."""
        return self._latest

    # ---------------------------------------------------------------- ingest
    def check(self, groups: list[PreparedGroup]) -> None:
        """Raise :class:`Refused` if any group cannot be taken (nothing is changed)."""
        if self._recording is not None:
            raise Refused(
                "replay",
                f"this run-api replays the batches recorded in {self._recording.path} "
                "(run-api --replay) and takes no new groups",
            )
        reg = self.registration
        new_seqs = 0
        new_bytes = 0
        for i, group in enumerate(groups):
            prefix: tuple[Any, ...] = (i,) if len(groups) > 1 else ()
            if group.env_id is not None and not 0 <= group.env_id < len(self.registry):
                raise Refused(
                    "unknown_env",
                    f"unknown env_id {group.env_id}: {len(self.registry)} env(s) registered "
                    "(register with /register-env; the API may have been reset)",
                    prefix + ("env_id",),
                )
            if reg is not None:
                if group.size > self.batch_size > 0:
                    raise Refused(
                        "larger_than_batch",
                        f"group of {group.size} sequences can never fit a batch of "
                        f"{self.batch_size} sequences",
                        prefix + ("tokens",),
                    )
                limit = int(reg["max_token_len"])
                if 0 < limit < group.longest:
                    raise Refused(
                        "too_long",
                        f"a sequence has {group.longest} tokens, more than the trainer's "
                        f"max_token_len of {limit}",
                        prefix + ("tokens",),
                    )
            if len(group.payload) > self.limits.max_bytes:
                raise Refused(
                    "group_too_large",
                    f"group is {len(group.payload)} bytes serialised, more than the queue's "
                    f"byte limit of {self.limits.max_bytes}",
                    prefix,
                )
            new_seqs += group.size
            new_bytes += len(group.payload)
        held_seqs = self._queued.sequences + self._partials.sequences
        held_bytes = self._queued.bytes + self._partials.bytes
        if (
            held_seqs + new_seqs > self.limits.max_sequences
            or held_bytes + new_bytes > self.limits.max_bytes
        ):
            raise QueueFull(
                f"queue is full ({held_seqs} sequences, {held_bytes} bytes held; limits "
                f"{self.limits.max_sequences} sequences, {self.limits.max_bytes} bytes): "
                "retry later",
                self.limits.retry_after_s,
            )

    def add_groups(self, groups: list[PreparedGroup]) -> list[dict[str, Any]]:
        """Queue (or hold, when they are parts of one prompt's group) validated groups, all or
        none. Returns one status per group: ``received``, or upstream's ``buffered`` with the
        sequences held for the env."""
        with self._lock:
            try:
                self.check(groups)
            except Refused as exc:
                self.refused[exc.reason] += len(groups)
                raise
            results = []
            for group in groups:
                stored = StoredGroup(
                    self._next_gid, group.env_id, group.size, group.payload, group.policy_version
                )
                self._next_gid += 1
                self.counters.count_accepted(group.env_id, group.size)
                if (
                    self.registered
                    and group.policy_version is not None
                    and ahead_of_trainer(self.step, group.policy_version)
                ):
                    self._count_ahead(group.policy_version)
                env = self.registry.connected_record(group.env_id)
                part = None if env is None else part_of(stored, group.group_size, env["group_size"])
                if part is None:
                    self.store.insert([stored], buffered=False)
                    self._queued.add(stored)
                    self._latest = stored.payload
                    results.append({"status": "received"})
                    continue
                self.store.insert([stored], buffered=True)
                complete = self._partials.add(part)
                if complete:
                    self._queue_parts(complete, "merged")
                held = self._partials.held_sequences(part.group.env_id)
                results.append({"status": "buffered", "buffer_size": held})
            self._changed()
            return results

    def _count_ahead(self, version: int) -> None:
        self.counters.versions_ahead += 1
        if not self._ahead_logged:  # once per run: it is counted in /metrics
            self._ahead_logged = True
            logger.warning(
                "A group's policy_version (%d) is ahead of the trainer, which has been handed "
                "%d batches: either the trainer counts several optimizer steps per batch (then "
                "staleness in batches undercounts), or an inference server is not synced by "
                "this run's trainer (a server from another run, or run-api restarted without "
                "its store). Counted as policy_version_ahead in /metrics",
                version,
                self.step,
            )

    def _queue_parts(self, parts: list[StoredGroup], outcome: str) -> None:
        """Queue held parts of one prompt's group: one part as it is, several merged into one
        group. ``outcome`` (``merged``: they completed their group; ``released``: a trainer
        was waiting; ``disconnected``: their env left) is counted in ``/metrics``."""
        self.counters.partial_outcomes[outcome] += len(parts)
        if len(parts) == 1:
            (group,) = parts
            self.store.promote([group.gid])
        else:
            merged, lost = merge_payloads([orjson.loads(p.payload) for p in parts])
            if lost:
                self.dropped["merge_field_mismatch"] += 1
                logger.warning(
                    "Merged %d parts of one prompt's group (env %s); dropped fields only some "
                    "parts had: %s",
                    len(parts),
                    parts[0].env_id,
                    ", ".join(lost),
                )
            group = StoredGroup(
                self._next_gid,
                parts[0].env_id,
                sum(p.size for p in parts),
                orjson.dumps(merged),
                merged.get("policy_version"),
            )
            self._next_gid += 1
            self.store.merge([p.gid for p in parts], group)
        self._queued.add(group)
        self._latest = group.payload

    def _release_partials(self) -> bool:
        """Queue every held part (a trainer is waiting); whether there were any."""
        released = self._partials.release()
        for parts in released:
            self._queue_parts(parts, "released")
        if released:
            logger.info(
                "A trainer is waiting for a batch: queued %d held part(s) of groups as they are",
                len(released),
            )
        return bool(released)

    # ----------------------------------------------------------------- batch
    def take_batch(
        self,
        ack: int | None = None,
        rank: int = 0,
        consumer: int | None = None,
        release_partials: bool = True,
    ) -> Batch | dict[str, Any]:
        """Hand out the next batch: the serialised groups of its ``{"batch": [...]}`` body, in
        order, with its step.

        Returns upstream's error dict when no trainer registered, and ``{"batch": None}`` when
        the queue cannot fill a batch yet (after queueing every held part). The step advances
        by one per new batch handed out.

        ``ack`` (optional): the trainer (``rank``) has received every batch up to this step.
        Its acknowledged batches are forgotten; if a batch after ``ack`` was already handed out
        to this rank, the oldest such is handed out again instead of a new one; a new batch is
        kept until acknowledged. Without ``ack`` a batch is forgotten as soon as it is handed
        out (at-most-once). ``consumer`` (optional): the uuid ``/register`` gave the asking
        trainer; the rank is then served to the latest registered of its claimants.

        ``release_partials`` (default True, what every plain ``/batch`` does): when the queue
        cannot fill a batch, queue every held part as it is. False (a long-polled ``/batch``
        woken during its wait): held parts are released only when they would let a batch
        form now (queued and held sequences reach ``batch_size``); otherwise they stay held,
        so parts arriving while the trainer waits can still complete their group.

        Raises :class:`Refused`: ``bad_ack`` when ``ack`` is ahead of the last batch handed
        out, ``unknown_consumer`` for a uuid no ``/register`` of this run gave, ``superseded``
        when a trainer registered later took the rank over.
        """
        with self._lock:
            if not self.registered:
                return {
                    "status": "error",
                    "message": "Trainer not registered. Call /register first.",
                    "batch": [],
                }
            if ack is not None and ack > self.step:
                raise Refused(
                    "bad_ack",
                    f"ack={ack} is ahead of the last batch handed out (step {self.step})",
                    loc=("ack",),
                    kind="value_error",
                )
            if consumer is not None:
                self._claim(rank, consumer)
            if not self.started:
                self.started = True
                self.store.put_meta(self._meta())
            if ack is not None:
                again = self._acknowledge(ack, rank)
                if again is not None:
                    return again
            chosen, step = self._form_batch(release_partials)
            if not chosen:
                return {"batch": None}
            self.step = step
            if ack is None:
                self.store.take([g.gid for g in chosen], self._meta(), step)
            else:
                chosen.sort(key=lambda g: g.gid)  # the order a restored store gives back
                self._inflight[self.step] = chosen
                self._inflight_rank[self.step] = rank
                self.store.take_inflight([g.gid for g in chosen], self.step, self._meta())
            self.counters.count_batch([(g.env_id, g.size) for g in chosen])
            logger.info(
                "Batch for step %d: %d sequences in %d groups (%d groups still queued)",
                self.step,
                sum(g.size for g in chosen),
                len(chosen),
                len(self._queued),
            )
            return Batch([g.payload for g in chosen], self.step)

    def _form_batch(self, release: bool = True) -> tuple[list[StoredGroup], int]:
        """The groups of the next batch, taken out of the queue, and its step; [] when none can
        be formed (stale groups dropped first; held parts queued when the queue alone cannot
        fill it, and ``release`` or they could fill it)."""
        if self._recording is not None and not self._repack:
            return self._recorded_batch()
        self._drop_stale(self.step + 1)
        chosen = self._choose()
        if (
            not chosen
            and (release or self._queued.sequences + self._partials.sequences >= self.batch_size)
            and self._release_partials()
        ):
            self._drop_stale(self.step + 1)
            chosen = self._choose()
        while not chosen and self._replay_steps:  # repack: read recorded groups as needed
            assert self._recording is not None
            for group in self._recording.batch(self._replay_steps.pop(0)):
                # recorded gids are unique per server life only: number them afresh
                group.gid, self._next_gid = self._next_gid, self._next_gid + 1
                self._queued.add(group)
            chosen = self._choose()
        for group in chosen:
            self._queued.remove(group)
        return chosen, self.step + 1

    def _recorded_batch(self) -> tuple[list[StoredGroup], int]:
        """Replay (original): the next recorded batch after the current step, with its step."""
        assert self._recording is not None
        while self._replay_steps and self._replay_steps[0] <= self.step:
            self._replay_steps.pop(0)  # before the trainer's starting step
        if not self._replay_steps:
            return [], self.step
        step = self._replay_steps.pop(0)
        if not self._replay_steps:
            logger.info("Replay: the last recorded batch (step %d) is handed out", step)
        return self._recording.batch(step), step

    def _drop_stale(self, step: int) -> None:
        """Drop queued groups more than ``max_staleness`` steps stale (:func:`staleness`) for
        the batch of ``step`` being formed; counted as ``stale``."""
        limit = self.max_staleness
        if limit is None:
            return
        stale = self._queued.pop_older_than(lambda version: staleness(step, version) > limit)
        if not stale:
            return
        self.store.take([g.gid for g in stale], self._meta())
        self.dropped["stale"] += len(stale)
        versions = sorted({g.policy_version for g in stale})
        logger.warning(
            "Dropped %d stale group(s) (%d sequences) forming the batch of step %d: policy "
            "version(s) %s are more than %d step(s) behind (run-api --max-staleness)",
            len(stale),
            sum(g.size for g in stale),
            step,
            ", ".join(map(str, versions[:10])) + (" ..." if len(versions) > 10 else ""),
            limit,
        )

    def _claim(self, rank: int, consumer: int) -> None:
        """Serve ``rank`` to ``consumer`` unless a trainer registered later holds it."""
        if consumer not in self.requesters:
            self.refused["unknown_consumer"] += 1
            raise Refused(
                "unknown_consumer",
                f"consumer {consumer} is not a trainer registered in this run: run-api was "
                "restarted without its store (--store), or /reset_data was called; /register "
                "again",
                loc=("consumer",),
                kind="unknown_consumer",
            )
        owner = self._owners.get(rank)
        if owner == consumer:
            return
        if owner is not None and self.requesters.index(owner) > self.requesters.index(consumer):
            self.refused["superseded"] += 1
            raise Refused(
                "superseded",
                f"rank {rank} is served to a trainer that registered after this one: two "
                f"trainers ask for the batches of rank {rank} (give each process its own rank: "
                "GET /batch?rank=R, TrainerClient(rank=R)), or this one was replaced by a "
                "restarted one",
                loc=("consumer",),
                kind="superseded",
            )
        if owner is not None:
            logger.warning(
                "Rank %d is now served to a trainer registered later (a restarted trainer?); "
                "its unacknowledged batches go to it, and the earlier one is refused",
                rank,
            )
        self._owners[rank] = consumer
        self.store.put_meta(self._meta())

    def _acknowledge(self, ack: int, rank: int) -> Batch | None:
        """Forget ``rank``'s batches up to ``ack``; the oldest of its unacknowledged batches
        after it, if any."""
        mine = [step for step, r in self._inflight_rank.items() if r == rank]
        done = [step for step in mine if step <= ack]
        if done:
            gids = [g.gid for step in done for g in self._inflight.pop(step)]
            for step in done:
                del self._inflight_rank[step]
            self.store.release(gids)
        again = [step for step in mine if step > ack]
        if not again:
            return None
        step = min(again)
        self.counters.redelivered_batches += 1
        logger.warning(
            "Handing out the batch of step %d again (rank %d): the trainer acknowledged only up "
            "to step %d (its response was lost, or the trainer restarted)",
            step,
            rank,
            ack,
        )
        return Batch([g.payload for g in self._inflight[step]], step, redelivered=True)

    def _unpackable(self) -> bool:
        """At least a batch's worth of sequences is queued, yet no set of whole queued groups
        makes exactly one batch (upstream counted such a queue as full; see ``status_env``)."""
        batch_size = self.batch_size
        if batch_size <= 0 or self._queued.sequences < batch_size:
            return False
        # exact_fill reads the queue lazily: the usual case (the oldest groups make a batch)
        # stops after them
        queued = self._queued.groups.values()
        return exact_fill((g.size for g in queued), batch_size) is None

    def _choose(self) -> list[StoredGroup]:
        """The queued groups of one exact batch (:mod:`atroposlib.api.packing`), or []."""
        batch_size = self.batch_size
        if self._queued.sequences < batch_size:
            return []
        queued = self._queued.groups
        minimums = self.registry.min_allocations()
        if minimums:
            groups = list(queued.values())
            picked = pack_batch([PackItem(g.size, g.env_id) for g in groups], batch_size, minimums)
            return [groups[i] for i in picked] if picked else []
        seen: list[StoredGroup] = []

        def sizes() -> Iterator[int]:
            for group in queued.values():
                seen.append(group)
                yield group.size

        picked = exact_fill(sizes(), batch_size)
        return [seen[i] for i in picked] if picked else []

    # ----------------------------------------------------------------- reset
    def reset(self) -> None:
        """``/reset_data``: forget the run. Queued and held groups are counted as dropped."""
        with self._lock:
            dropped = len(self._queued) + len(self._partials)
            unacked = sum(len(b) for b in self._inflight.values())
            if dropped:
                self.dropped["reset"] += dropped
                logger.warning("Reset: dropping %d queued/held groups", dropped)
            if unacked:
                self.dropped["reset_unacknowledged"] += unacked
                logger.warning(
                    "Reset: forgetting %d groups in %d batches the trainer never acknowledged",
                    unacked,
                    len(self._inflight),
                )
            self._init_state()
            self.counters.new_run()
            self.store.clear(self._meta())
            if self._recording is not None:  # a replay starts over
                self._replay_steps = list(self._recording.steps)
            self._changed()

    # --------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, Any]:
        """Counters and gauges for ``/metrics``."""
        with self._lock:
            counters = self.counters
            return {
                "registered": self.registered,
                "step": self.step,
                "batch_size": self.batch_size,
                "queue_groups": len(self._queued),
                "queue_sequences": self._queued.sequences,
                "queue_bytes": self._queued.bytes,
                "buffered_groups": len(self._partials),
                "buffered_sequences": self._partials.sequences,
                "buffered_bytes": self._partials.bytes,
                "limit_sequences": self.limits.max_sequences,
                "limit_bytes": self.limits.max_bytes,
                **counters.snapshot(),
                "unacknowledged_batches": len(self._inflight),
                "max_staleness": self.max_staleness,
                "replay_batches_left": len(self._replay_steps) if self.replaying else None,
                "envs": [
                    {
                        "env_id": e["registered_id"],
                        "name": e["real_name"],
                        "connected": e["connected"],
                        "queued_sequences": self._queued.sequences_by_env.get(
                            e["registered_id"], 0
                        ),
                        "buffered_sequences": self._partials.held_sequences(e["registered_id"]),
                        "accepted_groups": counters.accepted_by_env.get(str(e["registered_id"]), 0),
                        "served_groups": counters.served_by_env.get(str(e["registered_id"]), 0),
                        "dropped_before_send": dict(
                            counters.env_dropped_by_env.get(str(e["registered_id"]), {})
                        ),
                    }
                    for e in self.registry
                ],
                "uptime_s": time.time() - self._started_at,
                "durable": bool(getattr(self.store, "durable", False)),
            }

    def close(self) -> None:
        """Close the store and, when replaying, the recording."""
        self.store.close()
        if self._recording is not None:
            self._recording.close()

    def count_refused(self, reason: str, groups: int = 1) -> None:
        """Count a request the HTTP layer refused before it reached the queue."""
        with self._lock:
            self.refused[reason] += groups
