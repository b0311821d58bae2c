"""Loading the tokenizer the data tools and the viewer decode with."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from atroposlib.datagen.options import DatagenError


def load_tokenizer(name_or_path: str) -> Any:
    """A Hugging Face tokenizer from a local folder or a hub name, without network if possible.

    A local folder is loaded with ``local_files_only``. A hub name is first looked up in the local
    cache and only then downloaded (unless ``HF_HUB_OFFLINE=1``).
    """
    from transformers import AutoTokenizer

    path = Path(name_or_path).expanduser()
    if path.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
            raise DatagenError(f"--tokenizer {name_or_path}: cannot load it: {exc}") from None
    if path.exists():
        raise DatagenError(f"--tokenizer {name_or_path}: a file, expected a tokenizer folder")
    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached: try the hub below
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline:
        raise DatagenError(
            f"--tokenizer {name_or_path}: not a local folder and not in the Hugging Face cache "
            "(HF_HUB_OFFLINE is set); pass the folder of the tokenizer your environment uses"
        )
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as exc:  # noqa: BLE001
        raise DatagenError(
            f"--tokenizer {name_or_path}: cannot load it ({exc}); pass a local folder or a "
            "Hugging Face model name"
        ) from None
