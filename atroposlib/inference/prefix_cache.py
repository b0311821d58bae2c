"""Prompt-prefix caching across requests: the key/value cache of a prompt beginning that
several requests share (a system prompt, few-shot examples, a chat template's header) is kept
after its first use, and later prompts that start the same way skip computing it.

vLLM calls this automatic prefix caching (``--enable-prefix-caching``); it hashes fixed-size
blocks of a paged cache. Here the engine's cache is one tensor per layer, so an entry is the
keys and values of one token prefix, and a later prompt may use any beginning of an entry:
the keys and values of the first ``k`` tokens depend only on those tokens (causal attention).

Which beginnings are worth keeping is learned from the traffic: the engine remembers the last
few prompts it prefilled, and a prompt that shares at least ``min_tokens`` tokens with one of
them (or with an entry) has that common part computed on its own once and kept. Entries are
dropped when the weights change (their keys and values belong to the old weights) and, least
recently used first, beyond ``max_entries`` or ``max_bytes``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many leading tokens ``a`` and ``b`` share (at most ``limit``)."""
    n = min(len(a), len(b))
    if limit is not None:
        n = min(n, limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    layers: Layers
    nbytes: int


class PrefixCache:
    """Keys and values of prompt prefixes, reused across requests (see the module docstring).

    ``max_entries=0`` turns it off: :meth:`known_length` and :meth:`lookup` then find nothing.
    Not thread-safe: the engine's scheduler thread is its only user.
    """

    def __init__(
        self,
        *,
        max_entries: int = 8,
        max_bytes: int = 256 * 2**20,
        min_tokens: int = 16,
        history: int = 16,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._recent: deque[tuple[int, ...]] = deque(maxlen=history)
        self.nbytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def known_length(self, prompt: Sequence[int], limit: int) -> int:
        """The longest beginning (at most ``limit`` tokens) that ``prompt`` shares with an entry
        or with a recently prefilled prompt; 0 below ``min_tokens``."""
        if not self.enabled:
            return 0
        best = 0
        for tokens in (*self._entries, *self._recent):
            best = max(best, common_prefix_len(prompt, tokens, limit))
            if best == limit:
                break
        return best if best >= self.min_tokens else 0

    def remember(self, prompt: Sequence[int]) -> None:
        """Note a prefilled prompt, so that a later one starting the same way is recognised."""
        if self.enabled:
            self._recent.append(tuple(prompt))

    def lookup(self, prompt: Sequence[int], limit: int) -> tuple[int, Layers | None]:
        """The longest cached beginning of ``prompt`` (at most ``limit`` tokens) and its keys
        and values per layer, shape ``(1, kv_heads, length, head_dim)``; ``(0, None)`` when
        none reaches ``min_tokens``."""
        if not self.enabled:
            return 0, None
        best, found = 0, None
        for entry in self._entries.values():
            length = common_prefix_len(prompt, entry.tokens, limit)
            if length > best:
                best, found = length, entry
        if found is None or best < self.min_tokens:
            return 0, None
        self._entries.move_to_end(found.tokens)
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in found.layers]

    def store(self, tokens: Sequence[int], layers: Layers) -> None:
        """Keep ``layers`` (already copies: nobody else writes them) as the keys and values of
        ``tokens``; entries that are a beginning of it are replaced by it."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return
        key = tuple(tokens)
        if any(t[: len(key)] == key for t in self._entries):
            return  # an entry already holds this beginning
        for old in [t for t in self._entries if key[: len(t)] == t]:
            self.nbytes -= self._entries.pop(old).nbytes
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if nbytes > self.max_bytes:
            return
        self._entries[key] = _Entry(key, layers, nbytes)
        self.nbytes += nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def clear(self) -> None:
        """Drop every entry (the weights changed); recent prompts are kept, so the next
        prompts sharing a prefix refill the cache at once."""
        self._entries.clear()
        self.nbytes = 0
