"""Local datasets for environments: rows of a JSONL or JSON file, or of a split in a folder."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["load_rows"]


def load_rows(
    path: str | Path,
    split: str = "train",
    *,
    flag: str = "dataset_path",
    required: Iterable[str] | Mapping[str, type | tuple[type, ...]] = (),
    allow_empty: bool = True,
) -> list[dict[str, Any]]:
    """Rows of a local dataset, each a JSON object.

    ``path`` is a ``.jsonl`` file (one row a line, blank lines skipped), a ``.json`` file (a
    list of rows or ``{"data": [...]}``) — either used for every split — or a folder holding
    ``{split}.jsonl`` or ``{split}.json``.

    ``flag`` is the setting the path came from; every error starts with it, so a user knows
    which option to fix. ``required`` names keys every row must have; given as a mapping, a key's
    value must also be of that type. ``allow_empty=False`` refuses a dataset with no rows.

    Raises FileNotFoundError naming the path, ValueError naming the line (JSONL) or row (JSON)
    and what is wrong with it.
    """
    path = Path(path)
    if path.is_dir():
        candidates = [path / f"{split}.jsonl", path / f"{split}.json"]
        file = next((c for c in candidates if c.is_file()), candidates[0])
    else:
        file = path
    if not file.is_file():
        raise FileNotFoundError(f"{flag}: no such file {file}")
    text = file.read_text(encoding="utf-8")
    located: list[tuple[str, Any]] = []  # (where, row)
    if file.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag}: {file}: invalid JSON: {exc}") from exc
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{flag}: {file}: expected a list of rows or {{'data': [...]}}")
        located = [(f"row {i}", row) for i, row in enumerate(data, 1)]
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    located.append((f"line {number}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{flag}: {file} line {number}: not JSON ({exc})") from None
    types = required if isinstance(required, Mapping) else dict.fromkeys(required)
    rows = []
    for where, row in located:
        if not isinstance(row, dict):
            raise ValueError(f"{flag}: {file} {where} is not an object: {row!r:.80}")
        missing = [key for key in types if key not in row]
        if missing:
            raise ValueError(f"{flag}: {file} {where} lacks {missing}")
        for key, kind in types.items():
            if kind is not None and not isinstance(row[key], kind):
                name = (
                    kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
                )
                raise ValueError(
                    f"{flag}: {file} {where}: {key!r} must be {name}, not {type(row[key]).__name__}"
                )
        rows.append(row)
    if not rows and not allow_empty:
        raise ValueError(f"{flag}: {file} holds no rows")
    return rows
