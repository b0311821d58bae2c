"""Log-probabilities of a micro-batch's trained tokens, computing only what the loss needs.

A plain ``model(input_ids).logits`` computes a vocabulary-sized row of logits for every position
(49,152 floats per token for SmolLM2), although the loss only reads the positions that are
trained, often a small part of each sequence. :func:`policy_logprobs` instead runs the model's
decoder, applies the output head to the trained positions only, and, when the micro-batch has a
shared prompt (``MicroBatch.prefix_ids``), runs that prompt once and lets every row attend to its
keys and values. Gradients flow through the shared prompt as through a full forward pass.

Not every model can be split this way (some scale or cap their logits after the head), so
:func:`check_fast_path` compares both paths on the model itself once, and the trainer falls back
to the full forward pass where they disagree.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from atroposlib.trainer.tensors import truncate_logits
from atroposlib.utils.kv_cache import cache_kwargs, output_cache
from example_trainer.data import MicroBatch

logger = logging.getLogger(__name__)


def _parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    try:
        decoder, head = get_decoder(), get_head()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or head is None or decoder is model:
        return None
    return decoder, head


def _scaled_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperatures: torch.Tensor,
    stats: dict[str, float] | None = None,
    truncation: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Log-probabilities of ``targets`` under the distribution the sampler drew them from:
    ``logits`` divided by the temperature and, with ``truncation`` (per-position top-k, top-p,
    min-p), cut to the sampler's support and renormalised
    (:func:`atroposlib.trainer.tensors.truncate_logits`)."""
    temps = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    scaled = logits.float() / temps.to(logits.device).unsqueeze(-1)
    if truncation is not None:
        scaled = truncate_logits(scaled, *truncation, keep=targets)
    if stats is not None:
        with torch.no_grad():
            logp = torch.log_softmax(scaled, dim=-1)
            entropy = -torch.special.xlogy(logp.exp(), logp.exp()).sum(dim=-1)
            stats["entropy_sum"] = stats.get("entropy_sum", 0.0) + float(entropy.sum())
            stats["entropy_tokens"] = stats.get("entropy_tokens", 0.0) + entropy.numel()
    return -F.cross_entropy(scaled, targets, reduction="none")


