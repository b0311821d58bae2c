"""``view-run-multimodal``: ``view-run`` with a vision-language tokenizer by default.

The viewer itself shows images for every group that carries them (``images`` as base64 strings
or ``data:`` URLs, or image parts of chat messages), so this command differs from ``view-run``
only in its defaults: tokenizer ``Qwen/Qwen2-VL-2B-Instruct`` and the page title.
"""

from __future__ import annotations

from collections.abc import Sequence

from atroposlib.cli.view_run import main as view_run_main

DEFAULT_TOKENIZER = "Qwen/Qwen2-VL-2B-Instruct"


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``view-run-multimodal``."""
    view_run_main(
        argv,
        prog="view-run-multimodal",
        tokenizer=DEFAULT_TOKENIZER,
        title="Atropos run viewer (multimodal)",
    )


if __name__ == "__main__":
    main()
