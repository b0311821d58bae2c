"""Build the scripted test model for upstream's envs (``standins/scripted_lm.py``).

Upstream's environments drop a group whose replies all score the same, so a random model never
gets a group through them. The scripted model writes one of a few given replies, chosen by a
substring of the prompt: ``{"": [right, wrong]}`` answers any prompt with one of the two (a
group of 4 sampled replies usually mixes them); ``{"judge": [verdict], "": [...]}`` answers
prompts containing ``judge`` with the verdict and the rest with the others (first match wins).
A server process loads it when ``standins`` is on ``PYTHONPATH`` and ``ATROPOS_SCRIPTED_MODEL``
is set (``sitecustomize`` registers the model type).
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import AutoTokenizer

from atroposlib.inference.models import smollm2_tokenizer_dir

sys.path.insert(0, str(Path(__file__).resolve().parent / "standins"))
from scripted_lm import ScriptedConfig, ScriptedForCausalLM  # noqa: E402

Reply = str | list[str]


def _encode(tokenizer: AutoTokenizer, reply: Reply) -> list[int]:
    """A reply's token ids and the end-of-turn token; a reply given as a list of pieces is
    encoded piece by piece, which picks the token boundaries (``["</", "Think", ">."]``)."""
    pieces = [reply] if isinstance(reply, str) else reply
    ids = [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]
    return [*ids, tokenizer.eos_token_id]


def build_scripted_model(
    path: str | Path,
    replies: list[Reply] | dict[str, list[Reply]],
    special_tokens: tuple[str, ...] = (),
    chat_template: str | None = None,
) -> Path:
    """Save the scripted model (replies for any prompt, or by prompt substring) and the
    SmolLM2 tokenizer to ``path``; ``special_tokens`` are added to the tokenizer (and the
    vocabulary), e.g. ``<tool_call>`` for parsers that look for it as one token, as Qwen's;
    ``chat_template`` replaces SmolLM2's (which renders neither tools nor tool calls)."""
    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    rules = replies if isinstance(replies, dict) else {"": replies}
    config = ScriptedConfig(
        rules=[[text, [_encode(tokenizer, r) for r in rs]] for text, rs in rules.items()],
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    ScriptedForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
