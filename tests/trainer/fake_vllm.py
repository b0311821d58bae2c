"""A stand-in for ``python -m vllm.entrypoints.openai.api_server`` in process-management tests.

Takes vLLM's flags (unknown ones ignored), serves ``/health`` and ``/v1/models`` on --host/--port
after ``FAKE_VLLM_DELAY`` seconds, exits with status 3 at once when ``FAKE_VLLM_FAIL`` is set,
and starts a sleeping grandchild (its pid written next to the launch record) so tests can check
that stopping the server also stops what it spawned. Every launch appends
``{"pid", "model", "served_model_name", "grandchild", "argv", "env"}`` to ``$FAKE_VLLM_RECORD``.

With ``VLLM_SERVER_DEV_MODE=1`` (and ``FAKE_VLLM_NO_RL`` unset) it also speaks vLLM's RL and dev
routes the in-place reload uses, as vLLM 0.32 does: ``POST /pause?mode=``, ``/resume``,
``/collective_rpc`` (``reload_weights`` with ``weights_path``: the folder must hold config.json,
else HTTP 500; afterwards ``/v1/models`` reports it as ``root``), ``/reset_prefix_cache``,
``/update_weight_version {"new_version"}``, ``GET /weight_info`` and ``/is_paused``; without dev
mode those answer 404. Launched with ``--middleware`` it answers ``GET /policy_version`` as
``example_trainer/vllm_plugins/atropos_policy_version.py`` does. Launched with
``--weight-transfer-config`` it speaks vLLM's weight-transfer protocol with gloo standing in for
NCCL (one worker): ``GET /get_world_size``, ``POST /init_weight_transfer_engine`` (joins the
trainer's group at ``master_address:master_port`` as rank ``rank_offset``),
``/start_weight_update``, ``/update_weights`` (receives one broadcast per parameter, in order,
and records each tensor's sum), ``/finish_weight_update {"weight_version"}``. Every such call
appends ``{"path", "query", "body"}`` (plus ``"received"``) to ``$FAKE_VLLM_CALLS`` when set.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--served-model-name", default=None)
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=8000)
parser.add_argument("--middleware", action="append", default=[])
parser.add_argument("--weight-transfer-config", default=None)
args, _ = parser.parse_known_args()
DEV = os.environ.get("VLLM_SERVER_DEV_MODE") == "1" and not os.environ.get("FAKE_VLLM_NO_RL")
state = {"model": args.model, "weight_version": "default", "paused": False, "group": None}

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
                "argv": sys.argv[1:],
                "env": {
                    key: os.environ.get(key)
                    for key in ("PYTHONPATH", "ATROPOS_POLICY_VERSION", "VLLM_SERVER_DEV_MODE")
                },
            }
        )
        + "\n"
    )
time.sleep(float(os.environ.get("FAKE_VLLM_DELAY", "0")))


def _record_call(path: str, query: dict, body: dict, **extra: object) -> None:
    if os.environ.get("FAKE_VLLM_CALLS"):
        with open(os.environ["FAKE_VLLM_CALLS"], "a") as calls:
            calls.write(json.dumps({"path": path, "query": query, "body": body, **extra}) + "\n")


def _join_group(info: dict) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=60)
    store = dist.TCPStore(
        info["master_address"], info["master_port"], info["world_size"], False, timeout=timeout
    )
    state["group"] = dist.ProcessGroupGloo(store, info["rank_offset"], info["world_size"], timeout)


def _receive(info: dict) -> dict:
    import torch

    received = {}
    for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        state["group"].broadcast(tensor, 0).wait()
        received[name] = float(tensor.double().sum())
    return received


class Handler(BaseHTTPRequestHandler):
    def _send(self, status: int, body: object = b"") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's naming
        path = urlsplit(self.path).path
        if path == "/health":
            self._send(200)
        elif path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": name, "root": state["model"]}]})
        elif path == "/policy_version" and args.middleware:
            try:
                version = int(state["weight_version"])
            except ValueError:
                version = int(os.environ.get("ATROPOS_POLICY_VERSION", "0") or 0)
            self._send(200, {"policy_version": version})
        elif path == "/weight_info" and DEV:
            self._send(200, {"weight_version": state["weight_version"]})
        elif path == "/is_paused" and DEV:
            self._send(200, {"is_paused": state["paused"]})
        elif path == "/get_world_size" and DEV:
            self._send(200, {"world_size": 1})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):  # noqa: N802 - http.server's naming
        url = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}") if length else {}
        if not DEV:
            self._send(404, {"detail": "Not Found"})
            return
        _record_call(url.path, query, body)
        if url.path == "/pause":
            state["paused"] = True
            self._send(200, {"status": "paused"})
        elif url.path == "/resume":
            state["paused"] = False
            self._send(200, {"status": "resumed"})
        elif url.path == "/collective_rpc":
            path = body.get("kwargs", {}).get("weights_path", "")
            if body.get("method") != "reload_weights" or not (Path(path) / "config.json").is_file():
                self._send(500, {"error": f"reload_weights failed for {path!r}"})
                return
            state["model"] = path
            self._send(200)
        elif url.path == "/reset_prefix_cache":
            self._send(200, {"success": True})
        elif url.path == "/update_weight_version":
            state["weight_version"] = body["new_version"]
            self._send(200, {"success": True, "new_version": body["new_version"]})
        elif url.path == "/init_weight_transfer_engine" and args.weight_transfer_config:
            _join_group(body["init_info"])
            self._send(200, {"message": "Weight transfer initialized"})
        elif url.path == "/start_weight_update" and state["group"] is not None:
            self._send(200, {"message": "Weight update started"})
        elif url.path == "/update_weights" and state["group"] is not None:
            received = _receive(body["update_info"])
            _record_call("/update_weights (received)", {}, {}, received=received)
            self._send(200, {"message": "Weights updated"})
        elif url.path == "/finish_weight_update" and state["group"] is not None:
            if body.get("weight_version") is not None:
                state["weight_version"] = body["weight_version"]
            state["model"] = "transferred"
            self._send(200, {"message": "Weight update finished"})
        else:
            self._send(404, {"detail": "Not Found"})

    def log_message(self, *a):
        pass


print(f"fake vllm serving {args.model} as {name} on {args.port}", flush=True)
ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
