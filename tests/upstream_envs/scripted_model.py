"""A tiny Llama that writes one of a few given replies: a test model for upstream's envs.

Upstream's environments drop a group whose replies all score the same, so a random model never
gets a group through them. This model is a bigram table in Llama form: attention and MLP are
zero, so the next token depends only on the current one. Every token outside the scripted
replies (the end of any prompt) leads with equal probability to the first token of each reply;
each reply's tokens then lead deterministically to the next, and the last to the end-of-turn
token. Sampled at temperature 1 a group of replies mixes the scripts; at temperature 0 it is
the first script. A token may appear in several scripts only when it is followed by the same
token everywhere.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from atroposlib.inference.models import smollm2_tokenizer_dir

HIDDEN = 128
LOGIT = 25.0


Reply = str | list[str]


def _encode(tokenizer: AutoTokenizer, reply: Reply) -> list[int]:
    pieces = [reply] if isinstance(reply, str) else reply
    return [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]


def script_tokens(tokenizer: AutoTokenizer, replies: list[Reply]) -> list[list[int]]:
    """Each reply's token ids, ending with the end-of-turn token; raises ``ValueError`` when
    a token would need two different successors. A reply given as a list of pieces is encoded
    piece by piece, which picks the token boundaries (``["</", "Think", ">."]``)."""
    chains = [_encode(tokenizer, r) + [tokenizer.eos_token_id] for r in replies]
    successor: dict[int, int] = {}
    for chain in chains:
        for current, nxt in zip(chain[:-1], chain[1:], strict=True):
            if successor.setdefault(current, nxt) != nxt:
                raise ValueError(
                    f"token {tokenizer.decode([current])!r} is followed by two different tokens"
                )
    return chains


def build_scripted_model(path: str | Path, replies: list[Reply]) -> Path:
    """Save the scripted model and the SmolLM2 tokenizer to ``path``."""
    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    chains = script_tokens(tokenizer, replies)
    scripted = sorted({t for chain in chains for t in chain})
    if len(scripted) + 1 > HIDDEN:
        raise ValueError(f"{len(scripted)} distinct tokens do not fit in {HIDDEN} dimensions")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype=torch.float32,
    )
    model = LlamaForCausalLM(config)
    basis = {token: i + 1 for i, token in enumerate(scripted)}  # dimension 0: "any other token"
    scale = LOGIT / HIDDEN**0.5  # RMSNorm maps a basis vector to sqrt(HIDDEN) times itself
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        for norm in (
            model.model.norm,
            *(
                m
                for layer in model.model.layers
                for m in (layer.input_layernorm, layer.post_attention_layernorm)
            ),
        ):
            norm.weight.fill_(1.0)
        model.model.embed_tokens.weight[:, 0] = 1.0
        for token, dim in basis.items():
            model.model.embed_tokens.weight[token] = 0.0
            model.model.embed_tokens.weight[token, dim] = 1.0
        for chain in chains:
            model.lm_head.weight[chain[0], 0] = scale
            for current, nxt in zip(chain[:-1], chain[1:], strict=True):
                model.lm_head.weight[nxt, basis[current]] = scale
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
