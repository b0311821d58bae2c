"""The trajectory API's counters (:class:`QueueCounters`) and how ``/metrics`` renders
:meth:`~atroposlib.api.queue.TrajectoryQueue.metrics`: Prometheus text (the default) and JSON.
Metric names, types and labels are part of the wire protocol: every name is ``atropos_`` + the
name given here.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

#: The Content-Type of :func:`prometheus_text`.
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4"


@dataclass
class QueueCounters:
    """What the queue counts. Process-lifetime counters are monotonic (they survive
    ``/reset_data``); the per-env ones belong to a run (:meth:`new_run` zeroes them, as env ids
    are reused after a reset). Not thread-safe: the queue's lock guards it."""

    accepted: Counter[str] = field(default_factory=Counter)
    #: refused requests or groups, by reason (the metric label)
    refused: Counter[str] = field(default_factory=Counter)
    #: accepted groups dropped later, by reason
    dropped: Counter[str] = field(default_factory=Counter)
    #: what became of held parts of one prompt's group: merged, released, disconnected
    partial_outcomes: Counter[str] = field(default_factory=Counter)
    batches_served: int = 0
    groups_served: int = 0
    sequences_served: int = 0
    redelivered_batches: int = 0
    #: groups accepted with a policy_version ahead of the trainer's step
    versions_ahead: int = 0
    accepted_by_env: Counter[str] = field(default_factory=Counter)
    served_by_env: Counter[str] = field(default_factory=Counter)
    #: groups each env dropped before sending, by reason, as the env last reported them with
    #: ``/status-env`` (its running totals; not in upstream)
    env_dropped_by_env: dict[str, Counter[str]] = field(default_factory=dict)

    def new_run(self) -> None:
        """Zero the per-env counters (``/reset_data``)."""
        self.accepted_by_env = Counter()
        self.served_by_env = Counter()
        self.env_dropped_by_env = {}

    def env_dropped(self) -> Counter[str]:
        """Groups the envs dropped before sending, by reason, summed over the envs."""
        total: Counter[str] = Counter()
        for counts in self.env_dropped_by_env.values():
            total.update(counts)
        return total

    def count_accepted(self, env_id: int | None, sequences: int) -> None:
        """One group accepted."""
        self.accepted["groups"] += 1
        self.accepted["sequences"] += sequences
        self.accepted_by_env[str(env_id)] += 1

    def count_batch(self, groups: list[tuple[int | None, int]]) -> None:
        """A new batch handed out: its groups' ``(env_id, size)``."""
        self.batches_served += 1
        self.groups_served += len(groups)
        self.sequences_served += sum(size for _, size in groups)
        for env_id, _ in groups:
            self.served_by_env[str(env_id)] += 1

    def snapshot(self) -> dict[str, Any]:
        """The counters' part of :meth:`~atroposlib.api.queue.TrajectoryQueue.metrics`."""
        return {
            "accepted_groups": self.accepted["groups"],
            "accepted_sequences": self.accepted["sequences"],
            "refused": dict(self.refused),
            "dropped": dict(self.dropped),
            "env_dropped": dict(self.env_dropped()),
            "partial_groups": dict(self.partial_outcomes),
            "batches_served": self.batches_served,
            "groups_served": self.groups_served,
            "sequences_served": self.sequences_served,
            "redelivered_batches": self.redelivered_batches,
            "policy_version_ahead": self.versions_ahead,
        }


def json_bytes(data: Any) -> bytes:
    """``data`` as JSON (orjson). Text that is not valid Unicode (a lone surrogate, left in a
    store written before such input was refused) falls back to Python's json module, which
    writes it as an escape."""
    try:
        return orjson.dumps(data)
    except orjson.JSONEncodeError:
        return json.dumps(data).encode()


