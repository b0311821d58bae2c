"""Sampling parameters and the batched sampler used by the generation engine.

Tokens are drawn as vLLM 0.32's sampler draws them, in its order: penalties (and the
``min_tokens`` ban), temperature, min-p, top-k (ties with the k-th logit kept), top-p (a token
stays while the mass strictly before it is below ``top_p``). Reported log-probabilities are of
that *processed* distribution (``--logprobs-mode processed_logprobs``, the default: what an RL
trainer's importance ratio needs, see ``docs/compat.md``) or of the model's raw one
(``raw_logprobs``, vLLM's default).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import torch

GREEDY_TEMPERATURE = 1e-5
"""Temperatures at or below this are treated as greedy decoding (argmax)."""

MAX_INT32 = 2**31 - 1
"""Upper bound of integer counts (``max_tokens``, ``top_k``): torch turns Python ints into
64-bit integers, and a value past that range would fail inside the batch, not at the request."""


class InvalidParamError(ValueError):
    """A sampling parameter out of its range; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check_range(name: str, value: int, low: int, high: int, why: str = "") -> None:
    if not low <= value <= high:
        raise InvalidParamError(name, f"{name} must be in [{low}, {high}]{why}, got {value}")


@dataclass
class SamplingParams:
    """How to generate the samples of one request (the subset of vLLM's parameters we serve)."""

    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    """None: no log-probs; 0: the sampled token's; k: the sampled token's and the top k."""
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def validate(self, max_n: int, max_logprobs: int, vocab_size: int | None = None) -> None:
        """Raise :class:`InvalidParamError` (reported as HTTP 400, naming the field) for values no
        backend would accept: out of range, not finite, or token ids outside ``vocab_size``."""
        floats = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        for name, value in floats.items():
            if not math.isfinite(value):
                raise InvalidParamError(name, f"{name} must be a finite number, got {value}")
        _check_range("n", self.n, 1, max_n, " (the server's --max-concurrency)")
        _check_range("max_tokens", self.max_tokens, 1, MAX_INT32)
        if self.temperature < 0:
            raise InvalidParamError(
                "temperature", f"temperature must be non-negative, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1:
            _check_range("top_k", self.top_k, 0, MAX_INT32, "; -1 disables it")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check_range("min_tokens", self.min_tokens, 0, self.max_tokens, " (max_tokens)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= floats[name] <= 2.0:
                raise InvalidParamError(name, f"{name} must be in [-2, 2], got {floats[name]}")
        if self.repetition_penalty <= 0:
            raise InvalidParamError(
                "repetition_penalty",
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
            )
        if self.seed is not None:
            _check_range("seed", self.seed, -(2**63), 2**64 - 1)
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None:
                _check_range(name, value, 0, max_logprobs)
        if any(not s for s in self.stop):
            raise InvalidParamError("stop", "stop strings must not be empty")
        if vocab_size is not None:
            for token in self.stop_token_ids:
                _check_range("stop_token_ids", token, 0, vocab_size - 1, " (the vocabulary)")

    @property
    def greedy(self) -> bool:
        """Whether this request decodes by argmax."""
        return self.temperature <= GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        """Whether any repetition-style penalty changes the sampling distribution."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def make_generator(self, sample_index: int) -> torch.Generator:
        """A private random stream per sample: seeded requests repeat, whatever else is batched."""
        seed = self.seed + sample_index if self.seed is not None else secrets.randbits(63)
        generator = torch.Generator()
        generator.manual_seed(seed % (2**63))
        return generator


@dataclass
class RowState:
    """What the sampler needs to know about one sequence in the batch."""

    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int]
    prompt_ids: list[int]
    banned_until_min: list[int]
    """Token ids (EOS, stop ids) that may not be sampled until ``min_tokens`` are out."""


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
"""What reported log-probabilities are of (vLLM's ``--logprobs-mode`` names): the model's own
distribution, or the one tokens were drawn from (after penalties, temperature, top-k, top-p,
min-p), which is what an RL trainer's importance ratio needs at a temperature other than 1."""


def sample_next(
    logits: torch.Tensor, rows: list[RowState], *, processed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from ``logits`` ([batch, vocab], raw model output).

    Returns ``(token_ids, logprobs)``: the sampled ids ([batch]) and the log-softmax
    ([batch, vocab]) that reported log-probs are read from: of the raw logits, or with
    ``processed`` of the distribution each sampled row was drawn from (greedy rows keep the
    raw one).
    """
    logits = logits.float()
    batch = logits.shape[0]
    chosen = torch.empty(batch, dtype=torch.long)

    shaped = logits
    copied = False
    for i, row in enumerate(rows):
        params = row.params
        if params.needs_penalties or (
            row.banned_until_min and len(row.output_ids) < params.min_tokens
        ):
            if not copied:
                shaped = logits.clone()
                copied = True
            _apply_penalties(shaped[i], row)

    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    every_row = len(sampled) == batch
    if greedy:
        if not sampled:
            chosen = shaped.argmax(dim=-1)
        else:
            index = torch.tensor(greedy, dtype=torch.long)
            chosen[index] = shaped[index].argmax(dim=-1)
    if not sampled:
        return chosen, torch.log_softmax(logits, dim=-1)

    index = torch.tensor(sampled, dtype=torch.long)
    top_ks = [rows[i].params.top_k for i in sampled]
    top_ps = [rows[i].params.top_p for i in sampled]
    min_ps = [rows[i].params.min_p for i in sampled]
    temps_list = [rows[i].params.temperature for i in sampled]
    generators = [rows[i].generator for i in sampled]
    if (
        not copied
        and all(t == 1.0 for t in temps_list)
        and all(k <= 0 for k in top_ks)
        and all(p >= 1.0 for p in top_ps)
        and all(p <= 0.0 for p in min_ps)
    ):
        # Nothing reshapes the distribution (temperature 1, no filters or penalties): the
        # tokens are drawn from the model's own log-softmax, computed once.
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        logprobs = raw_logprobs if every_row else raw_logprobs[index]
        chosen[index] = _inverse_cdf_sample(probabilities(logprobs), generators)
        return chosen, raw_logprobs

    temps = torch.tensor(temps_list, dtype=torch.float32)
    scores = (shaped if every_row else shaped[index]) / temps[:, None]
    # vLLM's order: min-p (an argmax-invariant logits processor) before top-k and top-p; the
    # order matters when top-p meets min-p (the nucleus is taken of what min-p left)
    if any(p > 0.0 for p in min_ps):
        # p < min_p * p_max, compared in log space: s - s_max < log(min_p) (no exp, which at
        # low temperatures takes float32's slow subnormal path; min_p 0 masks nothing)
        floor = torch.tensor([math.log(p) if p > 0.0 else -math.inf for p in min_ps])
        gap = scores - scores.max(dim=-1, keepdim=True).values
        scores = scores.masked_fill(gap < floor[:, None], float("-inf"))
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        scores = _top_k_top_p(scores, top_ks, top_ps)
    logprobs = torch.log_softmax(scores, dim=-1)
    chosen[index] = _inverse_cdf_sample(probabilities(logprobs), generators)
    if processed and every_row:
        return chosen, logprobs
    # the raw distribution only where it is reported: every row without processed, the
    # greedy rows beside the sampled ones with it
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    if processed:
        raw_logprobs[index] = logprobs
    return chosen, raw_logprobs


#: ``exp`` of anything below this is under float32's smallest normal number (1.18e-38).
_EXP_FLOOR = -87.0
#: Probabilities at or under this (``exp(-86.5)``, 2.7e-38) are taken as 0.
_PROBABILITY_FLOOR = math.exp(-86.5)


def probabilities(logprobs: torch.Tensor) -> torch.Tensor:
    """``logprobs.exp()`` (float32), with probabilities under 2.7e-38 set to exactly 0.

    At low temperatures most of a row's log-probabilities lie far below -87, where float32's
    ``exp`` underflows into subnormal numbers and the vectorised CPU kernel takes a slow path:
    at temperature 0.3 over 128 rows of SmolLM2's 49,152-token vocabulary, ``exp`` took 41 ms
    against 4 ms for clamping first (``bench/README.md``, "Sampling at low temperature").
    Such a token cannot be drawn anyway (a uniform draw's resolution is 2**-24 of the mass),
    and the tokens top-k/top-p/min-p masked (-inf) stay exactly 0.
    """
    probs = logprobs.clamp(min=_EXP_FLOOR).exp_()
    return torch.nn.functional.threshold_(probs, _PROBABILITY_FLOOR, 0.0)


def _inverse_cdf_sample(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One draw per row of ``probs`` ([rows, vocab]) by inverting the cumulative distribution.

    Each row takes a single uniform number from its own generator (so seeded requests repeat
    whatever else is in the batch), and the search is one vectorised ``searchsorted``: about 30x
    cheaper on CPU than a ``torch.multinomial`` call per row, which draws vocabulary-sized noise.
    ``right=True`` returns the first index whose cumulative mass exceeds the draw, so a token
    with zero probability (masked by top-k/top-p/min-p) can never be chosen.
    """
    cdf = probs.cumsum(dim=-1)
    uniform = torch.stack([torch.rand((), generator=g) for g in generators])
    target = (uniform * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True)[:, 0]
    return picked.clamp_(max=probs.shape[-1] - 1)


def _apply_penalties(scores: torch.Tensor, row: RowState) -> None:
    """Penalise repeats (vLLM semantics) and ban end tokens before ``min_tokens``, in place."""
    params = row.params
    if row.banned_until_min and len(row.output_ids) < params.min_tokens:
        scores[row.banned_until_min] = float("-inf")
    if not params.needs_penalties:
        return
    if params.repetition_penalty != 1.0:
        # Like vLLM, repetition penalty covers prompt and output tokens.
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long)
        if len(seen):
            values = scores[seen]
            scores[seen] = torch.where(
                values > 0, values / params.repetition_penalty, values * params.repetition_penalty
            )
    if row.output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(row.output_ids, dtype=torch.long).unique(return_counts=True)
        scores[ids] -= params.frequency_penalty * counts.float() + params.presence_penalty


#: Tokens ranked first when looking for a top-p nucleus (a row whose nucleus is wider is
#: sorted in full).
_NUCLEUS_START = 256


def _top_k_top_p(scores: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf, as vLLM's
    ``apply_top_k_top_p_pytorch``: top-k keeps every logit at least the k-th largest (ties
    included); top-p then keeps, of what top-k left, each token whose mass strictly before it
    (in descending order) is below ``top_p``, so the most likely token always stays.

    The nucleus is found without sorting the whole vocabulary where it can be: what top-k
    kept is ranked (only those can stay), or else the 256 most likely tokens; every token
    after them is cut when they hold ``top_p`` of the row's mass (the mass before such a token
    is at least that). Only the rows whose nucleus is wider (a flat distribution) are sorted
    in full. The ranked tokens' cumulative sums are those a full sort gives; tied logits at
    the boundary may be ranked in another order (as between sorts).
    """
    vocab = scores.shape[-1]
    ks = [min(k, vocab) if k > 0 else vocab for k in top_ks]
    if any(k < vocab for k in ks):
        kth = scores.topk(max(ks), dim=-1).values.gather(1, torch.tensor(ks)[:, None] - 1)
        off = torch.tensor([k >= vocab for k in ks])[:, None]
        scores = scores.masked_fill((scores < kth) & ~off, float("-inf"))
    nucleus = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not nucleus:
        return scores
    # rows without top-p (1.0) keep everything, even where the cumulative sum rounds to 1
    index = torch.tensor(nucleus, dtype=torch.long)
    every_row = len(nucleus) == len(top_ps)
    part = scores if every_row else scores[index]
    ps = torch.tensor([top_ps[i] for i in nucleus], dtype=torch.float32)[:, None]
    kept = int(torch.isfinite(part).sum(dim=-1).max())
    if kept <= _NUCLEUS_START:
        # every token that can stay is ranked: normalise over those alone
        ranked, order = part.topk(kept, dim=-1)
        probs = probabilities(torch.log_softmax(ranked, dim=-1))
        masked = _cut_nucleus(ranked, order, probs, ps, vocab)
    else:
        logprobs = torch.log_softmax(part, dim=-1)
        ranked, order = part.topk(_NUCLEUS_START, dim=-1)
        top = probabilities(logprobs.gather(-1, order))
        masked = _cut_nucleus(ranked, order, top, ps, vocab)
        # rows whose 256 most likely tokens hold less than top_p: sorted in full instead
        rows = (top.sum(dim=-1, keepdim=True) < ps)[:, 0].nonzero()[:, 0]
        if len(rows):
            ranked, order = part[rows].sort(dim=-1, descending=True)
            top = probabilities(logprobs[rows].gather(-1, order))
            masked[rows] = _cut_nucleus(ranked, order, top, ps[rows], vocab)
    if every_row:
        return masked
    scores = scores.clone()
    scores[index] = masked
    return scores


def _cut_nucleus(
    ranked: torch.Tensor, order: torch.Tensor, probs: torch.Tensor, ps: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Rows of ``vocab`` logits holding ``ranked`` (logits in descending order, at ``order``)
    where the mass before a token (``probs``, the ranked tokens' probabilities) is below
    ``ps``, and -inf everywhere else."""
    cut = (probs.cumsum(dim=-1) - probs) >= ps
    kept = ranked.masked_fill(cut, float("-inf"))
    masked = torch.full((ranked.shape[0], vocab), float("-inf"), dtype=ranked.dtype)
    return masked.scatter_(-1, order, kept)
