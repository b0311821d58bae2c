"""A stand-in for ``python -m vllm.entrypoints.openai.api_server`` in process-management tests.

Takes vLLM's flags (unknown ones ignored), serves ``/health`` and ``/v1/models`` on --host/--port
after ``FAKE_VLLM_DELAY`` seconds, exits with status 3 at once when ``FAKE_VLLM_FAIL`` is set,
and starts a sleeping grandchild (its pid written next to the launch record) so tests can check
that stopping the server also stops what it spawned. Every launch appends
``{"pid", "model", "served_model_name", "grandchild"}`` to ``$FAKE_VLLM_RECORD``.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--served-model-name", default=None)
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=8000)
args, _ = parser.parse_known_args()

if os.environ.get("FAKE_VLLM_FAIL"):
    print("fake vllm: CUDA out of memory (simulated)", flush=True)
    sys.exit(3)

grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
name = args.served_model_name or args.model
with open(os.environ["FAKE_VLLM_RECORD"], "a") as record:
    record.write(
        json.dumps(
            {
                "pid": os.getpid(),
                "model": args.model,
                "served_model_name": name,
                "grandchild": grandchild.pid,
            }
        )
        + "\n"
    )
time.sleep(float(os.environ.get("FAKE_VLLM_DELAY", "0")))


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        if self.path == "/health":
            body = b""
        elif self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": name, "root": args.model}]})
            body = body.encode()
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


print(f"fake vllm serving {args.model} as {name} on {args.port}", flush=True)
ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
