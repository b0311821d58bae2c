"""vLLM server entry point used by the trainer (``python -m example_trainer.vllm_api_server``).

Upstream's module of this name is a custom vLLM server (``/generate``, ``/health``, weight-bridge
and LoRA routes) and imports vLLM at import time. Here the module imports without vLLM (so
``import example_trainer.vllm_api_server`` always works) and running it starts a server that
speaks what Atropos environments need (``/generate`` with token ids and logprobs, the OpenAI
routes, ``/health``):

- with vLLM installed: vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``), arguments
  passed through unchanged;
- without vLLM (e.g. on a CPU laptop): ``atropos-serve``, which takes the common flags
  (``--model``, ``--port``, ``--host``, ``--served-model-name``, ``--dtype``,
  ``--max-model-len``) and ignores GPU-only ones with a warning.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from collections.abc import Sequence

VLLM_AVAILABLE = importlib.util.find_spec("vllm") is not None
"""Whether vLLM can be imported in this environment."""

VLLM_MODULE = "vllm.entrypoints.openai.api_server"

# Flags atropos-serve understands, with whether they take a value.
_SERVE_FLAGS = {
    "--model": True,
    "--port": True,
    "--host": True,
    "--served-model-name": True,
    "--dtype": True,
    "--max-model-len": True,
    "--api-key": True,
}


def atropos_serve_args(argv: Sequence[str]) -> list[str]:
    """Keep the vLLM flags ``atropos-serve`` understands; report the rest on stderr."""
    kept: list[str] = []
    dropped: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        takes_value = _SERVE_FLAGS.get(flag)
        if takes_value is None:
            dropped.append(args[i])
            i += 1
            # skip the value of an unknown flag (anything not starting with --)
            while i < len(args) and not args[i].startswith("--"):
                dropped.append(args[i])
                i += 1
            continue
        if inline:
            kept.append(args[i])
            i += 1
        else:
            kept.extend(args[i : i + 2])
            i += 2
    if "--dtype" in kept:
        position = kept.index("--dtype") + 1
        if position < len(kept) and kept[position] in {"half", "bfloat16", "auto"}:
            kept[position] = {"half": "float16"}.get(kept[position], kept[position])
    if dropped:
        print(
            f"[vllm_api_server] vLLM not installed; atropos-serve ignores: {' '.join(dropped)}",
            file=sys.stderr,
        )
    return kept


def main(argv: Sequence[str] | None = None) -> None:
    """Run vLLM's OpenAI server when vLLM is installed, else ``atropos-serve``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if VLLM_AVAILABLE:
        sys.argv = [VLLM_MODULE, *args]
        runpy.run_module(VLLM_MODULE, run_name="__main__", alter_sys=True)
        return
    from atroposlib.inference.cli import main as serve_main

    serve_main(atropos_serve_args(args))


if __name__ == "__main__":
    main()
