"""Local datasets for environments: rows of a JSONL or JSON file, or of a split in a folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["load_rows"]


def load_rows(path: str | Path, split: str) -> list[dict[str, Any]]:
    """Rows of a local dataset, each a JSON object.

    ``path`` is a ``.jsonl`` file (one row a line, blank lines skipped), a ``.json`` file (a
    list of rows or ``{"data": [...]}``) — either used for every split — or a folder holding
    ``{split}.jsonl`` or ``{split}.json``.

    Raises FileNotFoundError naming the path, ValueError naming the line or the shape problem.
    """
    path = Path(path)
    if path.is_dir():
        candidates = [path / f"{split}.jsonl", path / f"{split}.json"]
        file = next((c for c in candidates if c.is_file()), candidates[0])
    else:
        file = path
    if not file.is_file():
        raise FileNotFoundError(f"dataset_path: no such file {file}")
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"dataset_path: {file}: invalid JSON: {exc}") from exc
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"dataset_path: {file}: expected a list of rows or {{'data': [...]}}")
        rows = data
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"dataset_path: {file} line {number}: {exc}") from exc
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"dataset_path: {file}: row {i + 1} is not an object: {row!r:.80}")
    return rows
