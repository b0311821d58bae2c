"""Turning a batch from ``GET /batch`` into training tensors, with as little wasted work as possible.

Each sequence of the batch becomes a *row*: ``input_ids = tokens[:-1]`` and ``labels = masks[1:]``
(a mask holds the token id where it is trained, -100 elsewhere), so position ``t`` of a row
predicts ``labels[t]``. Rows are grouped into micro-batches (one forward/backward pass each) in
ways that never change the gradient:

- **Packing** (``pack_tokens``, the trainer's default). The rows of a step go into passes of at
  most ``pack_tokens`` tokens, each pass one sequence without padding in which every beginning
  its rows have in common runs once: the system prompt and few-shot examples all groups
  share, each group's question, replies that start alike (an arithmetic group's sixteen
  replies are often the same few tokens). A 4D attention mask lets each token see only its own
  row's earlier tokens, and position ids restart per row (:class:`PackedLayout`). For the
  arithmetic recipe this runs ~240 positions per step instead of ~770 for the layouts below.
  The other points apply when rows are not packed.
- **Prompt sharing.** The rows of a micro-batch often start with the same tokens: a group's
  prompt, or a system prompt and few-shot examples every group has. When they share at least
  ``min_shared_prefix`` untrained leading tokens, those go into ``MicroBatch.prefix_ids`` and
  run once per micro-batch; each row then holds only the rest of its sequence (see
  :func:`example_trainer.forward.policy_logprobs`). For short completions after a long prompt
  (arithmetic, multiple choice) this removes most of the tokens.
- **Length buckets.** Each micro-batch is padded only to its own longest row (rounded up to
  ``pad_multiple``), instead of the whole batch being padded to one length.
- **The cheapest split.** Rows go into micro-batches of at most ``micro_batch_size`` in
  whichever of three orders costs the fewest token positions (counting
  ``MICRO_BATCH_OVERHEAD`` per pass): by prompt (lexicographic, so several groups can share a
  common beginning), by group (each group's whole prompt shared), or by length (nothing shared).
- **Zero-advantage rows are skipped** (``skip_zero_advantage``, only valid without a KL term): a
  sequence whose advantage is 0 on every trained token adds nothing to the GRPO gradient. The
  loss still divides by the batch's full sequence and token counts, so the gradient is the
  same as if it had been run.

Right-padding needs no attention mask: causal attention never looks forward. Tokens are padded
with 0, labels with -100.

Upstream's trainer padded every sequence of the batch to one length ``L`` with ``L - 1`` a
multiple of 64 (``padded_length``); that layout is kept as ``upstream_padding=True`` for GPUs
where fixed shapes matter more than the extra tokens.

How a group is read (prompt/completion split, advantages from scores or the env's explicit
``advantages``, ``set_advantage_to_zero``, sampler log-probs, temperature, policy version) is the
library's: :mod:`atroposlib.trainer.rows` turns each sequence into a ``TrainingRow`` and rejects
a malformed group naming the field; this module only lays the rows out for the GPU/CPU.

Other differences from upstream, on purpose: the last partial micro-batch is kept (upstream's
classic trainer dropped it); per-token sampler log-probabilities are used (upstream ignored
them); env-provided ``advantages`` are used instead of scores when present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from atroposlib.trainer import TrainingRow, group_advantages, rows_from_batch, sample_temperature

__all__ = [
    "MicroBatch",
    "PackedLayout",
    "TrainingBatch",
    "group_advantages",
    "padded_length",
    "prepare_batch",
    "sample_temperature",
]

PAD_MULTIPLE = 64
"""Upstream's padding unit (``padded_length``)."""


@dataclass
class PackedLayout:
    """Several rows run as one sequence, everything they have in common once (``pack_tokens``).

    The rows' input tokens form a prefix tree: the beginnings they have in common (a system
    prompt every group shares, then each group's question, then replies that start alike)
    appear once, each row's remainder after them. Token ``i`` attends to token ``j`` when ``visible[i, j]``: ``j`` is
    on ``i``'s row path at or before it. ``positions`` are the tokens' positions in their own
    rows, so each row sees exactly what it would see run on its own.
    """

    ids: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N] position of each token in its row(s)
    visible: torch.Tensor  # [N, N] bool
    index: torch.Tensor  # [B, T] packed position of row b's input t (0 past the row's end)


