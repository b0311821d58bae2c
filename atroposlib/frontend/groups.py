"""What the two renderers of scored groups share: reading a JSONL file of groups, and the sign
of a score (which colours a rollout).

:mod:`atroposlib.frontend.jsonl2html` writes a static page of a ``process`` JSONL file;
:mod:`atroposlib.frontend.run_viewer` is ``view-run``'s live page.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

__all__ = ["iter_jsonl", "score_sign"]


def score_sign(score: Any) -> Literal["positive", "negative", "zero"] | None:
    """``positive``, ``negative`` or ``zero`` for a number; None for anything else (missing,
    not a number, NaN)."""
    if isinstance(score, bool):
        score = int(score)
    try:
        value = float(score)
    except (TypeError, ValueError):
        return None
    if math.isnan(value):
        return None
    if value > 0:
        return "positive"
    return "negative" if value < 0 else "zero"


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any, str | None]]:
    """``(line number, object, None)`` for each JSON line of ``path``, or ``(line number, None,
    why)`` for a line that is not JSON; blank lines are skipped. Undecodable bytes are
    replaced, not fatal."""
    with Path(path).open("r", encoding="utf-8", errors="replace") as f:
        for line_num, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            try:
                yield line_num, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield line_num, None, exc.msg