def _label(value: Any) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped as the text format
    requires, and text that is not valid Unicode (a lone surrogate) written as escapes."""
    text = str(value).encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(m: dict[str, Any]) -> str:
    """``/metrics`` in the Prometheus text format (0.0.4), from :meth:`TrajectoryQueue.metrics`."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP atropos_{name} {help_}")
        lines.append(f"# TYPE atropos_{name} {kind}")
        for labels, value in samples:
            lines.append(f"atropos_{name}{labels} {value}")

    metric("step", "gauge", "Trainer step (batches handed out).", [("", m["step"])])
    metric("queue_groups", "gauge", "Groups waiting in the queue.", [("", m["queue_groups"])])
    metric("queue_sequences", "gauge", "Sequences in the queue.", [("", m["queue_sequences"])])
    metric("queue_bytes", "gauge", "Serialised bytes in the queue.", [("", m["queue_bytes"])])
    metric(
        "buffered_sequences",
        "gauge",
        "Sequences in held parts of one prompt's group, waiting for the rest of it.",
        [("", m["buffered_sequences"])],
    )
    metric(
        "partial_groups_total",
        "counter",
        "Held parts of one prompt's group queued, by outcome: merged (they completed their "
        "group), released (a trainer was waiting for a batch), disconnected (their env left).",
        [(f'{{outcome="{_label(k)}"}}', v) for k, v in sorted(m["partial_groups"].items())],
    )
    metric("limit_bytes", "gauge", "Queue byte limit.", [("", m["limit_bytes"])])
    metric("limit_sequences", "gauge", "Queue sequence limit.", [("", m["limit_sequences"])])
    metric("accepted_groups_total", "counter", "Groups accepted.", [("", m["accepted_groups"])])
    metric(
        "accepted_sequences_total",
        "counter",
        "Sequences accepted.",
        [("", m["accepted_sequences"])],
    )
    metric(
        "refused_groups_total",
        "counter",
        "Groups (or requests) refused, by reason.",
        [(f'{{reason="{_label(k)}"}}', v) for k, v in sorted(m["refused"].items())],
    )
    metric(
        "dropped_groups_total",
        "counter",
        "Accepted groups dropped later, by reason.",
        [(f'{{reason="{_label(k)}"}}', v) for k, v in sorted(m["dropped"].items())],
    )
    metric("batches_served_total", "counter", "Batches handed out.", [("", m["batches_served"])])
    metric(
        "groups_served_total",
        "counter",
        "Groups handed out in new batches (a batch handed out again is not counted twice).",
        [("", m["groups_served"])],
    )
    metric(
        "sequences_served_total",
        "counter",
        "Sequences handed out.",
        [("", m["sequences_served"])],
    )
    metric(
        "unacknowledged_batches",
        "gauge",
        "Batches handed out to an acknowledging trainer (GET /batch?ack=) and not yet acknowledged.",
        [("", m["unacknowledged_batches"])],
    )
    metric(
        "redelivered_batches_total",
        "counter",
        "Unacknowledged batches handed out again (a lost response, a restarted trainer).",
        [("", m["redelivered_batches"])],
    )
    metric(
        "policy_version_ahead_groups_total",
        "counter",
        "Groups accepted with a policy_version ahead of the trainer's step (batches handed "
        "out): a trainer counting several optimizer steps per batch, or an unsynced server.",
        [("", m["policy_version_ahead"])],
    )
    env_samples = [
        (f'{{env_id="{_label(e["env_id"])}",name="{_label(e["name"])}"}}', e) for e in m["envs"]
    ]
    metric(
        "env_queued_sequences",
        "gauge",
        "Queued sequences per env.",
        [(lbl, e["queued_sequences"]) for lbl, e in env_samples],
    )
    metric(
        "env_buffered_sequences",
        "gauge",
        "Sequences held per env (parts of one prompt's group).",
        [(lbl, e["buffered_sequences"]) for lbl, e in env_samples],
    )
    metric(
        "env_accepted_groups_total",
        "counter",
        "Accepted groups per env.",
        [(lbl, e["accepted_groups"]) for lbl, e in env_samples],
    )
    metric(
        "env_served_groups_total",
        "counter",
        "Groups handed out per env.",
        [(lbl, e["served_groups"]) for lbl, e in env_samples],
    )
    metric(
        "env_dropped_before_send_total",
        "counter",
        "Groups an env dropped before sending them, by reason (e.g. same_scores: all replies "
        "scored alike), as the env reports them with /status-env.",
        [
            (f'{lbl[:-1]},reason="{_label(reason)}"}}', count)
            for lbl, e in env_samples
            for reason, count in sorted(e.get("dropped_before_send", {}).items())
        ],
    )
    evals = m.get("evals") or []
    if evals:
        metric(
            "eval_metric",
            "gauge",
            "Each env's latest evaluation pinned to a policy version (POST /eval-request), one "
            "sample per metric, labelled with the version evaluated and the trainer's step.",
            [
                (
                    f'{{env="{_label(r["env_name"])}",metric="{_label(name)}",'
                    f'policy_version="{r["policy_version"]}",step="{_label("" if r["step"] is None else r["step"])}"}}',
                    value,
                )
                for r in evals
                for name, value in sorted(r["metrics"].items())
            ],
        )
    return "\n".join(lines) + "\n"