@dataclass
class MicroBatch:
    """One forward/backward pass worth of rows, padded to a common length.

    ``prefix_ids``, when set, is a prompt every row continues: the model runs it once and the
    rows attend to its keys and values. Position ``t`` of a row predicts ``labels[t]``.
    """

    input_ids: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T], -100 where not trained
    advantages: torch.Tensor  # [B, T]
    old_logprobs: torch.Tensor  # [B, T], NaN where unknown
    temperatures: torch.Tensor  # [B]
    prefix_ids: torch.Tensor | None = None  # [P]
    # the truncation each row was sampled with, replayed so the ratio is 1 without a weight
    # change (atroposlib.trainer.sampled_logprobs); None: no row was truncated
    top_k: torch.Tensor | None = None  # [B] long, -1: none
    top_p: torch.Tensor | None = None  # [B] float, 1.0: none
    min_p: torch.Tensor | None = None  # [B] float, 0.0: none
    # set when the rows run packed as one sequence (input_ids then hold whole rows, for
    # reports and the fallback path, and are not what the model runs)
    packed: PackedLayout | None = None

    @property
    def mask(self) -> torch.Tensor:
        """1.0 where a token is trained."""
        return (self.labels != -100).float()

    @property
    def computed_tokens(self) -> int:
        """Token positions the model runs for this micro-batch (padding included)."""
        if self.packed is not None:
            return int(self.packed.ids.numel())
        prefix = 0 if self.prefix_ids is None else int(self.prefix_ids.numel())
        return prefix + int(self.input_ids.numel())


@dataclass
class TrainingBatch:
    """A whole optimizer step: micro-batches plus the numbers the loss normalises by."""

    micro_batches: list[MicroBatch]
    num_sequences: int  # every sequence of the batch, skipped ones included
    num_tokens: int  # trained tokens of every sequence, skipped ones included
    total_tokens: int  # all tokens (prompt + completion) of every sequence
    reward_mean: float
    skipped_sequences: int = 0  # zero-advantage sequences that were not run
    group_scores: list[list[float]] = field(default_factory=list)
    #: each group's ``policy_version`` (the trainer step whose weights made it; None if unset)
    policy_versions: list[int | None] = field(default_factory=list)

    @property
    def computed_tokens(self) -> int:
        """Token positions actually run through the model (shared prompts once, padding in)."""
        return sum(mb.computed_tokens for mb in self.micro_batches)

    @property
    def run_tokens(self) -> int:
        """Trained tokens of the sequences actually run (skipped ones left out)."""
        return sum(int((mb.labels != -100).sum()) for mb in self.micro_batches)

    @property
    def flat_groups(self) -> int:
        """Groups whose scores were all equal (no learning signal from them)."""
        return sum(1 for scores in self.group_scores if len(scores) > 1 and len(set(scores)) == 1)


@dataclass
class _Row:
    inputs: list[int]  # tokens[:-1]
    labels: list[int]  # masks[1:]
    advantages: list[float]  # per position of ``inputs``
    old: list[float]  # per position, NaN where unknown
    temperature: float
    group: int
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    def first_trained(self) -> int:
        for i, label in enumerate(self.labels):
            if label != -100:
                return i
        return len(self.labels)


def padded_length(longest: int) -> int:
    """Upstream's "good offset": the smallest L >= longest with (L - 1) % 64 == 0 (or longest)."""
    if (longest - 1) % PAD_MULTIPLE == 0:
        return longest
    return math.ceil((longest - 1) / PAD_MULTIPLE) * PAD_MULTIPLE + 1