def _truncation(
    mb: MicroBatch, rows: torch.Tensor, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The micro-batch's per-row truncation, one entry per selected position (``rows``)."""
    if mb.top_k is None or mb.top_p is None or mb.min_p is None:
        return None
    return tuple(t.to(device)[rows] for t in (mb.top_k, mb.top_p, mb.min_p))  # type: ignore[return-value]


def full_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    temps: torch.Tensor,
    stats: dict[str, float] | None = None,
    truncation: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[B, T]`` log-probabilities of ``labels`` from a plain forward pass (0 where -100);
    ``truncation``: per-row ``(top_k, top_p, min_p)`` the rows were sampled with."""
    logits = model(input_ids=input_ids).logits  # [B, T, V]
    selected = labels != -100
    out = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    rows = selected.nonzero(as_tuple=True)[0]
    cut = None if truncation is None else tuple(t.to(logits.device)[rows] for t in truncation)
    out[selected] = _scaled_logprobs(
        logits[selected],
        labels[selected],
        temps[rows],
        stats,
        cut,  # type: ignore[arg-type]
    )
    return out


def policy_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    device: str | torch.device,
    *,
    fast: bool = True,
    stats: dict[str, float] | None = None,
) -> torch.Tensor:
    """``[B, T]`` float32 log-probabilities of ``mb.labels`` under ``model`` (0 where -100).

    Logits are divided by each row's sampling temperature (values <= 0 count as 1) and, for
    rows sampled with top-k/top-p/min-p, truncated and renormalised as the sampler did, so
    the ratio to ``--logprobs-mode processed_logprobs`` log-probs is 1 for unchanged weights
    (``docs/compat.md``, "Unbiased importance ratios"). With
    ``fast`` (see :func:`check_fast_path`), the head runs on trained positions only and a
    shared prompt runs once; otherwise the prompt is prepended to every row and the whole
    sequence goes through ``model``. ``stats``, when given, accumulates ``entropy_sum`` and
    ``entropy_tokens``: the entropy of the (temperature-scaled) policy at trained positions.
    """
    if mb.packed is not None:
        return _packed_logprobs(model, mb, device, fast=fast, stats=stats)
    input_ids = mb.input_ids.to(device)
    labels = mb.labels.to(device)
    temps = mb.temperatures.to(device)
    truncation = (
        None
        if mb.top_k is None or mb.top_p is None or mb.min_p is None
        else (mb.top_k.to(device), mb.top_p.to(device), mb.min_p.to(device))
    )
    parts = _parts(model) if fast else None
    if parts is None:
        if mb.prefix_ids is not None:
            prefix = mb.prefix_ids.to(device).unsqueeze(0).expand(input_ids.shape[0], -1)
            full = full_logprobs(
                model,
                torch.cat([prefix, input_ids], dim=1),
                torch.cat([torch.full_like(prefix, -100), labels], dim=1),
                temps,
                stats,
                truncation,
            )
            return full[:, prefix.shape[1] :]
        return full_logprobs(model, input_ids, labels, temps, stats, truncation)

    decoder, head = parts
    kwargs: dict[str, Any] = {}
    if mb.prefix_ids is not None:
        prompt = decoder(input_ids=mb.prefix_ids.to(device).unsqueeze(0), use_cache=True)
        cache = output_cache(prompt)
        cache.batch_repeat_interleave(input_ids.shape[0])
        kwargs = {**cache_kwargs(decoder, cache), "use_cache": True}
    hidden = decoder(input_ids=input_ids, **kwargs).last_hidden_state  # [B, T, H]
    selected = labels != -100
    rows = selected.nonzero(as_tuple=True)[0]
    out = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
    if rows.numel():
        logits = head(hidden[selected])
        out[selected] = _scaled_logprobs(
            logits, labels[selected], temps[rows], stats, _truncation(mb, rows, device)
        )
    else:
        out = out + 0.0 * hidden.sum()  # keeps the graph connected for backward()
    return out


def _low_precision(model: torch.nn.Module, device: str | torch.device) -> bool:
    """Whether ``model`` computes in 16 bits here: 16-bit weights, or autocast on."""
    if next(model.parameters()).dtype in (torch.bfloat16, torch.float16):
        return True
    return torch.is_autocast_enabled(torch.device(device).type)


def packed_attention_mask(
    model: torch.nn.Module, visible: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``visible`` (``[N, N]`` bool) as the 4D mask ``model``'s attention takes as given:
    bool for SDPA (True: attend), additive (0 or the dtype's minimum) for other kernels."""
    mask = visible.unsqueeze(0).unsqueeze(0)
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, torch.finfo(dtype).min
    )


def _packed_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    device: str | torch.device,
    *,
    fast: bool,
    stats: dict[str, float] | None,
) -> torch.Tensor:
    """:func:`policy_logprobs` for a packed micro-batch: one sequence, a 4D mask."""
    packed = mb.packed
    assert packed is not None
    labels = mb.labels.to(device)
    dtype = next(model.parameters()).dtype
    inputs = {
        "input_ids": packed.ids.to(device).unsqueeze(0),
        "position_ids": packed.positions.to(device).unsqueeze(0),
        "attention_mask": packed_attention_mask(model, packed.visible.to(device), dtype),
    }
    selected = labels != -100
    rows = selected.nonzero(as_tuple=True)[0]
    where = packed.index.to(device)[selected]  # packed position of each trained position
    parts = _parts(model) if fast else None
    if parts is None:  # full logits, read at the trained positions
        logits = model(**inputs).logits[0][where]
    else:  # the head at the trained positions only
        decoder, head = parts
        logits = head(decoder(**inputs).last_hidden_state[0][where])
    out = torch.zeros(labels.shape, dtype=torch.float32, device=device)
    if not rows.numel():
        return out + 0.0 * logits.sum()  # keeps the graph connected for backward()
    temps = mb.temperatures.to(device)
    out[selected] = _scaled_logprobs(
        logits, labels[selected], temps[rows], stats, _truncation(mb, rows, device)
    )
    return out


