"""A stand-in trainer for launcher tests: registers with run-api, pulls batches with
:class:`~atroposlib.api.client.TrainerClient`, writes what it got, exits 0.

``python pull_batches.py API_URL OUT.json BATCHES BATCH_SIZE``; ``OUT.json`` gets
``{"batches", "groups", "sequences", "api_key_set", "node"}`` (``api_key_set``: whether
``ATROPOS_API_KEY`` reached this process).
"""

import json
import os
import socket
import sys

from atroposlib.api.client import TrainerClient


def main() -> None:
    url, out, batches, batch_size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    groups = sequences = 0
    with TrainerClient(url) as client:
        client.register(
            batch_size=batch_size,
            max_token_len=64,
            checkpoint_dir="",
            save_checkpoint_interval=-1,
            starting_step=0,
            num_steps=batches,
        )
        for _ in range(batches):
            batch = client.get_batch(timeout=120, poll=0.2)
            groups += len(batch)
            sequences += sum(len(g["tokens"]) for g in batch)
        extra = client.try_batch(timeout=10)  # acknowledges the last batch
        if extra:
            batches += 1
            groups += len(extra)
            sequences += sum(len(g["tokens"]) for g in extra)
    with open(out, "w") as f:
        json.dump({"batches": batches, "groups": groups, "sequences": sequences,
                   "api_key_set": bool(os.environ.get("ATROPOS_API_KEY")),
                   "node": socket.gethostname()}, f)  # fmt: skip


if __name__ == "__main__":
    main()
