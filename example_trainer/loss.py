"""The GRPO objective, as one function."""

from __future__ import annotations

from typing import Literal

import torch

from atroposlib.trainer.tensors import sampled_logprobs


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probability of each label under the distribution the sampler drew it from.

    Args:
        logits: ``[B, T, V]`` next-token logits.
        labels: ``[B, T]`` target ids, ``-100`` where nothing is trained.
        temperatures: ``[B]`` sampling temperature of each sequence (values <= 0 count as 1).
        top_k, top_p, min_p: ``[B]`` the truncation each sequence was sampled with (None:
            none): the temperature-scaled distribution is cut to the sampler's support and
            renormalised (:func:`atroposlib.trainer.tensors.sampled_logprobs`), as
            ``--logprobs-mode processed_logprobs`` reports it.

    Returns:
        ``[B, T]`` float32 log-probabilities (0 where the label is -100).
    """
    batch, width, vocab = logits.shape

    def rows(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values.view(-1, 1).expand(batch, width).reshape(-1)

    logp = sampled_logprobs(
        logits.reshape(-1, vocab),
        labels.clamp(min=0).reshape(-1),
        rows(temperatures),
        rows(top_k),
        rows(top_p),
        rows(min_p),
    ).view(batch, width)
    return logp * (labels != -100)


def grpo_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    *,
    clip_eps: float = 0.2,
    clip_delta: float | None = None,
    kl_coef: float = 0.0,
    normalization: Literal["sequence", "token"] = "sequence",
    num_sequences: int | None = None,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    r"""Clipped GRPO surrogate loss, optionally with a KL penalty to a reference model.

    For sequence ``i`` and trained token ``t`` (``mask`` = 1):

    .. math::

        r_{i,t} = \exp(\log\pi_\theta(o_{i,t}) - \log\pi_{old}(o_{i,t}))

        L_{i,t} = -\min\big(r_{i,t} A_{i,t},\ \mathrm{clip}(r_{i,t}, 1-\epsilon, 1+\epsilon) A_{i,t}\big)
                  + \beta\, \mathrm{KL}_{i,t}

        \mathrm{KL}_{i,t} = e^{\log\pi_{ref} - \log\pi_\theta} - (\log\pi_{ref} - \log\pi_\theta) - 1

    (the non-negative "k3" estimator of KL(pi_theta || pi_ref)). With ``clip_delta`` = :math:`\delta`
    the unclipped ratio is also capped, :math:`r_{i,t} \to \min(r_{i,t}, \delta)` in the first
    term (two-sided or dual clipping: TRL's ``delta``, verl's ``clip_ratio_c``, INTELLECT-2).
    It changes only tokens with :math:`A < 0` whose probability has grown more than
    :math:`\delta`-fold since sampling: their loss, otherwise :math:`r|A|` and unbounded, stays
    :math:`\delta|A|` and they add no gradient. Such tokens turn up in batches sampled a policy
    or more ago, and one of them can dominate a clipped gradient. Normalisation:

    - ``sequence`` (GRPO, upstream): :math:`L = \frac{1}{G}\sum_i \frac{1}{|o_i|}\sum_t L_{i,t}`
    - ``token`` (DAPO): :math:`L = \frac{1}{\sum_i |o_i|}\sum_i\sum_t L_{i,t}`

    ``old_logprobs`` are the inference server's log-probabilities of the sampled tokens
    (``inference_logprobs`` on the wire). Where they are missing (``None``, or NaN for a token or
    a whole sequence) the on-policy form is used: :math:`\pi_{old}` is
    :math:`\pi_\theta` detached, so :math:`r=1` and the gradient is REINFORCE's
    :math:`-A\,\nabla\log\pi_\theta`.

    Args:
        logprobs: ``[B, T]`` log-probabilities under the policy being trained (with grad).
        advantages: ``[B, T]`` per-token advantages (a sequence's scalar advantage repeated).
        mask: ``[B, T]`` 1 for trained tokens, else 0.
        old_logprobs: ``[B, T]`` sampling-time log-probabilities, NaN where unknown, or None.
        ref_logprobs: ``[B, T]`` reference-model log-probabilities (needed when kl_coef > 0).
        clip_eps: the clip range epsilon.
        clip_delta: cap on the unclipped ratio (above), or None for the standard loss; must be
            greater than ``1 + clip_eps``.
        kl_coef: beta, the weight of the KL term.
        normalization: ``sequence`` or ``token`` (see above).
        num_sequences: sequences in the whole optimizer batch (default: B). Set it when a batch
            is split into micro-batches so their gradients add up to the batch's mean.
        num_tokens: trained tokens in the whole optimizer batch (default: ``mask.sum()``).

    Returns:
        The scalar loss and float metrics: ``mean_ratio``, ``clipped_fraction``, ``kl``,
        ``logprob`` (mean over trained tokens), ``offpolicy_fraction`` (tokens that had old
        log-probabilities), ``ratio_max`` (the largest ratio of a trained token) and
        ``delta_clipped_fraction`` (tokens ``clip_delta`` capped; 0 without it).
    """
    if clip_delta is not None and not clip_delta > 1.0 + clip_eps:
        raise ValueError(f"clip_delta must be greater than 1 + clip_eps, got {clip_delta}")
    mask = mask.float()
    if old_logprobs is None:
        old_logprobs = torch.full_like(logprobs, float("nan"))
    known = ~torch.isnan(old_logprobs)
    old = torch.where(known, old_logprobs, logprobs.detach())
    ratio = torch.exp(logprobs - old)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    capped = ratio if clip_delta is None else ratio.clamp(max=clip_delta)
    per_token = -torch.min(capped * advantages, clipped * advantages)

    kl = torch.zeros_like(logprobs)
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        diff = ref_logprobs - logprobs
        kl = torch.exp(diff) - diff - 1.0
        per_token = per_token + kl_coef * kl

    tokens_per_seq = mask.sum(dim=1)
    if normalization == "sequence":
        seq_mean = (per_token * mask).sum(dim=1) / tokens_per_seq.clamp(min=1)
        loss = seq_mean.sum() / (num_sequences or logprobs.shape[0])
    elif normalization == "token":
        total = num_tokens if num_tokens is not None else mask.sum().item()
        loss = (per_token * mask).sum() / max(total, 1)
    else:
        raise ValueError(f"normalization must be 'sequence' or 'token', not {normalization!r}")

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        is_clipped = ((ratio - clipped).abs() > 1e-6).float()
        metrics = {
            "mean_ratio": float((ratio * mask).sum() / n),
            "clipped_fraction": float((is_clipped * mask).sum() / n),
            "kl": float((kl * mask).sum() / n),
            "logprob": float((logprobs * mask).sum() / n),
            "offpolicy_fraction": float((known.float() * mask).sum() / n),
            "ratio_max": float(torch.where(mask > 0, ratio, 0.0).max()) if mask.any() else 1.0,
            "delta_clipped_fraction": (
                float((((ratio > clip_delta) & (advantages < 0)).float() * mask).sum() / n)
                if clip_delta is not None
                else 0.0
            ),
        }
    return loss, metrics
