"""A stand-in trainer for the launcher's key test: from inside a run bound beyond loopback,
probe the inference server with and without the run's key, use the weight-sync client (key
from ``ATROPOS_API_KEY``), pull batches, write what it saw.

``python key_probe.py OUT.json BATCHES``.
"""

import json
import os
import sys

import httpx

from atroposlib.api.client import TrainerClient
from atroposlib.backends import server_policy_version, weight_sync_client
from atroposlib.envs.server_handling.server_baseline import APIServerConfig


def main() -> None:
    out, batches = sys.argv[1], int(sys.argv[2])
    root = os.environ["ATROPOS_WEIGHT_SYNC_URLS"].split(",")[0]
    key = os.environ["ATROPOS_API_KEY"]
    body = {"model": "policy", "prompt": "hi", "max_tokens": 2}
    seen: dict = {"root": root}
    # nobody without the key: generation, pause, weight reload, policy version
    seen["no_key"] = {
        "completions": httpx.post(f"{root}/v1/completions", json=body).status_code,
        "generate": httpx.post(f"{root}/generate", json={"prompt": "hi"}).status_code,
        "pause": httpx.post(f"{root}/pause").status_code,
        "reload_weights": httpx.post(f"{root}/reload_weights", json={"path": "/"}).status_code,
        "policy_version": httpx.get(f"{root}/policy_version").status_code,
        "wrong_key": httpx.post(
            f"{root}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
        ).status_code,
        "health": httpx.get(f"{root}/health").status_code,
    }
    # an environment's client config picks the run's key up
    config = APIServerConfig(server_type="vllm", base_url=f"{root}/v1", model_name="policy")
    seen["env_client_has_key"] = config.api_key == key
    seen["with_key"] = httpx.post(
        f"{root}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ).status_code
    # the trainer's weight-sync client sends it too
    sync = weight_sync_client("atropos-serve", root)
    sync.start(None, 0)
    sync.pause("wait")
    sync.resume()
    seen["policy_version"] = server_policy_version(root)
    with TrainerClient(os.environ["ATROPOS_API_URL"]) as client:
        client.register(batch_size=8, max_token_len=256, checkpoint_dir="",
                        save_checkpoint_interval=-1, starting_step=0,
                        num_steps=batches)  # fmt: skip
        for _ in range(batches):
            client.get_batch(timeout=120, poll=0.2)
    seen["batches"] = batches
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