@torch.no_grad()
def check_packed_path(model: torch.nn.Module, device: str | torch.device) -> bool:
    """Whether ``model`` gives packed rows (:class:`~example_trainer.data.PackedLayout`) the
    same log-probabilities as the rows run one by one: its attention must honour a 4D mask
    and position ids. Checked once on a made-up batch of two groups sharing a beginning."""
    from example_trainer.data import prepare_batch

    was_training = model.training
    model.eval()
    try:
        vocab = int(getattr(model.config, "vocab_size", 100) or 100)
        g = torch.Generator().manual_seed(1)
        common = torch.randint(3, vocab, (5,), generator=g).tolist()
        groups = []
        for _ in range(2):
            question = torch.randint(3, vocab, (3,), generator=g).tolist()
            tokens, masks = [], []
            for length in (2, 4):
                reply = torch.randint(3, vocab, (length,), generator=g).tolist()
                tokens.append(common + question + reply)
                masks.append([-100] * (len(common) + len(question)) + reply)
            groups.append({"tokens": tokens, "masks": masks, "scores": [1.0, -1.0]})
        packed = prepare_batch(groups, 8, pack_tokens=1024).micro_batches
        plain = prepare_batch(groups, 8, share_prefix=False).micro_batches
        got = torch.cat([policy_logprobs(model, mb, device)[mb.labels != -100] for mb in packed])
        want = torch.cat([policy_logprobs(model, mb, device)[mb.labels != -100] for mb in plain])
        # rows come out in the same (lexicographic) order in both layouts only by chance:
        # compare as sorted values
        got, want = got.sort().values, want.sort().values
        tolerance = 5e-2 if _low_precision(model, device) else 2e-3
        ok = bool(torch.allclose(got, want, atol=tolerance, rtol=tolerance))
    except Exception as exc:  # noqa: BLE001 - any failure means: do not pack
        logger.info("packed rows unavailable for this model (%s)", exc)
        return False
    finally:
        model.train(was_training)
    if not ok:
        logger.info("this model's attention does not honour a packed mask; rows are padded")
    return ok


@torch.no_grad()
def check_fast_path(model: torch.nn.Module, device: str | torch.device) -> bool:
    """Whether :func:`policy_logprobs`'s fast path gives the full forward pass's numbers.

    Runs both on a short made-up micro-batch (with a shared prompt, two rows of different
    lengths) in eval mode and compares them.
    """
    if _parts(model) is None:
        return False
    was_training = model.training
    model.eval()
    try:
        vocab = int(getattr(model.config, "vocab_size", 100) or 100)
        g = torch.Generator().manual_seed(0)
        prefix = torch.randint(3, vocab, (6,), generator=g)
        inputs = torch.randint(3, vocab, (2, 5), generator=g)
        labels = torch.randint(3, vocab, (2, 5), generator=g)
        labels[0, :2] = -100
        labels[1, 3:] = -100  # the second row is shorter: padding at the end
        inputs[1, 3:] = 0
        mb = MicroBatch(
            input_ids=inputs,
            labels=labels,
            advantages=torch.zeros(2, 5),
            old_logprobs=torch.full((2, 5), float("nan")),
            temperatures=torch.tensor([1.0, 0.7]),
            prefix_ids=prefix,
        )
        fast = policy_logprobs(model, mb, device, fast=True)
        slow = policy_logprobs(model, mb, device, fast=False)
        tolerance = 5e-2 if _low_precision(model, device) else 2e-3
        ok = bool(torch.allclose(fast, slow, atol=tolerance, rtol=tolerance))
    except Exception as exc:  # noqa: BLE001 - any failure means: use the plain path
        logger.info("fast log-prob path unavailable for this model (%s)", exc)
        return False
    finally:
        model.train(was_training)
    if not ok:
        logger.info("fast log-prob path disagrees with the model's forward; using the plain one")
    return ok
