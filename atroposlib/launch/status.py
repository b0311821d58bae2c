"""The status view of a run: processes, health, queue depth, trainer step."""

from __future__ import annotations

import time
from typing import Any

from atroposlib.launch.orchestrator import Run

__all__ = ["status_line", "status_table"]

_STYLE = {"ready": "green", "running": "green", "done": "cyan", "failed": "red",
          "starting": "yellow", "stopped": "dim", "external": "blue"}  # fmt: skip


def _queue(numbers: dict[str, Any] | None) -> str:
    if numbers is None:
        return "API not answering"
    dropped = sum((numbers.get("dropped") or {}).values())
    return (
        f"step {numbers.get('step')} · queue {numbers.get('queue_groups')} groups "
        f"({numbers.get('queue_sequences')} seqs) · accepted {numbers.get('accepted_groups')} "
        f"· batches served {numbers.get('batches_served')} · dropped {dropped}"
    )


def status_table(run: Run, numbers: dict[str, Any] | None = None) -> Any:
    """A rich Table of every component, with the API's queue line as its caption."""
    from rich.table import Table

    elapsed = time.monotonic() - run.started
    table = Table(
        title=f"{run.plan.name} on {run.backend.name} · {elapsed:.0f} s",
        caption=_queue(numbers),
        expand=False,
    )
    for column in ("component", "state", "where", "url", "restarts", "log"):
        table.add_column(column, overflow="fold")
    for name, st in run.states.items():
        style = _STYLE.get(st.state, "")
        state = st.state if st.exit_code is None else f"{st.state} ({st.exit_code})"
        table.add_row(
            name,
            f"[{style}]{state}[/{style}]" if style else state,
            st.handle.node if st.handle else "",
            (st.handle.url or "") if st.handle else st.detail,
            str(st.restarts) if st.restarts else "",
            st.handle.log_location if st.handle else "",
        )
    return table


def status_line(run: Run, numbers: dict[str, Any] | None = None) -> str:
    """One line for logs: counts of components by state, and the queue."""
    counts: dict[str, int] = {}
    for st in run.states.values():
        counts[st.state] = counts.get(st.state, 0) + 1
    states = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    restarts = sum(st.restarts for st in run.states.values())
    return f"{states}; {restarts} restart(s); {_queue(numbers)}"
