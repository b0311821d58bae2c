"""Continuous-batching generation engine for a Hugging Face causal LM on the CPU (or one GPU).

One scheduler thread owns the model. Every request (with all of its ``n`` samples) waits in a
bounded FIFO queue; each loop iteration the scheduler

1. admits waiting requests while the batch has room: their prompts are prefilled together
   (left-padded, one forward pass; prompts of very different lengths in a few passes of similar
   lengths), the prompt's KV cache is copied once per sample, and the new rows are merged into
   the running batch's KV cache;
2. runs one decode step for every sequence in flight (one token each, batched, KV-cached);
3. retires finished sequences (EOS, stop ids or strings, ``max_tokens``), dropping their rows
   and any padding columns no row needs any more.

So a group of 8 samples costs one prefill plus ``max_tokens`` batched steps instead of eight
sequential generations, and requests arriving mid-flight join at the next step instead of
waiting for the batch to drain.

The KV cache is a transformers ``DynamicCache`` laid out left-padded: row ``i``'s real tokens
are the right-most columns with ``attention_mask[i] == 1``; positions are passed explicitly.
This layout holds for models whose layers all use full attention (Llama, Qwen2, Mistral without
sliding windows, ...), which is what the embedded server is for.

Where the lean decode step runs and a batch starts with requests of several samples each (an
RL environment's groups), the batch is a
:class:`~atroposlib.inference.fastpath.GroupedBatch` instead: each request's prompt keys and
values once, plus each row's generated ones, so a group of 16 neither copies its prompt 16
times into the batch nor reads it 16 times per decode step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from atroposlib.inference import fastpath
from atroposlib.inference.fastpath.attention import (
    HEADROOM,
    select_rows,
    stack_right_aligned,
    stacked_append_cache,
)
from atroposlib.inference.prefix_cache import PrefixCache, common_prefix_len
from atroposlib.inference.sampling import (
    LOGPROBS_MODES,
    InvalidParamError,
    RowState,
    SamplingParams,
    sample_next,
)
from atroposlib.utils.kv_cache import cache_kwargs, output_cache
from atroposlib.utils.memory import mapped_allocations, release_free_memory

logger = logging.getLogger(__name__)

#: A batch keeps prompts once per request when its first requests ask for at least this many
#: samples each on average (:meth:`GenerationEngine._use_grouped`).
GROUPED_MIN_SAMPLES = 4

#: Prompts prefilled together are split into passes of similar lengths when padding them to
#: the longest would make more than this share of the positions computed padding ...
PREFILL_PADDING_SLACK = 0.15
#: ... and more than this many positions (a pass of its own costs little more than its
#: positions, but below this the split is not worth it).
PREFILL_PADDING_MIN = 64


def copy_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (parameter name -> value, converted to the parameter's dtype) into
    ``model``'s parameters in place; parameters tied to a given one follow it."""
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)


class EngineError(Exception):
    """Base class of errors the engine reports to a request."""


class QueueFullError(EngineError):
    """The waiting queue is full; the client should retry later (HTTP 429)."""


class MemoryBudgetError(ValueError):
    """A request whose key/value cache could never fit the memory budget, even alone."""

    code = "memory_budget_exceeded"

    def __init__(self, message: str, param: str = "max_tokens") -> None:
        super().__init__(message)
        self.param = param


class EngineUnavailableError(EngineError):
    """The engine is stopped or failed (HTTP 503)."""


@dataclass
class SampleOutput:
    """One finished (or streaming) sample of a request."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Raw model log-prob of each generated token."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    """Per generated token, the top ``params.logprobs`` (id, raw log-prob) pairs (if asked)."""
    text: str = ""
    finish_reason: str | None = None
    """``stop`` (EOS, stop id or stop string), ``length`` (max_tokens) or ``abort``."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the sample, None for EOS or length."""


@dataclass
class StreamEvent:
    """Progress of one sample: the tokens and text produced since the last event."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class ReloadInfo:
    """What ``/reload_weights`` reports once new weights serve requests."""

    weights_version: int
    requested_at: float
    live_at: float
    drain_seconds: float
    """How long in-flight sequences took to finish on the old weights."""
    copy_seconds: float = 0.0
    """In-place updates (:meth:`GenerationEngine.request_update`): copying the new tensors into
    the served parameters."""
    prepare_seconds: float = 0.0
    """In-place updates: re-packing the fast path's weight copies from the new weights."""
    outgoing: Any = None
    """``request_reload(..., keep_outgoing=True)``: the model swapped out (its fast path
    released), for the caller to reuse; else None."""


@dataclass
class _InPlaceUpdate:
    """New values for the served model's parameters, copied in when the batch has drained."""

    tensors: dict[str, torch.Tensor]


