"""The CPU fast path of ``atropos-serve``'s generation engine, behind one entry point.

:func:`prepare` gets a Hugging Face causal LM ready for the engine's decode loop and returns a
:class:`PreparedModel` that the engine asks for everything the fast path changes: the KV cache
it decodes into (:meth:`PreparedModel.new_cache`, :meth:`PreparedModel.batch_cache`) and the
decode step itself (:meth:`PreparedModel.decode`, None where the model's own forward pass
runs). :func:`release` undoes it when a model is replaced. The engine knows nothing else of
the pieces:

* :mod:`.attention`: attention for one query token (grouped-query heads folded instead of
  sdpa's slow ``enable_gqa`` path) and a KV cache that appends in place;
* :mod:`.packed_linear`: linear layers multiplying with weights prepacked once for oneDNN;
* :mod:`.lean_decode`: the decode step of Llama-architecture models without ``transformers``'
  per-call overhead (bit-identical logits with PyTorch's attention);
* :mod:`.native`: a C kernel for that step's attention, compiled on first use where a C
  compiler is found (float32 attention: within float32 rounding of the model's, not
  bit-identical; ``native_attention=False`` or ``ATROPOS_NATIVE_KERNELS=0`` turns it off);
* :mod:`.grouped`: a batch layout for that step whose rows keep their request's prompt keys
  and values once (:meth:`PreparedModel.decode_grouped`).

Every piece computes what the ``transformers`` model computes and applies only where it can;
elsewhere (another attention implementation, weights not on the CPU, a dtype without packed
kernels, an architecture the lean step does not know) that piece is left out and the model's
own code runs. :func:`prepare` logs what it chose and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from atroposlib.utils.memory import heap_for_temporaries, mapped_allocations

from .attention import append_cache, use_decode_attention
from .grouped import GroupedBatch
from .lean_decode import LeanDecoder
from .packed_linear import pack_linear_weights, repack_in_place, unpack_linear_weights

__all__ = [
    "FastPathOptions",
    "GroupedBatch",
    "PreparedModel",
    "prepare",
    "refresh",
    "release",
]

logger = logging.getLogger(__name__)

# Where a model keeps what :func:`prepare` made for it (see :func:`release`).
_ATTRIBUTE = "_atropos_fastpath"


@dataclass(frozen=True)
class FastPathOptions:
    """What the caller allows the fast path to do."""

    enabled: bool = True
    """Use the fast path at all (the engine's ``fast_decode``); False keeps the model as is."""
    lean: bool = True
    """Decode with :class:`~.lean_decode.LeanDecoder` where it applies (``lean_decode``)."""
    native_attention: bool = True
    """The lean step attends with the C kernel (:mod:`.native`, built on first use) where it
    applies; False (or ``ATROPOS_NATIVE_KERNELS=0``) keeps PyTorch's sdpa, bit-identical to
    the ``transformers`` forward pass."""
    compiled: bool = False
    """The caller ``torch.compile``\\ s the decode step: only the attention kernel is used
    (compiled graphs guard on strides, which the growing cache changes, and compile their own
    matrix multiplies), the cache stays ``transformers``' own and weights are not packed."""


@dataclass(eq=False)
class PreparedModel:
    """What :func:`prepare` set up for one model, and the calls the engine makes through it."""

    model: PreTrainedModel
    options: FastPathOptions
    decode_attention: bool
    """The model attends with :func:`~.attention.decode_attention`."""
    append_cache: bool
    """The running batch's cache appends in place (:class:`~.attention.AppendLayer`)."""
    packed_layers: int
    """Linear layers multiplying with prepacked weights."""
    lean: LeanDecoder | None
    """The lean decode step, or None (the model's forward pass decodes)."""
    reason: str
    """What was chosen and why, as logged."""

    def new_cache(self) -> DynamicCache:
        """An empty cache for a forward pass (prefill) to fill."""
        return append_cache() if self.append_cache else DynamicCache()

    def prefill_cache(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
        """A cache holding ``(keys, values)`` per layer that a forward pass (prefill) extends;
        the given tensors are never written (the first update copies them)."""
        if self.append_cache:
            return append_cache(layers)
        return DynamicCache(ddp_cache_data=layers)

    def batch_cache(
        self, source: DynamicCache | list[tuple[torch.Tensor, torch.Tensor]]
    ) -> DynamicCache:
        """The running batch's cache from a filled cache or ``(keys, values)`` per layer, always
        built the same way.

        With the append cache, its layers write each new token in place. Else it is a plain
        ``DynamicCache`` for ``torch.compile``: one built from layer tensors differs (in
        attributes the compiled graphs guard on) from one a forward pass filled, so the decode
        step only ever sees this kind.
        """
        if isinstance(source, list):
            layers = source
        else:
            layers = [(x.keys, x.values) for x in source.layers]
        if self.append_cache:
            return append_cache(layers)
        # Contiguous too: compiled graphs guard on strides; a sliced or repeated cache has others.
        return DynamicCache(ddp_cache_data=[(k.contiguous(), v.contiguous()) for k, v in layers])

    def current(self) -> bool:
        """False once the model's weights were changed in place after :func:`prepare` (the lean
        step then stands aside; packed layers notice by themselves and multiply unpacked)."""
        return self.lean is None or self.lean.current()

    def decode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor | None:
        """Logits ``(batch, vocab)`` of one decode step (one token per row), appending to
        ``cache``; None when the model's own forward pass has to run it instead.

        ``attention_mask`` is ``(batch, cached + 1)`` (0 for padding), ``position_ids`` is
        ``(batch, 1)``.
        """
        lean = self.lean
        if lean is None or not lean.current():
            return None
        return lean(input_ids, attention_mask, position_ids, cache)

    @property
    def grouped(self) -> bool:
        """:meth:`decode_grouped` can run now (the lean step applies to the current weights)."""
        return self.lean is not None and self.lean.current()

    def decode_grouped(self, input_ids: torch.Tensor, batch: GroupedBatch) -> torch.Tensor | None:
        """Logits ``(rows, vocab)`` of one decode step over ``batch``'s rows (prompts stored
        once per request, :mod:`.grouped`), appending to it; None when the lean step cannot
        run (the caller converts the batch with :meth:`GroupedBatch.to_padded` and decodes
        with the model's forward pass)."""
        if not self.grouped:
            return None
        assert self.lean is not None
        return self.lean.decode_grouped(input_ids, batch)

    @property
    def decode_path(self) -> str:
        """``"lean"`` when :meth:`decode` runs the step, else ``"transformers"``."""
        return "lean" if self.lean is not None and self.lean.current() else "transformers"


def prepare(
    model: PreTrainedModel,
    options: FastPathOptions | None = None,
) -> PreparedModel:
    """Get ``model`` (in eval mode, on its device) ready for the engine's decode loop.

    Switches its attention to the decode kernel where it runs on ``sdpa``, prepacks its CPU
    linear weights and builds the lean decode step, each where ``options`` allow it and where it
    computes exactly what the model computes; logs the choice and the reasons. Calling it again
    with the same options returns the same :class:`PreparedModel` while the weights are
    unchanged. Packed weights and fused projections are extra copies of the linear weights;
    :func:`release` drops them.
    """
    options = options or FastPathOptions()
    existing = model.__dict__.get(_ATTRIBUTE)
    if isinstance(existing, PreparedModel) and existing.options == options and existing.current():
        return existing
    attention = options.enabled and use_decode_attention(model)
    full = options.enabled and not options.compiled
    packed = pack_linear_weights(model) if full else 0
    lean, lean_why = None, "lean_decode is off"
    if full and options.lean:
        lean, lean_why = LeanDecoder.try_build(model)
    native_why = _use_native_attention(lean, options)
    reason = _describe(model, options, attention, packed, lean is not None, lean_why, native_why)
    prepared = PreparedModel(
        model=model,
        options=options,
        decode_attention=attention,
        append_cache=full,
        packed_layers=packed,
        lean=lean,
        reason=reason,
    )
    model.__dict__[_ATTRIBUTE] = prepared
    _log(f"{type(model).__name__}: {reason}")
    return prepared


def refresh(prepared: PreparedModel) -> PreparedModel:
    """``prepared`` after its model's weights were changed in place: the packed copies and the
    lean step's fused projections are rebuilt from the new values (the attention choice
    stays). Until then packed layers multiply unpacked and the lean step stands aside, so
    results are never stale, only slower."""
    model, options = prepared.model, prepared.options
    full = options.enabled and not options.compiled
    if full and prepared.packed_layers:
        # Same shapes and dtype (an in-place weight update): rewrite the packed and fused
        # copies where they are, temporaries from the heap (no fresh pages to fault in).
        with heap_for_temporaries():
            in_place = repack_in_place(model) == prepared.packed_layers and (
                prepared.lean is None or prepared.lean.refresh_in_place()
            )
        if in_place:
            return prepared
    if prepared.lean is not None:
        prepared.lean.__dict__.clear()
    lean, lean_why = None, "lean_decode is off"
    with mapped_allocations():  # new packed copies: as long-lived as the model
        packed = pack_linear_weights(model) if full else 0
        if full and options.lean:
            lean, lean_why = LeanDecoder.try_build(model)
    native_why = _use_native_attention(lean, options)
    fresh = PreparedModel(
        model=model,
        options=options,
        decode_attention=prepared.decode_attention,
        append_cache=prepared.append_cache,
        packed_layers=packed,
        lean=lean,
        reason=_describe(
            model,
            options,
            prepared.decode_attention,
            packed,
            lean is not None,
            lean_why,
            native_why,
        ),
    )
    model.__dict__[_ATTRIBUTE] = fresh
    return fresh


def release(model: PreTrainedModel) -> None:
    """Undo :func:`prepare`: drop the packed and fused weight copies and break the reference
    cycles ``prepare`` made in ``model`` (its lean decoder and :class:`PreparedModel` point back
    at it, each packed layer's bound ``forward`` at its layer), so the model is freed as soon as
    the last plain reference goes.

    Without this a replaced model lives until Python's cyclic collector happens to run a full
    collection: a training run that reloads weights every step grew the server by one model
    (~1.3 GB for SmolLM2-135M in float32 with its packed copies) per reload, to 20 GB.
    """
    prepared = model.__dict__.pop(_ATTRIBUTE, None)
    if isinstance(prepared, PreparedModel) and prepared.lean is not None:
        prepared.lean.__dict__.clear()
        prepared.lean = None
    unpack_linear_weights(model)


def _use_native_attention(lean: LeanDecoder | None, options: FastPathOptions) -> str:
    """Switch ``lean`` to the C attention kernel where options and model allow; returns ""
    when it did, else why not (empty too when there is no lean step to switch)."""
    if lean is None:
        return ""
    if not options.native_attention:
        return "native_attention is off"
    applies, why = lean.native_attention_applies()
    lean.native_attention = applies
    return why


def _describe(
    model: PreTrainedModel,
    options: FastPathOptions,
    attention: bool,
    packed: int,
    lean: bool,
    lean_why: str,
    native_why: str = "",
) -> str:
    if not options.enabled:
        return "fast path off (fast_decode=False): the model's own attention and forward pass"
    implementation = getattr(model.config, "_attn_implementation", None)
    parts = [
        "single-token decode attention"
        if attention
        else f"the model's {implementation} attention (the decode kernel replaces sdpa only)"
    ]
    if options.compiled:
        parts.append("compiled decode step: transformers' cache, unpacked weights")
        return "; ".join(parts)
    parts.append("append-in-place KV cache")
    if packed:
        parts.append(f"{packed} linear layers on prepacked oneDNN weights")
    else:
        weight = next(model.parameters())
        parts.append(
            f"no prepacked weights ({weight.dtype} on {weight.device.type}: no oneDNN kernels)"
        )
    if lean:
        parts.append(
            "lean decode step, "
            + (f"PyTorch's attention ({native_why})" if native_why else "C attention kernel")
        )
    else:
        parts.append(f"transformers decode step ({lean_why})")
    return "; ".join(parts)


_last_logged: str | None = None


def _log(message: str) -> None:
    # A training run reloads weights every step: the same choice is logged once, not per reload.
    global _last_logged
    level = logging.DEBUG if message == _last_logged else logging.INFO
    _last_logged = message
    logger.log(level, "fast path for %s", message)
