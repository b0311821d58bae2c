"""A minimal trainer for launcher tests: register, pull N batches, record them, exit 0.

    python pull_batches.py N BATCH_SIZE OUT.json

The API's URL comes from ATROPOS_API_URL (the launcher sets it; ATROPOS_API_KEY too when the
run has a key). OUT.json gets ``{"batches": N, "groups": G, "sequences": S}``.
"""

import json
import os
import sys

from atroposlib.api.client import TrainerClient

n, batch_size, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
groups = sequences = 0
with TrainerClient(os.environ["ATROPOS_API_URL"]) as client:
    client.register(
        batch_size=batch_size,
        max_token_len=512,
        checkpoint_dir="",
        save_checkpoint_interval=0,
        starting_step=0,
        num_steps=n,
    )
    for i in range(n):
        batch = client.get_batch(timeout=120, poll=0.2)
        groups += len(batch)
        sequences += sum(len(g["tokens"]) for g in batch)
        print(f"batch {i + 1}/{n}: {len(batch)} groups", flush=True)
with open(out, "w") as handle:
    json.dump({"batches": n, "groups": groups, "sequences": sequences}, handle)
