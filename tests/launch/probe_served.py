"""Records what the run's inference server serves (the log-probs of a fixed prompt and its
``/policy_version``) before and after the trainer command it is given, while the server still
serves: ``$ATROPOS_RUN_OUTPUT/served-before.json`` and ``served.json``.

Used as ``trainer.python`` of a run description (the launcher runs ``PYTHON -m
example_trainer.grpo --config ...``, so the trainer is the launcher's own, unchanged): this
script is made executable by the test and given the real interpreter in ``PROBE_PYTHON``. The
server is read from ``ATROPOS_WEIGHT_SYNC_URLS`` (the servers the trainer synced), the prompt
ids from ``PROBE_IDS`` (JSON) and the served name from ``PROBE_MODEL``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx


def probe(name: str) -> None:
    url = os.environ["ATROPOS_WEIGHT_SYNC_URLS"].split(",")[0]
    ids = json.loads(os.environ["PROBE_IDS"])
    reply = httpx.post(
        url + "/v1/completions",
        json={
            "model": os.environ["PROBE_MODEL"],
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 0,
        },  # fmt: skip
        timeout=300,
    )
    reply.raise_for_status()
    entries = reply.json()["choices"][0]["prompt_logprobs"][1:]
    served = [e[str(t)]["logprob"] for e, t in zip(entries, ids[1:], strict=True)]
    version = httpx.get(url + "/policy_version", timeout=30).json()["policy_version"]
    out = Path(os.environ["ATROPOS_RUN_OUTPUT"]) / name
    out.write_text(json.dumps({"logprobs": served, "policy_version": version}))


def main() -> int:
    probe("served-before.json")
    code = subprocess.call([os.environ["PROBE_PYTHON"], *sys.argv[1:]])
    if code != 0:
        return code
    probe("served.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
