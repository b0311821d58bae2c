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
``/update_weight_version {"new_version"}``, ``GET /weight_info``, ``/is_paused`` and
``/server_info`` (its device: ``$FAKE_VLLM_DEVICE``, default cuda); without dev mode those
answer 404. Launched with ``--middleware`` it answers ``GET /policy_version`` as
``example_trainer/vllm_plugins/atropos_policy_version.py`` does. Launched with
``--weight-transfer-config`` it speaks vLLM's weight-transfer protocol with gloo standing in for
NCCL (one worker): ``GET /get_world_size``, ``POST /init_weight_transfer_engine`` (joins the
trainer's group at ``master_address:master_port`` as rank ``rank_offset``),
``/start_weight_update``, ``/update_weights`` (receives one broadcast per parameter, in order,
and records each tensor's sum), ``/finish_weight_update {"weight_version"}``. Every such call
appends ``{"path", "query", "body"}`` (plus ``"received"``) to ``$FAKE_VLLM_CALLS`` when set.

``POST /v1/completions`` (dev mode or not) answers as vLLM 0.32 does from a deterministic toy
model (:func:`toy_logprobs`: next-token log-probs over token ids 200-263 and EOS 2, a function
of the previous token and of the weights loaded, so a reload changes them): token-id or text
prompts, ``n``, ``max_tokens``, ``temperature`` (0: greedy; log-probs of the scaled
distribution, as ``--logprobs-mode processed_logprobs``), ``seed``, ``logprobs``,
``prompt_logprobs``, ``return_token_ids``, ``return_tokens_as_token_ids``; a wrong model name
gets vLLM's 404 ``{"error": ...}``. Like vLLM's OpenAI server it has no ``POST /generate``.
"""

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
import zlib
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


TOY_VOCAB = [*range(200, 264), 2]  # 2: SmolLM2's EOS (<|im_end|>)


def toy_logprobs(context: list[int], temperature: float = 1.0) -> dict[int, float]:
    """The toy model: log-probs of the next token after ``context`` (temperature-scaled, as
    vLLM's processed log-probs; greedy at 0 reports the raw ones)."""
    salt = zlib.crc32(str(state["model"]).encode()) % 997  # new weights, new distribution
    last = context[-1] if context else 0
    logits = [3.0 * math.sin(0.37 * t + 0.11 * (last % 13) + 0.013 * salt) for t in TOY_VOCAB]
    logits[-1] -= 1.5  # EOS: rarer than the rest
    scale = temperature if temperature > 0 else 1.0
    scaled = [x / scale for x in logits]
    top = max(scaled)
    norm = top + math.log(sum(math.exp(x - top) for x in scaled))
    return {t: x - norm for t, x in zip(TOY_VOCAB, scaled, strict=True)}


def _sample(context, params, rng):
    ids, lps = [], []
    for _ in range(int(params.get("max_tokens") or 16)):
        dist = toy_logprobs(context + ids, float(params.get("temperature", 1.0)))
        if float(params.get("temperature", 1.0)) == 0:
            token = max(dist, key=dist.get)
        else:
            token = rng.choices(list(dist), weights=[math.exp(v) for v in dist.values()])[0]
        ids.append(token)
        lps.append(max(dist[token], -9999.0))
        if token == 2 and not params.get("ignore_eos"):
            return ids, lps, "stop"
    return ids, lps, "length"


def _prompt_logprobs(prompt: list[int], k: int) -> list:
    out: list = [None]
    for position in range(1, len(prompt)):
        dist = toy_logprobs(prompt[:position])
        ranked = sorted(dist, key=dist.get, reverse=True)
        token = prompt[position]
        value = dist.get(token, -9999.0)
        entry = {str(token): {"logprob": value, "rank": ranked.index(token) + 1 if token in dist
                              else len(ranked) + 1, "decoded_token": ""}}  # fmt: skip
        for rank, other in enumerate(ranked[:k], start=1):
            entry.setdefault(str(other), {"logprob": dist[other], "rank": rank,
                                          "decoded_token": ""})  # fmt: skip
        out.append(entry)
    return out


def completions(body: dict) -> tuple[int, dict]:
    """``POST /v1/completions`` as vLLM answers it, from the toy model."""
    if body.get("model") not in (None, name):
        return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                               "type": "NotFoundError", "param": "model", "code": 404}}  # fmt: skip
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [[100 + ord(c) % 100 for c in prompt]]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = [[100 + ord(c) % 100 for c in p] if isinstance(p, str) else p for p in prompt]
    rng = random.Random(body.get("seed"))
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    choices = []
    for p, prompt_ids in enumerate(prompts):
        for i in range(int(body.get("n", 1))):
            ids, lps, reason = _sample(list(prompt_ids), body, rng)
            labels = [f"token_id:{t}" if as_ids else f"<{t}>" for t in ids]
            logprobs = None
            if body.get("logprobs") is not None:
                logprobs = {"tokens": labels, "token_logprobs": lps,
                            "top_logprobs": [{lab: lp} for lab, lp in zip(labels, lps, strict=True)],
                            "text_offset": [sum(len(x) for x in labels[:j])
                                            for j in range(len(labels))]}  # fmt: skip
            choices.append({
                "index": p * int(body.get("n", 1)) + i, "text": "".join(f"<{t}>" for t in ids),
                "logprobs": logprobs, "finish_reason": reason, "stop_reason": None,
                "token_ids": ids if body.get("return_token_ids") else None,
                "prompt_logprobs": _prompt_logprobs(prompt_ids, body["prompt_logprobs"])
                if body.get("prompt_logprobs") is not None else None,
                "prompt_token_ids": list(prompt_ids) if body.get("return_token_ids") else None,
            })  # fmt: skip
    usage = {"prompt_tokens": sum(map(len, prompts)),
             "completion_tokens": sum(len(c["text"]) // 5 for c in choices)}  # fmt: skip
    return 200, {"id": "cmpl-toy", "object": "text_completion", "created": int(time.time()),
                 "model": name, "choices": choices, "usage": usage}  # fmt: skip


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
        elif path == "/server_info" and DEV:
            device = os.environ.get("FAKE_VLLM_DEVICE", "cuda")
            self._send(200, {"vllm_config": {"device_config": {"device": device}}})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):  # noqa: N802 - http.server's naming
        url = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}") if length else {}
        if url.path == "/v1/completions":
            status, reply = completions(body)
            _record_call(url.path, query, {k: v for k, v in body.items() if k != "prompt"})
            self._send(status, reply)
            return
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