class RequestHandle:
    """A submitted request: iterate its events or await its final outputs.

    Created by :meth:`GenerationEngine.submit` on the event loop that will consume it. Leaving
    :meth:`events` early (client disconnect, cancellation) aborts the request's sequences.
    """

    def __init__(
        self,
        engine: GenerationEngine,
        prompt_ids: list[int],
        params: SamplingParams,
        stream: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.id = uuid.uuid4().hex
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.params = params
        self.stream = stream
        self.outputs = [SampleOutput(index=i) for i in range(params.n)]
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.weights_version: int | None = None
        self.submitted_at = time.monotonic()
        self.aborted = False
        self.error: EngineError | None = None
        """Set when this request alone failed (its client gets it; the batch goes on)."""
        self._loop = loop
        self._queue: asyncio.Queue[StreamEvent | BaseException | None] = asyncio.Queue()

    def abort(self) -> None:
        """Stop generating for this request; its rows leave the batch at the next step."""
        self.aborted = True

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Yield stream events until every sample has finished (or raise the engine's error)."""
        try:
            while True:
                item = await self._queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not self.finished:
                self.abort()

    async def result(self) -> list[SampleOutput]:
        """Wait for every sample to finish and return them in index order."""
        async for _ in self.events():
            pass
        return self.outputs

    @property
    def finished(self) -> bool:
        """Whether every sample has a finish reason."""
        return all(o.finish_reason is not None for o in self.outputs)

    # Called from the scheduler thread.
    def _put(self, item: StreamEvent | BaseException | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            # The consumer's event loop is closed: nobody is listening any more.
            self.aborted = True


class _Sequence:
    """One sample in flight: the scheduler's bookkeeping around a :class:`SampleOutput`."""

    def __init__(self, handle: RequestHandle, index: int, stop_ids: set[int]) -> None:
        self.handle = handle
        self.params = handle.params
        self.out = handle.outputs[index]
        self.stop_ids = stop_ids
        banned = sorted(stop_ids | set(self.params.stop_token_ids))
        self.row = RowState(
            params=self.params,
            generator=self.params.make_generator(index),
            output_ids=self.out.token_ids,
            prompt_ids=handle.prompt_ids,
            banned_until_min=banned if self.params.min_tokens else [],
        )
        self.emitted_tokens = 0
        self.emitted_chars = 0
        self.checked_chars = 0
        # Incremental detokenisation (as vLLM does): only a short window of ids is decoded per
        # step, so the cost per token stays flat however long the sample grows.
        self.prefix_offset = 0
        self.read_offset = 0
        self.max_stop_len = max((len(s) for s in self.params.stop), default=0)

    @property
    def finished(self) -> bool:
        return self.out.finish_reason is not None


#: What one prefill pass hands to the running batch: the prompts' cache and mask (a row per
#: prompt), the number of samples of each prompt, and the new rows' sequences, first tokens
#: and their log-probs.
_Prefilled = tuple[
    DynamicCache, torch.Tensor, list[int], list[_Sequence], torch.Tensor, torch.Tensor
]


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes of key/value cache per token per sequence: keys and values of every layer.

    A model whose config does not describe attention heads (a custom architecture) is sized
    as full multi-head attention over ``hidden_size`` (keys and values of ``hidden_size`` each
    per layer); one with neither gets 0, and its requests are not admitted against the memory
    budget (logged once at start-up by the caller)."""
    config = model.config
    config = getattr(config, "text_config", None) or config
    dtype = next(model.parameters()).dtype
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not layers or not hidden:
        return 0
    if not heads:
        return 2 * layers * hidden * dtype.itemsize
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


def release_model(model: PreTrainedModel) -> None:
    """Drop what :meth:`GenerationEngine.prepare_model` added to ``model`` (packed and fused
    weight copies) and the reference cycles it made, so a replaced model is freed as soon as
    its last plain reference goes (:func:`~atroposlib.inference.fastpath.release`)."""
    fastpath.release(model)


class GenerationEngine:
    """Serve generation requests for one model with continuous batching on a scheduler thread.

    ``max_batch`` bounds the sequences decoded together (all samples of all requests);
    ``max_waiting`` bounds the requests queued behind them (more raise :class:`QueueFullError`);
    ``prefill_token_budget`` bounds how many prompt tokens one iteration prefills, so long
    prompts do not stall the decoding of everyone else for long. Prompts prefilled together
    that share a prefix of at least ``min_shared_prefix`` tokens compute it once; prompts of
    very different lengths are prefilled in passes of similar lengths
    (``split_prefill_by_length``), so that little of the work is padding.

    The scheduler thread runs torch with ``threads`` intra-op threads (default: torch's
    current setting, usually one per core). Other threads of the process should run torch
    single-threaded, as ``atropos-serve`` arranges: every thread that runs a parallel torch
    op keeps an OpenMP pool, and once the pools hold more threads than there are cores,
    libgomp stops spin-waiting between ops, which made a decode step up to 1.7x slower.

    ``fast_decode`` (the default) runs the CPU fast path of
    :func:`atroposlib.inference.fastpath.prepare` on the model and on every model handed to
    :meth:`request_reload`: a single-token attention kernel, an append-in-place KV cache,
    prepacked oneDNN weights and, for Llama-architecture models, a lean decode step
    (``lean_decode=False`` keeps the model's own forward pass), each where it computes exactly
    what the model computes; the packed and fused weights are extra copies of the linear
    weights. The lean step attends with a C kernel compiled on first use
    (:mod:`atroposlib.inference.fastpath.native`; float32 attention, not bit-identical to
    the model's sdpa); ``native_attention=False`` or ``ATROPOS_NATIVE_KERNELS=0`` keeps sdpa. ``compile`` compiles the decode step instead (keeping only the attention kernel).

    ``logprobs_mode`` (vLLM's names): ``processed_logprobs`` (the default) reports
    log-probabilities of the distribution each token was drawn from (after penalties,
    temperature, min-p, top-k and top-p, renormalised), the behaviour policy an RL trainer's
    importance ratio divides by; ``raw_logprobs`` of the model's own distribution.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch: int = 64,
        max_waiting: int = 1024,
        max_model_len: int | None = None,
        prefill_token_budget: int = 2048,
        max_logprobs: int = 20,
        min_shared_prefix: int = 16,
        prefix_cache_entries: int = 8,
        compile: bool = False,
        fast_decode: bool = True,
        lean_decode: bool = True,
        native_attention: bool = True,
        share_prompt_kv: bool = True,
        split_prefill_by_length: bool = True,
        threads: int | None = None,
        logprobs_mode: str = "processed_logprobs",
        cache_memory: int | None = None,
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}")
        self.processed_logprobs = logprobs_mode == "processed_logprobs"
        self.model = model
        self.threads = threads or torch.get_num_threads()
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.max_logprobs = max_logprobs
        self.prefill_token_budget = prefill_token_budget
        self.min_shared_prefix = min_shared_prefix
        self.idle_trim_seconds = 5.0
        """After this long with nothing to do, the scheduler hands free heap memory back."""
        self.prefix_cache = PrefixCache(
            max_entries=prefix_cache_entries, min_tokens=min_shared_prefix
        )
        """Keys and values of prompt beginnings that earlier requests shared, reused by later
        ones (vLLM's automatic prefix caching); emptied when the weights change."""
        self.compiled = compile
        self.fast_decode = fast_decode
        self.share_prompt_kv = share_prompt_kv
        """Rows of one request keep their prompt's keys and values once (:meth:`_use_grouped`)."""
        self.split_prefill_by_length = split_prefill_by_length
        """Prompts of very different lengths waiting together are prefilled in passes of
        similar lengths (:meth:`_length_buckets`) rather than one pass padded to the longest."""
        self._fast_options = fastpath.FastPathOptions(
            enabled=fast_decode,
            lean=lean_decode,
            native_attention=native_attention,
            compiled=compile,
        )
        self.device = next(model.parameters()).device
        self._fast = self._prepare(model)
        # The decode step (one token per row) is where Python overhead dominates on CPU, so it is
        # the part worth compiling; prefill keeps the eager model (its shapes vary too much).
        self._decode_model = model
        if compile:
            # Duck sizing would make dynamo assume that two sizes equal during warmup stay equal
            # (e.g. the prompt length and the KV length), and recompile when they differ.
            import torch.fx.experimental._config as fx_config

            fx_config.use_duck_shape = False
            self._decode_model = torch.compile(model, dynamic=True)  # type: ignore[assignment]
        model_max = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(max_model_len or model_max, model_max)
        self.eos_ids = self._eos_ids(model, tokenizer)
        self.weights_version = 0
        self.kv_bytes_per_token = kv_bytes_per_token(model)
        """Bytes of key/value cache one token of one sequence holds (all layers)."""
        self.cache_memory = cache_memory
        """Bytes the key/value cache of everything admitted may take (None: no limit); see
        :meth:`cache_bytes`."""

        self._cond = threading.Condition()
        self._waiting: deque[RequestHandle] = deque()
        self._running: list[_Sequence] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        # The running batch in the lean step's layout (prompts once per request) instead of
        # ``_cache``/``_mask`` (a row each): one of the two is set while rows run.
        self._grouped: fastpath.GroupedBatch | None = None
        self._pending_reload: (
            tuple[fastpath.PreparedModel | _InPlaceUpdate, concurrent.futures.Future, float] | None
        ) = None
        self._drain_started: float | None = None
        self._keep_outgoing = False
        # pause/resume (vLLM's RL API): the mode asked for, whether the pause is in effect yet,
        # and the callers waiting for it to be
        self._pause_mode: str | None = None
        self._paused = False
        self._pause_started = 0.0
        self._pause_futures: list[concurrent.futures.Future[float]] = []
        self._stopped = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="atropos-engine", daemon=True)
        self.stats = {
            "generated_tokens": 0,
            "prompt_tokens": 0,
            "requests": 0,
            "steps": 0,
            "shared_prefix_tokens_saved": 0,
            "prefix_cache_hits": 0,
            "prefix_cache_tokens_reused": 0,
            "memory_waits": 0,
            "grouped_steps": 0,
            "prefill_passes": 0,
            "prefill_padding_tokens": 0,
        }
        self._memory_blocked: RequestHandle | None = None
        self._prefix_reset = False

    @staticmethod
    def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(model, "generation_config", None), model.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return ids

    # ------------------------------------------------------------------ public API

    def start(self) -> GenerationEngine:
        """Start the scheduler thread."""
        self._thread.start()
        return self

    def warmup(self) -> float:
        """Run a few throw-away steps so the first request does not pay for kernel setup.

        oneDNN builds its bf16 kernels on first use, which otherwise makes the first requests
        several times slower. Call before :meth:`start`; returns the seconds spent.
        """
        outcome: list[float | BaseException] = []

        def work() -> None:
            torch.set_num_threads(self.threads)
            try:
                outcome.append(self._warmup())
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                outcome.append(exc)

        # On a thread of its own that ends afterwards, with the scheduler's thread count: oneDNN
        # keys its kernels by thread count, and the thread's OpenMP pool goes away with it.
        thread = threading.Thread(target=work, name="atropos-warmup")
        thread.start()
        thread.join()
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def _warmup(self) -> float:
        started = time.monotonic()
        with torch.inference_mode():
            for batch in (1, 4):
                ids = torch.full((batch, 16), self.tokenizer.eos_token_id or 0, dtype=torch.long)
                out = self.model(
                    input_ids=ids.to(self.device),
                    **cache_kwargs(self.model, DynamicCache()),
                    use_cache=True,
                    logits_to_keep=1,
                )
                mask = torch.ones((batch, 16), dtype=torch.long, device=self.device)
                if self._use_grouped([GROUPED_MIN_SAMPLES] * batch):
                    layers = [(x.keys, x.values) for x in output_cache(out).layers]
                    grouped = fastpath.GroupedBatch.from_prefill(
                        layers, mask, [GROUPED_MIN_SAMPLES] * batch
                    )
                    step = ids.new_full((grouped.rows, 1), int(ids[0, 0])).to(self.device)
                    for _ in range(3):
                        self._fast.decode_grouped(step, grouped)
                cache = self._fast.batch_cache(output_cache(out))
                for _ in range(3):
                    # The same call as the scheduler's decode step, so that with ``compile``
                    # every graph it needs (batch 1, and any batch >1) is built here.
                    mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
                    out = self._decode_model(
                        # A fresh (batch, 1) tensor like the scheduler's: a column view of
                        # ``ids`` has other strides, which compiled graphs guard on.
                        input_ids=ids.new_full((batch, 1), int(ids[0, 0])).to(self.device),
                        attention_mask=mask,
                        position_ids=mask.sum(dim=1, keepdim=True) - 1,
                        **cache_kwargs(self.model, cache),
                        use_cache=True,
                        logits_to_keep=1,
                    )
                    cache = output_cache(out)
        return time.monotonic() - started

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the scheduler; pending and running requests fail with 503."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def decode_path(self) -> str:
        """How decode steps run now: ``"lean"`` (the fast path's lean decode step),
        ``"compiled"`` (``compile``) or ``"transformers"`` (the model's own forward pass)."""
        if self.compiled:
            return "compiled"
        return self._fast.decode_path

    @property
    def healthy(self) -> bool:
        """True while the scheduler thread runs and accepts work."""
        return self._thread.is_alive() and not self._stopped and self._failure is None

    PAUSE_MODES = ("abort", "wait", "keep")

    def pause(self, mode: str = "abort") -> concurrent.futures.Future[float]:
        """Stop generating until :meth:`resume`, as vLLM's ``pause_generation`` does.

        Requests that arrive meanwhile wait in the queue. ``mode`` says what happens to those
        already generating: ``abort`` ends them now with ``finish_reason`` "abort" and the
        tokens so far (requests still waiting are aborted too); ``wait`` lets them finish
        first; ``keep`` freezes them where they are, and they continue after :meth:`resume`
        (on the new weights, if a reload happened meanwhile; their earlier tokens keep their
        key/value cache). The future resolves, with the seconds it took, once nothing runs.
        """
        if mode not in self.PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(self.PAUSE_MODES)}, not {mode!r}")
        future: concurrent.futures.Future[float] = concurrent.futures.Future()
        with self._cond:
            if self._pause_mode is None or not self._paused:
                self._pause_started = time.monotonic()
            if self._paused and mode != "abort":
                future.set_result(0.0)
                return future
            self._pause_mode = mode
            self._paused = False
            if mode == "abort":
                for seq in self._running:
                    seq.handle.abort()
                for handle in self._waiting:
                    handle.abort()
            self._pause_futures.append(future)
            self._cond.notify()
        return future

    def resume(self) -> bool:
        """Generate again after :meth:`pause`; returns whether the engine was paused."""
        with self._cond:
            was = self._pause_mode is not None
            self._pause_mode, self._paused = None, False
            for future in self._pause_futures:  # a pause still draining ends unfulfilled
                if not future.done():
                    future.set_result(time.monotonic() - self._pause_started)
            self._pause_futures = []
            self._cond.notify()
        return was

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt prefixes (vLLM's ``reset_prefix_cache``), before the next
        prefill; the weights changing does this by itself."""
        with self._cond:
            self._prefix_reset = True

    @property
    def paused(self) -> bool:
        """True between :meth:`pause` taking effect and :meth:`resume`."""
        with self._cond:
            return self._paused

    def _has_work(self) -> bool:
        if self._stopped or self._pending_reload is not None:
            return True
        if self._pause_mode is not None:
            return not self._paused  # still getting to the pause
        return bool(self._waiting or self._running)

    def load(self) -> dict[str, int]:
        """Sequences running and requests waiting right now."""
        with self._cond:
            return {"running": len(self._running), "waiting": len(self._waiting)}

    def cache_bytes(self, rows: int, tokens: int) -> int:
        """Most bytes the key/value cache of ``rows`` sequences of up to ``tokens`` tokens each
        can hold: the batch is one left-padded tensor per layer, as wide as its longest row,
        grown with :data:`~atroposlib.inference.fastpath.attention.HEADROOM` spare positions,
        and briefly held twice while it grows or takes new rows (a copy is made). The grouped
        layout (:meth:`_use_grouped`: each prompt once, in float32; generated tokens per row in
        the model's dtype) holds no more than this for requests of two or more samples. A
        single-sample request that joins a grouped batch holds its prompt in float32: in a
        bfloat16 model up to twice the prompt's share of this figure (not counted)."""
        return 2 * rows * (tokens + HEADROOM) * self.kv_bytes_per_token

    @staticmethod
    def _reserved(handle: RequestHandle) -> int:
        return len(handle.prompt_ids) + handle.params.max_tokens

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, stream: bool = False
    ) -> RequestHandle:
        """Queue a request; call from the event loop that will consume the handle.

        Raises ``ValueError`` (:class:`InvalidParamError`, naming the field, for a parameter out
        of range or a token id outside the vocabulary) or a prompt that does not fit the context,
        :class:`QueueFullError` when the queue is full and :class:`EngineUnavailableError` when
        the engine is not running.
        """
        vocab = self.model.config.vocab_size
        params.validate(max_n=self.max_batch, max_logprobs=self.max_logprobs, vocab_size=vocab)
        if not prompt_ids:
            raise InvalidParamError("prompt", "the prompt is empty")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidParamError("prompt", f"prompt token ids must be in [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {total} tokens ({len(prompt_ids)} in the messages, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion."
            )
        if self.cache_memory is not None:
            need = self.cache_bytes(params.n, total)
            if need > self.cache_memory:
                mib = 1 << 20
                raise MemoryBudgetError(
                    f"this request needs up to {need / mib:.1f} MiB of key/value cache (n="
                    f"{params.n} samples x {total} tokens, prompt + max_tokens, x "
                    f"{self.kv_bytes_per_token} bytes per token, x2 while the cache grows), "
                    f"more than the server's whole budget of {self.cache_memory / mib:.1f} "
                    "MiB (atropos-serve --max-cache-memory): ask for fewer samples (n) or "
                    "fewer max_tokens, or raise the budget",
                    param="n" if params.n > 1 else "max_tokens",
                )
        handle = RequestHandle(self, prompt_ids, params, stream, asyncio.get_running_loop())
        with self._cond:
            if not self.healthy:
                raise EngineUnavailableError(
                    f"the generation engine is not running ({self._failure or 'stopped'})"
                )
            if len(self._waiting) >= self.max_waiting:
                raise QueueFullError(
                    f"server overloaded: {len(self._waiting)} requests are already waiting"
                )
            self._waiting.append(handle)
            self._cond.notify()
        return handle

    def prepare_model(self, model: PreTrainedModel) -> PreTrainedModel:
        """Get a model ready to be swapped in: on the engine's device, in eval mode, with the
        engine's fast path (:func:`~atroposlib.inference.fastpath.prepare`). Done once per
        model (it takes about as long as copying the weights); :meth:`request_reload` calls it
        if nobody did, so a caller may run it beforehand on a loader thread, off the event
        loop."""
        self._prepare(model)
        return model

    def _prepare(self, model: PreTrainedModel) -> fastpath.PreparedModel:
        # the packed and fused weight copies live as long as the model (see load_weights)
        with mapped_allocations():
            model.to(self.device)
            model.eval()
            return fastpath.prepare(model, self._fast_options)

    def request_reload(
        self, model: PreTrainedModel, *, keep_outgoing: bool = False
    ) -> concurrent.futures.Future[ReloadInfo]:
        """Swap in ``model`` once the sequences in flight have finished on the old weights.

        New requests wait (they are not rejected) while the old batch drains; the returned
        future resolves when the new weights serve requests.
        """
        if model.config.vocab_size != self.model.config.vocab_size:
            raise ValueError(
                f"the new checkpoint has vocab size {model.config.vocab_size}, the served model "
                f"{self.model.config.vocab_size}: the tokenizer would not match"
            )
        future: concurrent.futures.Future[ReloadInfo] = concurrent.futures.Future()
        # Outside the lock: the scheduler keeps decoding on the old weights meanwhile.
        prepared = self._prepare(model)
        with self._cond:
            if self._pending_reload is not None:
                raise RuntimeError("a weight reload is already in progress")
            self._pending_reload = (prepared, future, time.time())
            self._keep_outgoing = keep_outgoing
            self._drain_started = time.monotonic()
            self._cond.notify()
        return future

    def check_update(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` naming the first weight of ``tensors`` that does not fit the
        served model (unknown name, other shape, or a parameter it leaves out that is not tied
        to one it gives)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        given: set[int] = set()
        for name, tensor in tensors.items():
            param = params.get(name)
            if param is None:
                raise ValueError(f"the served model has no parameter {name!r}")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)}, the served model's is "
                    f"{tuple(param.shape)}"
                )
            given.add(param.data_ptr())
        missing = [n for n, p in params.items() if n not in tensors and p.data_ptr() not in given]
        if missing:
            raise ValueError(
                f"{len(missing)} parameters of the served model are missing, e.g. {missing[0]!r}"
            )

    def request_update(
        self, tensors: dict[str, torch.Tensor]
    ) -> concurrent.futures.Future[ReloadInfo]:
        """Copy ``tensors`` (parameter name -> new value, any dtype: converted to the served
        one) into the served model in place, once the sequences in flight have finished on the
        old weights (as :meth:`request_reload`); then the fast path's packed copies are rebuilt.

        Parameters tied to one in ``tensors`` (an LM head sharing the embeddings) follow it.
        ``ValueError`` (nothing changed) when the names or shapes do not fit
        (:meth:`check_update`).
        """
        self.check_update(tensors)
        future: concurrent.futures.Future[ReloadInfo] = concurrent.futures.Future()
        with self._cond:
            if self._pending_reload is not None:
                raise RuntimeError("a weight reload is already in progress")
            self._pending_reload = (_InPlaceUpdate(tensors), future, time.time())
            self._drain_started = time.monotonic()
            self._cond.notify()
        return future

    def _copy_in_place(self, update: _InPlaceUpdate) -> tuple[float, float]:
        started = time.monotonic()
        with torch.inference_mode(False):
            copy_weights(self.model, update.tensors)
        copied = time.monotonic()
        if not self.compiled:
            # compiled graphs read the parameters themselves; the eager fast path's packed
            # copies and fused projections are rebuilt from the new values
            self._fast = fastpath.refresh(self._fast)
        return copied - started, time.monotonic() - copied

    # ------------------------------------------------------------------ scheduler

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        with torch.inference_mode():
            while True:
                with self._cond:
                    if not self._has_work():
                        # idle for a while: the heap's free pages (last steps' temporaries,
                        # when use_heap_for_temporaries is on) go back to the system
                        if not self._cond.wait(timeout=self.idle_trim_seconds):
                            release_free_memory()
                    while not self._has_work():
                        self._cond.wait()
                    if self._stopped:
                        break
                    self._swap_weights_if_drained()
                    if self._prefix_reset:
                        self.prefix_cache.clear()
                        self._prefix_reset = False
                    admitted = self._admit()
                    mode = self._pause_mode
                try:
                    if admitted:
                        self._prefill(admitted)
                    if self._running and mode in (None, "wait"):
                        self._decode_step()
                    elif self._running and mode == "abort":
                        # Rows admitted while the pause was being asked for (prefilled outside
                        # the lock) are aborted here too, then every aborted row leaves.
                        for seq in self._running:
                            seq.handle.abort()
                        self._retire_finished()
                except Exception as exc:  # noqa: BLE001 - reported to every affected request
                    logger.exception("generation step failed")
                    self._fail_batch(exc, admitted)
                with self._cond:
                    if self._pause_mode is not None and not self._paused:
                        if self._pause_mode == "keep" or not self._running:
                            self._paused = True
                            took = time.monotonic() - self._pause_started
                            for future in self._pause_futures:
                                if not future.done():
                                    future.set_result(took)
                            self._pause_futures = []
        self._fail_everything(EngineUnavailableError("the generation engine stopped"))

    def _swap_weights_if_drained(self) -> None:
        # Rows frozen by a "keep" pause do not block a reload: they continue on the new weights.
        if self._pending_reload is None or (self._running and self._pause_mode != "keep"):
            return
        prepared, future, requested_at = self._pending_reload
        drained = time.monotonic() - (self._drain_started or time.monotonic())
        copy_seconds = prepare_seconds = 0.0
        kept = None
        if isinstance(prepared, _InPlaceUpdate):
            try:
                copy_seconds, prepare_seconds = self._copy_in_place(prepared)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                self._pending_reload = None
                future.set_exception(exc)
                return
        elif self.compiled:
            model = prepared.model
            # Copy the weights into the compiled module in place: its graphs stay valid, so a
            # reload costs a copy, not another compilation.
            with torch.inference_mode(False), torch.no_grad():
                self.model.load_state_dict(model.state_dict())
            release_model(model)
        else:
            # request_reload prepared its fast path.
            model = prepared.model
            outgoing = self.model
            self.model = self._decode_model = model
            self._fast = prepared
            release_model(outgoing)
            if self._keep_outgoing:
                kept = outgoing
        self.weights_version += 1
        self.prefix_cache.clear()  # its keys and values came from the old weights
        self._pending_reload = None
        info = ReloadInfo(
            weights_version=self.weights_version,
            requested_at=requested_at,
            live_at=time.time(),
            drain_seconds=drained,
            copy_seconds=copy_seconds,
            prepare_seconds=prepare_seconds,
            outgoing=kept,
        )
        future.set_result(info)

    def _admit(self) -> list[RequestHandle]:
        """Pop the waiting requests that fit into the batch now (FIFO, under the lock)."""
        if any(h.aborted for h in self._waiting):
            for handle in [h for h in self._waiting if h.aborted]:
                self._waiting.remove(handle)
                self._finish_aborted(handle)
        if self._pending_reload is not None or self._pause_mode is not None:
            return []
        admitted: list[RequestHandle] = []
        free = self.max_batch - len(self._running)
        budget = self.prefill_token_budget
        # the cache budget: rows and the widest reservation (prompt + max_tokens) so far
        rows = len(self._running)
        width = max((self._reserved(s.handle) for s in self._running), default=0)
        while self._waiting:
            head = self._waiting[0]
            if head.aborted:
                self._finish_aborted(self._waiting.popleft())
                continue
            if head.params.n > free:
                break
            if admitted and len(head.prompt_ids) > budget:
                break
            if self.cache_memory is not None:
                new_rows = rows + head.params.n
                new_width = max(width, self._reserved(head))
                if self.cache_bytes(new_rows, new_width) > self.cache_memory:
                    if self._memory_blocked is not head:  # counted once per request
                        self._memory_blocked = head
                        self.stats["memory_waits"] += 1
                    break  # it waits (FIFO) until running rows finish and free their cache
                rows, width = new_rows, new_width
            admitted.append(self._waiting.popleft())
            free -= head.params.n
            budget -= len(head.prompt_ids)
        return admitted

    def _finish_aborted(self, handle: RequestHandle) -> None:
        for out in handle.outputs:
            out.finish_reason = out.finish_reason or "abort"
        handle._put(None)

    def _prefill(self, handles: list[RequestHandle]) -> None:
        """Run the prompts of ``handles`` and merge their samples into the running batch."""
        # Prompt log-probs need logits at every position: such prompts get a pass of their own
        # so ordinary prompts keep computing only the last position's logits. Ordinary prompts
        # of very different lengths are split into passes of similar lengths
        # (:meth:`_length_buckets`), so that few padding positions are computed.
        plain = [h for h in handles if h.params.prompt_logprobs is None]
        groups = self._length_buckets(plain) if plain else []
        groups += [[h] for h in handles if h.params.prompt_logprobs is not None]
        parts: list[_Prefilled] = []
        for group in groups:
            parts += self._prefill_isolated(group)
        if not parts:
            return
        # Engine-wide from here on: a failure fails the batch (see _run). The passes join the
        # running batch together, so its cache is copied once, not once per pass.
        cache, mask, samples, sequences, tokens, raw_logprobs = self._combine(parts)
        self._merge(cache, mask.to(self.device), samples, sequences)
        self._record_tokens(sequences, tokens, raw_logprobs)
        self._retire_finished()

    def _length_buckets(self, handles: list[RequestHandle]) -> list[list[RequestHandle]]:
        """``handles`` in prefill passes: one pass, unless the left padding to the longest
        prompt would be more than :data:`PREFILL_PADDING_SLACK` of the positions computed
        (and more than :data:`PREFILL_PADDING_MIN` positions); then passes of prompts of
        similar lengths, shortest first.

        Prompts of 74-186 tokens (the GSM8K test questions), prefilled ~18 at a time, were a
        quarter padding (12% split this way, ``bench/engine_prefill_split.py``); every padding
        position costs a whole position's multiplies."""
        lengths = [len(h.prompt_ids) for h in handles]
        if (
            not self.split_prefill_by_length
            or len(handles) < 2
            or not self._too_much_padding(len(lengths), max(lengths), sum(lengths))
        ):
            return [handles]
        buckets: list[list[RequestHandle]] = []
        current: list[RequestHandle] = []
        real = 0
        for handle in sorted(handles, key=lambda h: len(h.prompt_ids)):
            n = len(handle.prompt_ids)  # the longest so far: the bucket is padded to it
            if current and self._too_much_padding(len(current) + 1, n, real + n):
                buckets.append(current)
                current, real = [], 0
            current.append(handle)
            real += n
        buckets.append(current)
        return buckets

    @staticmethod
    def _too_much_padding(prompts: int, longest: int, tokens: int) -> bool:
        """Whether ``prompts`` prompts of ``tokens`` tokens in all, padded to the ``longest``,
        would pad too much in one pass."""
        padded = prompts * longest
        padding = padded - tokens
        return padding > PREFILL_PADDING_MIN and padding > PREFILL_PADDING_SLACK * padded

    def _combine(self, parts: list[_Prefilled]) -> _Prefilled:
        """Prefill passes as one: their caches stacked (each right-aligned to the widest, zeros
        masked on the left), their masks widened alike, their rows in order."""
        if len(parts) == 1:
            return parts[0]
        width = max(part[1].shape[1] for part in parts)
        layers = []
        for per_part in zip(*(part[0].layers for part in parts), strict=True):
            keys = stack_right_aligned([x.keys for x in per_part], width, spare=0)
            values = stack_right_aligned([x.values for x in per_part], width, spare=0)
            layers.append((keys, values))
        masks = [F.pad(part[1], [width - part[1].shape[1], 0]) for part in parts]
        return (
            self._fast.prefill_cache(layers),
            torch.cat(masks, dim=0),
            [n for part in parts for n in part[2]],
            [seq for part in parts for seq in part[3]],
            torch.cat([part[4] for part in parts], dim=0),
            torch.cat([part[5] for part in parts], dim=0),
        )

    def _prefill_isolated(self, handles: list[RequestHandle]) -> list[_Prefilled]:
        """Prefill ``handles`` together; if that fails, one by one, so a request that cannot be
        prefilled or sampled fails alone and the others join the batch. Returns the passes
        that ran."""
        try:
            return [self._prefill_rows(handles)]
        except Exception as exc:  # noqa: BLE001 - reported to the request(s) concerned
            if len(handles) > 1:
                logger.warning(
                    "prefill of %d prompts failed (%s: %s); prefilling them one by one",
                    len(handles),
                    type(exc).__name__,
                    exc,
                )
                parts: list[_Prefilled] = []
                for handle in handles:
                    parts += self._prefill_isolated([handle])
                return parts
            self._fail_request(handles[0], exc)
            handles[0]._put(handles[0].error)
            return []

    def _fail_request(self, handle: RequestHandle, exc: BaseException) -> None:
        """Fail one request: its samples end, its rows leave the batch at the next
        :meth:`_retire_finished`, which hands its client the error instead of the outputs."""
        if handle.error is None:
            logger.warning(
                "request %s failed: %s: %s", handle.id, type(exc).__name__, exc, exc_info=exc
            )
            handle.error = EngineError(
                f"generation failed for this request: {type(exc).__name__}: {exc}"
            )
        handle.aborted = True
        for out in handle.outputs:
            out.finish_reason = out.finish_reason or "abort"

    def _sample(
        self, logits: torch.Tensor, sequences: list[_Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`sample_next` for the batch; should it fail, row by row, failing only the
        requests whose rows cannot be sampled (their token is a placeholder 0, never used)."""
        try:
            return sample_next(
                logits, [s.row for s in sequences], processed=self.processed_logprobs
            )
        except Exception as exc:  # noqa: BLE001 - narrowed down to the rows concerned below
            logger.warning("sampling the batch failed (%s); sampling row by row", exc)
        tokens = torch.zeros(len(sequences), dtype=torch.long)
        logprobs = torch.zeros(logits.shape, dtype=torch.float32)
        for i, seq in enumerate(sequences):
            if seq.handle.aborted:
                continue
            try:
                token, row_logprobs = sample_next(
                    logits[i : i + 1], [seq.row], processed=self.processed_logprobs
                )
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                self._fail_request(seq.handle, exc)
                continue
            tokens[i], logprobs[i] = token[0], row_logprobs[0]
        return tokens, logprobs

    def _shared_prefix_len(self, handles: list[RequestHandle]) -> int:
        """Length of the token prefix to run once for all of ``handles`` (a system prompt,
        few-shot examples), leaving each prompt at least one token of its own; 0 when sharing
        is not worth it. Several prompts: the beginning they all share. One prompt: the
        beginning it shares with a cached prefix or a recent prompt, so that it is kept for
        the next ones (:class:`~atroposlib.inference.prefix_cache.PrefixCache`)."""
        if handles[0].params.prompt_logprobs is not None:
            return 0
        first = handles[0].prompt_ids
        shared = min(len(h.prompt_ids) for h in handles) - 1
        for handle in handles[1:]:
            shared = common_prefix_len(first, handle.prompt_ids, shared)
            if shared < self.min_shared_prefix:
                return 0
        if len(handles) == 1:
            shared = self.prefix_cache.known_length(first, shared)
        return shared if shared >= self.min_shared_prefix else 0

    def _prefix_cache(self, prompt: list[int], shared: int) -> DynamicCache:
        """A batch-of-one cache holding the keys and values of ``prompt[:shared]``: what the
        prefix cache has of it, the rest computed now (and then kept for later prompts)."""
        reused, layers = self.prefix_cache.lookup(prompt, shared)
        cache = self._fast.prefill_cache(layers) if layers is not None else self._fast.new_cache()
        if reused:
            self.stats["prefix_cache_hits"] += 1
            self.stats["prefix_cache_tokens_reused"] += reused
        if shared > reused:
            prefix = torch.tensor([prompt[reused:shared]], dtype=torch.long)
            self.model(
                input_ids=prefix.to(self.device),
                **cache_kwargs(self.model, cache),
                use_cache=True,
                logits_to_keep=1,
            )
            if self.prefix_cache.enabled:
                self.prefix_cache.store(
                    prompt[:shared],
                    [
                        (x.keys[:, :, :shared].clone(), x.values[:, :, :shared].clone())
                        for x in cache.layers
                    ],
                )
        return cache

    def _prefill_rows(self, handles: list[RequestHandle]) -> _Prefilled:
        """Prefill ``handles`` and sample their first tokens, without touching the running
        batch: returns the prompts' cache and mask (a row per prompt), the number of samples
        of each prompt, and the new rows' sequences, tokens and log-probs to merge."""
        # A prefix common to every prompt is run once (or taken from the prefix cache) and its
        # KV cache shared by all rows: the rows then hold [prefix | padding | own suffix],
        # which the attention mask and explicit positions make exact (padding columns are
        # masked out, positions skip them).
        shared = self._shared_prefix_len(handles)
        cache = self._fast.new_cache()
        prefix_mask = torch.ones((len(handles), shared), dtype=torch.long)
        if shared:
            cache = self._prefix_cache(handles[0].prompt_ids, shared)
            cache.batch_repeat_interleave(len(handles))
            self.stats["shared_prefix_tokens_saved"] += shared * (len(handles) - 1)
        for handle in handles:
            if handle.params.prompt_logprobs is None:
                self.prefix_cache.remember(handle.prompt_ids)
        width = max(len(h.prompt_ids) for h in handles) - shared
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = next(iter(self.eos_ids), 0)
        input_ids = torch.full((len(handles), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(handles), width), dtype=torch.long)
        for row, handle in enumerate(handles):
            length = len(handle.prompt_ids) - shared
            input_ids[row, width - length :] = torch.tensor(handle.prompt_ids[shared:])
            mask[row, width - length :] = 1
            handle.weights_version = self.weights_version
        positions = (shared + mask.cumsum(dim=1) - 1).clamp(min=0)
        self.stats["prefill_passes"] += 1
        self.stats["prefill_padding_tokens"] += int(mask.numel() - mask.sum())
        mask = torch.cat([prefix_mask, mask], dim=1)
        want_prompt = handles[0].params.prompt_logprobs is not None
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            **cache_kwargs(self.model, cache),
            use_cache=True,
            logits_to_keep=0 if want_prompt else 1,
        )
        logits = out.logits[:, -1, :].float().cpu()
        if want_prompt:
            self._record_prompt_logprobs(handles[0], out.logits[0].float().cpu())

        rows = [r for r, h in enumerate(handles) for _ in range(h.params.n)]
        index = torch.tensor(rows, dtype=torch.long)
        cache: DynamicCache = output_cache(out)
        sequences = [
            _Sequence(h, i, set() if h.params.ignore_eos else self.eos_ids)
            for h in handles
            for i in range(h.params.n)
        ]
        tokens, raw_logprobs = self._sample(logits[index], sequences)
        self.stats["prompt_tokens"] += sum(len(h.prompt_ids) for h in handles)
        self.stats["requests"] += len(handles)
        return cache, mask, [h.params.n for h in handles], sequences, tokens, raw_logprobs

    def _record_prompt_logprobs(self, handle: RequestHandle, logits: torch.Tensor) -> None:
        """vLLM's ``prompt_logprobs``: None for the first token, then {id: logprob} per token
        with the actual prompt token first and the top-k after it."""
        k = handle.params.prompt_logprobs or 0
        prompt = handle.prompt_ids
        logprobs = torch.log_softmax(logits[-len(prompt) : -1], dim=-1)
        targets = torch.tensor(prompt[1:], dtype=torch.long)
        actual = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        result: list[dict[int, float] | None] = [None]
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        for pos, token in enumerate(prompt[1:]):
            entry = {token: actual[pos]}
            if top_ids is not None:
                for tid, val in zip(top_ids[pos].tolist(), top_vals[pos].tolist(), strict=True):
                    entry.setdefault(tid, val)
            result.append(entry)
        handle.prompt_logprobs = result

    def _use_grouped(self, samples: list[int]) -> bool:
        """Whether a batch that starts with requests of ``samples`` samples each keeps every
        prompt's keys and values once (:class:`~atroposlib.inference.fastpath.GroupedBatch`)
        rather than once per row. It pays where requests have several samples (an RL group
        of 16 reads its prompt once per decode step instead of 16 times: ~1.2x faster steps
        at 12 such requests, and no copying of prompts into and out of the batch); with one
        sample per request there is nothing to share and its extra operations cost ~10%."""
        return (
            self.share_prompt_kv
            and self._fast.grouped
            and sum(samples) >= GROUPED_MIN_SAMPLES * len(samples)
        )

    def _merge(
        self,
        cache: DynamicCache,
        mask: torch.Tensor,
        samples: list[int],
        sequences: list[_Sequence],
    ) -> None:
        """Append the rows of new prompts (``samples[i]`` rows for prompt ``i`` of ``cache``
        and ``mask``) to the running batch, in the batch's layout."""
        if not self._running:
            self._grouped = self._cache = self._mask = None
        grouped = self._grouped is not None if self._running else self._use_grouped(samples)
        if grouped:
            part = fastpath.GroupedBatch.from_prefill(
                [(x.keys, x.values) for x in cache.layers], mask, samples
            )
            if self._grouped is None:
                self._grouped, self._running = part, sequences
            else:
                self._grouped.merge(part)
                self._running = self._running + sequences
            return
        index = torch.repeat_interleave(
            torch.arange(len(samples), device=mask.device),
            torch.tensor(samples, device=mask.device),
        )
        cache.batch_select_indices(index.to(self.device))
        mask = mask[index]
        if self._cache is None or not self._running:
            self._cache = self._fast.batch_cache(cache)
            self._mask, self._running = mask, sequences
            return
        width = max(self._mask.shape[1], mask.shape[1])

        def widen(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            missing = width - t.shape[-dim_from_end]
            if missing == 0:
                return t
            pad = [0, 0] * (dim_from_end - 1) + [missing, 0]
            return F.pad(t, pad)

        if self._fast.append_cache:  # both parts copied once, straight into the new buffers
            parts = [[(x.keys, x.values) for x in c.layers] for c in (self._cache, cache)]
            self._cache = stacked_append_cache(parts, width)
        else:
            layers = []
            for old, new in zip(self._cache.layers, cache.layers, strict=True):
                keys = torch.cat([widen(old.keys, 2), widen(new.keys, 2)], dim=0)
                values = torch.cat([widen(old.values, 2), widen(new.values, 2)], dim=0)
                layers.append((keys, values))
            self._cache = self._fast.batch_cache(layers)
        self._mask = torch.cat([widen(self._mask, 1), widen(mask, 1)], dim=0)
        self._running = self._running + sequences

    def _decode_step(self) -> None:
        """Feed every running sequence its last token and sample the next one."""
        batch = len(self._running)
        input_ids = torch.tensor([[s.out.token_ids[-1]] for s in self._running], dtype=torch.long)
        if self._grouped is not None:
            logits = self._fast.decode_grouped(input_ids.to(self.device), self._grouped)
            if logits is not None:
                self.stats["grouped_steps"] += 1
                self._sampled(logits.float().cpu())
                return
            # The lean step cannot run the current weights (e.g. a model it does not know was
            # swapped in under a "keep" pause): on in the per-row layout the model reads.
            layers, grouped_mask = self._grouped.to_padded(self.model.dtype)
            self._cache = self._fast.batch_cache(layers)
            self._mask, self._grouped = grouped_mask.to(self.device), None
        assert self._cache is not None and self._mask is not None
        mask = torch.cat([self._mask, self._mask.new_ones((batch, 1))], dim=1)
        positions = mask.sum(dim=1, keepdim=True) - 1
        fast = self._fast.decode(input_ids.to(self.device), mask, positions, self._cache)
        if fast is not None:
            logits = fast.float().cpu()
        else:
            out = self._decode_model(
                input_ids=input_ids.to(self.device),
                attention_mask=mask,
                position_ids=positions,
                **cache_kwargs(self.model, self._cache),
                use_cache=True,
                logits_to_keep=1,
            )
            self._cache = output_cache(out)
            logits = out.logits[:, -1, :].float().cpu()
        self._mask = mask
        self._sampled(logits)

    def _sampled(self, logits: torch.Tensor) -> None:
        """Sample every running row's next token from ``logits`` and record it."""
        tokens, raw_logprobs = self._sample(logits, self._running)
        self.stats["steps"] += 1
        self._record_tokens(self._running, tokens, raw_logprobs)
        self._retire_finished()

    def _record_tokens(
        self, sequences: list[_Sequence], tokens: torch.Tensor, raw_logprobs: torch.Tensor
    ) -> None:
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        token_list = tokens.tolist()
        k_max = max((s.params.logprobs or 0) for s in sequences)
        top_ids = top_vals = None
        if k_max:
            top_vals_t, top_ids_t = raw_logprobs.topk(k_max, dim=-1)
            top_ids, top_vals = top_ids_t.tolist(), top_vals_t.tolist()
        self.stats["generated_tokens"] += len(sequences)
        for i, seq in enumerate(sequences):
            if seq.handle.aborted:
                seq.out.finish_reason = "abort"
                continue
            try:
                seq.out.token_ids.append(token_list[i])
                seq.out.logprobs.append(chosen[i])
                k = seq.params.logprobs or 0
                if k and top_ids is not None and top_vals is not None:
                    top = zip(top_ids[i][:k], top_vals[i][:k], strict=True)
                    seq.out.top_logprobs.append(list(top))
                self._check_stop(seq)
                if seq.handle.stream or seq.finished:
                    self._emit(seq)
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                self._fail_request(seq.handle, exc)

    def _check_stop(self, seq: _Sequence) -> None:
        params, out = seq.params, seq.out
        token = out.token_ids[-1]
        min_ok = len(out.token_ids) >= params.min_tokens
        ends_on_token = False
        if min_ok and token in seq.stop_ids:
            out.finish_reason, out.stop_reason, ends_on_token = "stop", None, True
        elif min_ok and token in params.stop_token_ids:
            out.finish_reason, out.stop_reason, ends_on_token = "stop", token, True
        if not ends_on_token:
            self._detokenize(seq)
        if params.stop and not out.finish_reason and min_ok:
            start = max(0, seq.checked_chars - seq.max_stop_len + 1)
            hits = [(out.text.find(s, start), s) for s in params.stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, stop = min(hits)
                end = pos + len(stop) if params.include_stop_str_in_output else pos
                out.text = out.text[:end]
                out.finish_reason, out.stop_reason = "stop", stop
            seq.checked_chars = len(out.text)
        if not out.finish_reason and len(out.token_ids) >= params.max_tokens:
            out.finish_reason = "length"
        if out.finish_reason and not isinstance(out.stop_reason, str):
            # The final text is one full decode, so it is exactly what the tokenizer gives for
            # the ids. The stop token itself is not part of the text unless asked for (vLLM).
            text_ids = out.token_ids
            if ends_on_token and not params.include_stop_str_in_output:
                text_ids = out.token_ids[:-1]
            out.text = self.tokenizer.decode(
                text_ids, skip_special_tokens=params.skip_special_tokens
            )

    def _detokenize(self, seq: _Sequence) -> None:
        """Extend ``seq.out.text`` by the characters the newest token completes."""
        ids, skip = seq.out.token_ids, seq.params.skip_special_tokens
        prefix = self.tokenizer.decode(
            ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip
        )
        window = self.tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
        # A trailing U+FFFD is an incomplete UTF-8 character: wait for the next token.
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            seq.out.text += window[len(prefix) :]
            seq.prefix_offset = seq.read_offset
            seq.read_offset = len(ids)

    def _emit(self, seq: _Sequence) -> None:
        """Send the sample's new tokens and the text that can no longer change."""
        out = seq.out
        text_end = len(out.text)
        if not seq.finished:
            # Hold back what could still turn out to be the start of a stop string, and a
            # trailing partial UTF-8 character that the next token completes.
            text_end -= max(seq.max_stop_len - 1, 0)
            while text_end > seq.emitted_chars and out.text[text_end - 1] == "\ufffd":
                text_end -= 1
        text_end = max(text_end, seq.emitted_chars)
        new_tokens = slice(seq.emitted_tokens, len(out.token_ids))
        event = StreamEvent(
            index=out.index,
            token_ids=out.token_ids[new_tokens],
            logprobs=out.logprobs[new_tokens],
            top_logprobs=out.top_logprobs[new_tokens],
            text=out.text[seq.emitted_chars : text_end],
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        seq.emitted_tokens = len(out.token_ids)
        seq.emitted_chars = text_end
        if seq.handle.stream:
            seq.handle._put(event)

    def _retire_finished(self) -> None:
        """Drop finished rows from the batch and close requests whose samples are all done."""
        for seq in self._running:
            if seq.handle.aborted and not seq.finished:
                seq.out.finish_reason = "abort"
        keep = [i for i, s in enumerate(self._running) if not s.finished]
        if len(keep) == len(self._running):
            return
        done = {id(s.handle): s.handle for s in self._running if s.finished}
        if not keep:
            self._cache, self._mask, self._running = None, None, []
            self._grouped = None
        elif self._grouped is not None:
            self._grouped.keep(torch.tensor(keep, dtype=torch.long))
            self._running = [self._running[i] for i in keep]
        else:
            assert self._cache is not None and self._mask is not None
            index = torch.tensor(keep, dtype=torch.long, device=self._mask.device)
            mask = self._mask[index]
            # Columns of padding that no remaining row needs are cut off the left edge.
            leading = int((mask.cumsum(dim=1) == 0).sum(dim=1).min())
            if self._fast.append_cache:  # selected and trimmed in one copy
                select_rows(self._cache, index.to(self.device), leading)
            else:
                self._cache.batch_select_indices(index)
                for layer in self._cache.layers if leading else ():
                    # Contiguous so that ``--compile`` graphs (which guard on strides) are reused.
                    layer.keys = layer.keys[:, :, leading:, :].contiguous()
                    layer.values = layer.values[:, :, leading:, :].contiguous()
            self._mask = mask[:, leading:]
            self._running = [self._running[i] for i in keep]
        still_running = {id(s.handle) for s in self._running}
        for key, handle in done.items():
            if key not in still_running and handle.finished:
                handle._put(handle.error)

    def _fail_batch(self, exc: BaseException, admitted: list[RequestHandle]) -> None:
        handles = {id(s.handle): s.handle for s in self._running}
        handles.update({id(h): h for h in admitted})
        self._cache, self._mask, self._running = None, None, []
        self._grouped = None
        error = EngineError(f"generation failed: {type(exc).__name__}: {exc}")
        for handle in handles.values():
            for out in handle.outputs:
                out.finish_reason = out.finish_reason or "abort"
            handle._put(error)

    def _fail_everything(self, exc: BaseException) -> None:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
            pending = self._pending_reload
            self._pending_reload = None
        self._fail_batch(exc, waiting)
        if pending is not None:
            pending[1].set_exception(exc)
