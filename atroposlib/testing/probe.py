"""Per-token log-probabilities of token sequences under a model, for the weight-based check.

Two sources: a model folder (transformers, loaded here; torch imported only when called) or
an inference server speaking vLLM's ``/generate`` with ``prompt_logprobs`` (``atropos-serve``,
vLLM), which shows the weights the trainer synced to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import httpx

__all__ = ["folder_logprobs", "server_logprobs"]


def folder_logprobs(model_dir: str | Path, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """``log p(tokens[j] | tokens[:j])`` for ``j >= 1`` of each sequence (position 0 is 0.0),
    under the model saved in ``model_dir`` (float32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    result = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([list(seq)], dtype=torch.long)
            logits = model(input_ids=ids).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            result.append([0.0] + logp.tolist())
    return result


def server_logprobs(
    url: str, sequences: Sequence[Sequence[int]], *, timeout: float = 120.0
) -> list[list[float]]:
    """The same, from an inference server's ``POST /generate`` (``prompt_logprobs``)."""
    result = []
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout) as client:
        for seq in sequences:
            reply = client.post(
                "/generate",
                json={
                    "prompt": {"prompt_token_ids": list(seq)},
                    "max_tokens": 1,
                    "temperature": 0.0,
                    "prompt_logprobs": 0,
                },
            )
            reply.raise_for_status()
            entries = reply.json()["prompt_logprobs"]
            row = [0.0]
            for token, entry in zip(seq[1:], entries[1:], strict=True):
                row.append(float(entry[str(token)]))  # JSON object keys are strings
            result.append(row)
    return result