def _row(row: TrainingRow, group: int) -> _Row:
    """The shifted form of a library row: ``inputs = tokens[:-1]``, everything else ``[1:]``."""
    prompt = len(row.prompt_ids)
    labels = [-100] * prompt + row.labels[prompt:]
    advantages = [0.0] * prompt + row.advantages
    sampler = row.sampler_logprobs or [None] * len(row.completion_ids)
    old = [math.nan] * prompt + [math.nan if v is None else v for v in sampler]
    return _Row(
        inputs=row.tokens[:-1],
        labels=labels[1:],
        advantages=advantages[1:],
        old=old[1:],
        temperature=row.temperature,
        group=group,
        top_k=row.top_k,
        top_p=row.top_p,
        min_p=row.min_p,
    )


def _no_signal(row: _Row) -> bool:
    pairs = zip(row.advantages, row.labels, strict=True)
    return all(a == 0.0 for a, label in pairs if label != -100)


def _shared_prefix(rows: list[_Row]) -> int:
    """Leading input positions every row has in common and none of them trains."""
    limit = min(min(r.first_trained() for r in rows), min(len(r.inputs) for r in rows) - 1)
    first = rows[0].inputs
    length = 0
    while length < limit and all(r.inputs[length] == first[length] for r in rows[1:]):
        length += 1
    return length


