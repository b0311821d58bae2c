"""A trainer stand-in for launch tests (a run description's ``trainer.command``).

Registers with run-api (``$ATROPOS_API_URL``, as the launcher sets it) and pulls batches with
:class:`atroposlib.api.client.TrainerClient` until it has ``--batches`` of them and, with
``--release FILE``, until that file exists (so a test decides when the run may end); then
writes ``{"batches", "groups", "sequences"}`` to ``--report`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from atroposlib.api.client import TrainerClient


def main() -> None:
    """Pull batches until done (see the module docstring)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-token-len", type=int, default=512)
    parser.add_argument("--release", default=None)
    parser.add_argument("--report", required=True)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    url = os.environ["ATROPOS_API_URL"]
    deadline = time.monotonic() + args.timeout
    batches = groups = sequences = 0
    with TrainerClient(url) as client:
        client.register(batch_size=args.batch_size, max_token_len=args.max_token_len,
                        checkpoint_dir="", save_checkpoint_interval=-1, starting_step=0,
                        num_steps=1000)  # fmt: skip
        while batches < args.batches or (args.release and not Path(args.release).exists()):
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out after {batches} batches")
            batch = client.try_batch()
            if not batch:
                time.sleep(0.2)
                continue
            batches += 1
            groups += len(batch)
            sequences += sum(len(g["tokens"]) for g in batch)
            print(f"batch {batches}: {len(batch)} groups (step {client.last_step})", flush=True)
    Path(args.report).write_text(
        json.dumps({"batches": batches, "groups": groups, "sequences": sequences})
    )


if __name__ == "__main__":
    main()
