"""``view-run``: look at the rollouts of a run in the browser (Gradio).

Acts as the trainer of a run, like upstream: resets the trajectory API at ``--api-url``,
registers with ``batch_size = group_size * 8`` and takes a batch from ``GET /batch`` each time
"Grab Next Batch" is pressed; every group taken is kept and shown
(:mod:`atroposlib.frontend.run_viewer`). ``view-run --file rollouts.jsonl`` opens the JSONL
written by an environment's ``process`` command instead; no server is needed or touched.

The page binds 127.0.0.1 (``--host`` to change) and makes no public link unless ``--share``;
other web pages cannot use it (see :func:`atroposlib.frontend.run_viewer.launch`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from atroposlib.api.client import TrainerClient, TrajectoryAPIError
from atroposlib.datagen.options import DEFAULT_TOKENIZER
from atroposlib.frontend.run_viewer import (
    GROUPS_PER_BATCH,
    RunViewer,
    ViewRunOptions,
    launch,
    read_groups_file,
)
from atroposlib.utils.cli import ModelArgumentParser, ModelFlags, parse_model


def _flags(tokenizer: str) -> ModelFlags:
    return ModelFlags(ViewRunOptions, defaults={"tokenizer": tokenizer})


def build_parser(prog: str = "view-run", tokenizer: str = DEFAULT_TOKENIZER) -> ModelArgumentParser:
    """The ``view-run`` argument parser (upstream's options plus --api-url, --share, --file)."""
    parser = ModelArgumentParser(
        prog=prog,
        description="Browse the rollouts of a run: take batches from a trajectory API (as its "
        "trainer; the API is reset at start) or open a process JSONL file.",
    )
    _flags(tokenizer).add_to(parser)
    return parser


def main(
    argv: Sequence[str] | None = None,
    prog: str = "view-run",
    tokenizer: str = DEFAULT_TOKENIZER,
    title: str = "Atropos run viewer",
) -> None:
    """Entry point of ``view-run``."""
    parser = build_parser(prog, tokenizer)
    options, _ = parse_model(_flags(tokenizer), parser, argv, base={"tokenizer": tokenizer})
    assert isinstance(options, ViewRunOptions)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        import gradio  # noqa: F401
    except ImportError:
        parser.exit(1, f"{prog}: gradio is not installed: pip install 'atroposlib[examples]'\n")
    if options.file:
        if not Path(options.file).is_file():
            parser.error(f"--file {options.file!r}: no such file")
        viewer = RunViewer(options.tokenizer)
        groups = read_groups_file(options.file)
        if not groups:
            parser.error(f"--file {options.file!r}: no scored groups in it")
        viewer.add_batch(groups)
    else:
        client = TrainerClient(options.api_url)
        try:
            client.reset(timeout=0)
            client.register(
                batch_size=options.group_size * GROUPS_PER_BATCH,
                max_token_len=options.max_token_len,
                checkpoint_dir="checkpoints",
                save_checkpoint_interval=10,
                starting_step=0,
                num_steps=options.num_steps,
                wandb_group="test",
                wandb_project="test",
                timeout=10,
            )
        except TrajectoryAPIError as exc:
            parser.exit(1, f"{prog}: --api-url {options.api_url}: {exc}\n")
        viewer = RunViewer(options.tokenizer, client, batch_wait_s=options.batch_wait)
    launch(
        viewer,
        host=options.host,
        port=options.port,
        share=options.share,
        allowed_hosts=options.allowed_hosts,
        title=title,
    )


if __name__ == "__main__":
    main()