def _stack(rows: list[_Row], start: int, width: int, prefix: list[int] | None) -> MicroBatch:
    n = len(rows)
    input_ids = torch.zeros(n, width, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    advantages = torch.zeros(n, width, dtype=torch.float32)
    old = torch.full((n, width), math.nan, dtype=torch.float32)
    temps = torch.ones(n, dtype=torch.float32)
    for i, row in enumerate(rows):
        size = len(row.inputs) - start
        input_ids[i, :size] = torch.tensor(row.inputs[start:], dtype=torch.long)
        labels[i, :size] = torch.tensor(row.labels[start:], dtype=torch.long)
        advantages[i, :size] = torch.tensor(row.advantages[start:], dtype=torch.float32)
        old[i, :size] = torch.tensor(row.old[start:], dtype=torch.float32)
        temps[i] = row.temperature
    truncated = any(r.top_k > 0 or r.top_p < 1.0 or r.min_p > 0.0 for r in rows)
    return MicroBatch(
        input_ids=input_ids,
        labels=labels,
        advantages=advantages,
        old_logprobs=old,
        temperatures=temps,
        prefix_ids=None if prefix is None else torch.tensor(prefix, dtype=torch.long),
        top_k=torch.tensor([r.top_k for r in rows], dtype=torch.long) if truncated else None,
        top_p=torch.tensor([r.top_p for r in rows]) if truncated else None,
        min_p=torch.tensor([r.min_p for r in rows]) if truncated else None,
    )


def _round_up(value: int, multiple: int) -> int:
    return value if multiple <= 1 else math.ceil(value / multiple) * multiple


def _chunks(rows: list[_Row], size: int) -> list[list[_Row]]:
    """``rows`` split into ceil(n / size) near-equal consecutive chunks."""
    count = math.ceil(len(rows) / size)
    base, extra = divmod(len(rows), count)
    out, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        out.append(rows[start:end])
        start = end
    return out


MICRO_BATCH_OVERHEAD = 64
"""What one more forward/backward pass costs, in token positions: the fixed work of a pass (the
weight gradients of every layer are written whatever the number of tokens). Used to choose
between layouts."""


def _layout(
    chunk: list[_Row], share: bool, min_shared: int, pad_multiple: int
) -> tuple[list[_Row], int, int]:
    """``(chunk, shared prefix length, padded width of the rest)`` for one micro-batch."""
    prefix = _shared_prefix(chunk) if share and len(chunk) > 1 else 0
    if prefix < max(min_shared, 1):
        prefix = 0
    width = _round_up(max(len(r.inputs) for r in chunk) - prefix, pad_multiple)
    return chunk, prefix, width


def _cost(plan: list[tuple[list[_Row], int, int]]) -> int:
    return sum(prefix + len(chunk) * width + MICRO_BATCH_OVERHEAD for chunk, prefix, width in plan)


def _cheapest_plan(
    rows: list[_Row], size: int, share: bool, min_shared: int, pad_multiple: int
) -> list[tuple[list[_Row], int, int]]:
    """Split ``rows`` into micro-batches of at most ``size`` rows, the cheapest of three ways:

    - by prompt: rows in lexicographic order of their tokens, so that rows with a common
      beginning (a group's prompt; a system prompt or few-shot examples shared by every group)
      share it, and a micro-batch may hold several groups;
    - by group: each group's rows on their own (its whole prompt shared), groups never mixed;
    - by length: rows sorted by length, nothing shared, each micro-batch padded to its longest.
    """
    candidates = []
    by_prompt = sorted(rows, key=lambda r: r.inputs)
    candidates.append(
        [_layout(c, share, min_shared, pad_multiple) for c in _chunks(by_prompt, size)]
    )
    if share:
        groups: dict[int, list[_Row]] = {}
        for row in rows:
            groups.setdefault(row.group, []).append(row)
        candidates.append(
            [
                _layout(chunk, share, min_shared, pad_multiple)
                for group_rows in groups.values()
                for chunk in _chunks(group_rows, size)
            ]
        )
    by_length = sorted(rows, key=lambda r: len(r.inputs))
    candidates.append(
        [_layout(c, False, min_shared, pad_multiple) for c in _chunks(by_length, size)]
    )
    return min(candidates, key=_cost)


class _Trie:
    """A prefix tree of rows' input tokens, one node per token (see PackedLayout).

    Two rows share a node wherever their inputs agree up to and including that position: the
    model's output there is the same for both (it sees the same tokens), so it is computed
    once and each row reads its own label's log-probability from it. The gradient is the same
    as running the rows apart: a shared position collects the sum of its rows' gradients.
    """

    def __init__(self) -> None:
        self.children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        self.tokens: list[int] = []
        self.depth: list[int] = []
        self.parent: list[int] = []  # -1 for a row's first token
        self.paths: list[list[int]] = []

    def cost(self, row: _Row) -> int:
        """Tokens that adding ``row`` would add."""
        node = -1
        for shared, token in enumerate(row.inputs):
            child = self.children.get((node, token))
            if child is None:
                return len(row.inputs) - shared
            node = child
        return 0

    def add(self, row: _Row) -> None:
        node, path = -1, []
        for t, token in enumerate(row.inputs):
            child = self.children.get((node, token))
            if child is None:
                child = len(self.tokens)
                self.tokens.append(token)
                self.depth.append(t)
                self.parent.append(node)
                self.children[(node, token)] = child
            path.append(child)
            node = child
        self.paths.append(path)

    def __len__(self) -> int:
        return len(self.tokens)


def _pack(rows: list[_Row], trie: _Trie) -> MicroBatch:
    """One micro-batch running ``rows`` (added to ``trie`` in this order) as a single packed
    sequence (PackedLayout)."""
    size = len(trie)
    # A node sees itself and its ancestors (the earlier positions of every row through it):
    # causal attention along each path. Built a generation of ancestors at a time, in numpy
    # (no per-row tensor indexing: those small multi-threaded ops crawl when another process
    # keeps the cores busy).
    parent = np.asarray(trie.parent, dtype=np.int64)
    visible = np.zeros((size, size), dtype=np.bool_)
    nodes = np.arange(size)
    ancestors = nodes.copy()
    while nodes.size:
        visible[nodes, ancestors] = True
        ancestors = parent[ancestors]
        live = ancestors >= 0
        nodes, ancestors = nodes[live], ancestors[live]
    width = max(len(r.inputs) for r in rows)
    index = np.zeros((len(rows), width), dtype=np.int64)
    for i, path in enumerate(trie.paths):
        index[i, : len(path)] = path
    mb = _stack(rows, 0, width, None)
    mb.packed = PackedLayout(
        ids=torch.tensor(trie.tokens, dtype=torch.long),
        positions=torch.tensor(trie.depth, dtype=torch.long),
        visible=torch.from_numpy(visible),
        index=torch.from_numpy(index),
    )
    return mb


def _pack_plan(rows: list[_Row], budget: int) -> list[tuple[list[_Row], _Trie]]:
    """Rows in lexicographic order, cut into passes of at most ``budget`` packed tokens (a
    row longer than the budget gets a pass of its own); each pass with its prefix tree."""
    passes: list[tuple[list[_Row], _Trie]] = []
    current: list[_Row] = []
    trie = _Trie()
    for row in sorted(rows, key=lambda r: r.inputs):
        if current and len(trie) + trie.cost(row) > budget:
            passes.append((current, trie))
            current, trie = [], _Trie()
        trie.add(row)
        current.append(row)
    if current:
        passes.append((current, trie))
    return passes


def prepare_batch(
    batch: list[dict[str, Any]],
    micro_batch_size: int,
    *,
    share_prefix: bool = True,
    min_shared_prefix: int = 8,
    skip_zero_advantage: bool = False,
    pad_multiple: int = 8,
    upstream_padding: bool = False,
    pack_tokens: int = 0,
) -> TrainingBatch:
    """Turn the groups of one ``/batch`` reply into micro-batches (see the module docstring).

    Args:
        batch: the groups, as ``GET /batch`` returns them.
        micro_batch_size: most rows per micro-batch.
        share_prefix: run the untrained beginning the rows of a micro-batch have in common
            (a group's prompt, or a system prompt every group shares) once per micro-batch.
        min_shared_prefix: shortest common prompt (tokens) worth sharing.
        skip_zero_advantage: leave out rows whose advantage is 0 on every trained token (only
            correct when the loss has no term but the advantage-weighted one, i.e. no KL).
        pad_multiple: each micro-batch's length is rounded up to a multiple of this.
        upstream_padding: upstream's layout instead: one length for the whole batch (``L - 1``
            a multiple of 64), batch order kept, no sharing.
        pack_tokens: when > 0, rows run packed (:class:`PackedLayout`): no padding, every
            shared untrained beginning once per pass, passes of at most this many tokens;
            ``micro_batch_size``, ``share_prefix`` and ``pad_multiple`` then do not apply.
    """
    library_rows = rows_from_batch(batch)
    if not library_rows:
        raise ValueError("empty batch: no sequences to train on")
    rows = [_row(r, r.group) for r in library_rows]
    group_scores: list[list[float]] = [[] for _ in batch]
    for r in library_rows:
        group_scores[r.group].append(r.score)
    scores = [r.score for r in library_rows]
    versions = [group.get("policy_version") for group in batch]
    total_tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in library_rows)
    num_sequences = len(rows)
    num_tokens = sum(sum(1 for label in r.labels if label != -100) for r in rows)

    micro_batches: list[MicroBatch] = []
    if upstream_padding:
        width = padded_length(max(len(r.inputs) + 1 for r in rows)) - 1
        for start in range(0, len(rows), micro_batch_size):
            micro_batches.append(_stack(rows[start : start + micro_batch_size], 0, width, None))
        return TrainingBatch(
            micro_batches, num_sequences, num_tokens, total_tokens,
            sum(scores) / len(scores), 0, group_scores, versions,
        )  # fmt: skip

    kept = [r for r in rows if not (skip_zero_advantage and _no_signal(r))]
    skipped = num_sequences - len(kept)
    if kept and pack_tokens > 0:
        micro_batches = [_pack(chunk, trie) for chunk, trie in _pack_plan(kept, pack_tokens)]
    elif kept:
        plan = _cheapest_plan(kept, micro_batch_size, share_prefix, min_shared_prefix, pad_multiple)
        for chunk, prefix, width in plan:
            shared = chunk[0].inputs[:prefix] if prefix else None
            micro_batches.append(_stack(chunk, prefix, width, shared))
    return TrainingBatch(
        micro_batches=micro_batches,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        total_tokens=total_tokens,
        reward_mean=sum(scores) / len(scores),
        skipped_sequences=skipped,
        group_scores=group_scores,
        policy_versions=versions,
    )
