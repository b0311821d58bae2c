"""A causal LM that writes scripted replies, chosen by what the prompt contains.

Upstream's environments drop a group whose replies all score the same, so a random model never
gets a group through them, and their scorers want exact shapes (``\\boxed{}``, ``<tool_call>``
JSON, a judge's verdict). This model's logits force them: its config holds rules, each a prompt
substring (``""`` matches any prompt) and a list of replies as token ids ending with the
end-of-turn token. For a sequence that ends with the first ``k`` tokens of a reply of the first
rule whose substring is in the text before them, the next token is that reply's token ``k``
(logit ``LOGIT`` above every other token; where replies share their first ``k`` tokens, their
next tokens are equally likely); after a prompt, the first tokens of the matching rule's
replies are equally likely. Sampled at temperature 1 a group mixes the replies; at
temperature 0 it is the first.

The model keeps each row's token ids in its KV cache (as one-dimensional "keys"), so it runs
under any engine that drives a ``transformers`` causal LM with a ``DynamicCache`` (prefill,
shared prefixes, padding masks, row selection). It is registered with ``transformers``' Auto
classes by :func:`register` (``sitecustomize`` does so in a process started with
``ATROPOS_SCRIPTED_MODEL=1``): checkpoints have ``model_type: atropos_scripted``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

LOGIT = 60.0


class ScriptedConfig(PretrainedConfig):
    model_type = "atropos_scripted"

    def __init__(
        self,
        rules: list[list[Any]] | None = None,
        vocab_size: int = 49152,
        max_position_embeddings: int = 32768,
        **kwargs: Any,
    ) -> None:
        self.rules = rules or []  # [[substring, [[token ids], ...]], ...]
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.num_hidden_layers = 1
        self.hidden_size = 1
        super().__init__(**kwargs)


class ScriptedForCausalLM(PreTrainedModel):
    config_class = ScriptedConfig
    base_model_prefix = "scripted"
    _supports_cache_class = True

    def __init__(self, config: ScriptedConfig) -> None:
        super().__init__(config)
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the model a dtype and a device
        self.rules = [
            (str(text), [list(map(int, r)) for r in replies]) for text, replies in config.rules
        ]
        self._decode = lru_cache(maxsize=64)(self._decode_uncached)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass

    def _decode_uncached(self, ids: tuple[int, ...]) -> str:
        tokenizer = _tokenizer(self.config.name_or_path)
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    def _rule(self, prompt: tuple[int, ...]) -> list[list[int]] | None:
        text = self._decode(prompt)
        for substring, replies in self.rules:
            if substring in text:
                return replies
        return None

    def next_tokens(self, seq: list[int]) -> list[int]:
        """The tokens the model may write after ``seq``: the next token of the replies that
        ``seq`` ends furthest into (several where replies share a start), else the first
        tokens of the replies of the rule the prompt matches."""
        best, following = 0, set()
        for _, replies in self.rules:
            for reply in replies:
                for k in range(min(len(reply) - 1, len(seq)), best - 1, -1):
                    if k and seq[-k:] == reply[:k]:
                        if reply in (self._rule(tuple(seq[:-k])) or []):
                            if k > best:
                                best, following = k, set()
                            following.add(reply[k])
                        break
        if best:
            return sorted(following)
        replies = self._rule(tuple(seq)) or []
        return sorted({reply[0] for reply in replies})

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        batch, new = input_ids.shape
        ids = input_ids.to(torch.float32)[:, None, :, None]
        if past_key_values is not None:
            ids, _ = past_key_values.update(ids, ids, 0)
        history = ids[:, 0, :, 0].long().tolist()
        total = len(history[0])
        mask = attention_mask.tolist() if attention_mask is not None else [[1] * total] * batch
        keep = new if not logits_to_keep else min(logits_to_keep, new)
        logits = torch.zeros((batch, keep, self.config.vocab_size), dtype=torch.float32)
        for row in range(batch):
            tokens = [t for t, m in zip(history[row], mask[row][-total:], strict=True) if m]
            for j in range(keep):
                end = len(tokens) - (keep - 1 - j)
                for token in self.next_tokens(tokens[:end]):
                    logits[row, j, token] = LOGIT
        return CausalLMOutputWithPast(
            logits=logits.to(self.anchor.dtype), past_key_values=past_key_values
        )


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    return AutoTokenizer.from_pretrained(path)


def register() -> None:
    """Make ``AutoConfig``/``AutoModelForCausalLM`` load ``atropos_scripted`` checkpoints."""
    try:
        AutoConfig.register(ScriptedConfig.model_type, ScriptedConfig)
        AutoModelForCausalLM.register(ScriptedConfig, ScriptedForCausalLM)
    except ValueError:  # already registered
        pass
