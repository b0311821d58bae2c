"""Offline stand-ins for the Hugging Face hub datasets that upstream's environments load.

Put this folder on ``PYTHONPATH`` and set ``ATROPOS_STANDIN_DATA`` to a folder of JSONL files:
``datasets.load_dataset("owner/name", ..., split="train")`` then reads
``owner__name.train.jsonl`` (or ``owner__name.jsonl`` for any split) from that folder instead of
the hub. Local loaders (``json``, ``csv``, ``parquet``, paths) are untouched, and a hub name
without a stand-in raises ``FileNotFoundError`` naming the file it looked for. The
environment files themselves are not changed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "imagefolder", "audiofolder"}


def _install() -> None:
    folder = os.environ.get("ATROPOS_STANDIN_DATA")
    if not folder:
        return
    import datasets

    original = datasets.load_dataset
    root = Path(folder)

    def _file(path: str, split: str) -> Path | None:
        stem = path.replace("/", "__")
        for candidate in (root / f"{stem}.{split}.jsonl", root / f"{stem}.jsonl"):
            if candidate.is_file():
                return candidate
        return None

    def load_dataset(path: str, name: str | None = None, *args: Any, **kwargs: Any) -> Any:
        if path in _LOCAL_BUILDERS or os.path.exists(path):
            return original(path, name, *args, **kwargs)
        split = kwargs.pop("split", None)
        streaming = kwargs.pop("streaming", False)
        splits = [split] if split else ["train", "test", "validation"]
        loaded = {}
        for one in splits:
            file = _file(path, str(one))
            if file is not None:
                loaded[one] = datasets.Dataset.from_json(str(file))
        if not loaded:
            raise FileNotFoundError(
                f"no offline stand-in for hub dataset {path!r} (split {split!r}) in {root}"
            )
        if streaming:
            loaded = {k: v.to_iterable_dataset() for k, v in loaded.items()}
        if split:
            return loaded[split]
        return (
            datasets.DatasetDict(loaded) if not streaming else datasets.IterableDatasetDict(loaded)
        )

    datasets.load_dataset = load_dataset


_install()

if os.environ.get("ATROPOS_SCRIPTED_MODEL"):
    import scripted_lm

    scripted_lm.register()
