"""The batched sampler: draws follow the shaped distribution and masked tokens never appear."""

from __future__ import annotations

import math

import torch

from atroposlib.inference.sampling import RowState, SamplingParams, probabilities, sample_next


def _row(params: SamplingParams, sample_index: int = 0) -> RowState:
    return RowState(
        params=params,
        generator=params.make_generator(sample_index),
        output_ids=[],
        prompt_ids=[],
        banned_until_min=[],
    )


def test_draws_match_softmax_frequencies() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.0, 0.6, 0.3]]))
    row = _row(SamplingParams(max_tokens=1, temperature=1.0, seed=7))
    counts = [0, 0, 0, 0]
    draws = 20_000
    for _ in range(draws):
        token, _ = sample_next(logits, [row])
        counts[int(token[0])] += 1
    assert counts[1] == 0, "a zero-probability token was sampled"
    for token, p in ((0, 0.1), (2, 0.6), (3, 0.3)):
        tolerance = 5 * math.sqrt(p * (1 - p) / draws)
        assert abs(counts[token] / draws - p) < tolerance


def test_top_k_and_top_p_exclude_tokens_in_a_mixed_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    rows = [
        _row(SamplingParams(max_tokens=1, temperature=1.0, top_k=3)),
        _row(SamplingParams(max_tokens=1, temperature=0.0)),
        _row(SamplingParams(max_tokens=1, temperature=2.0, top_p=0.05)),
        _row(SamplingParams(max_tokens=1, temperature=1.0, seed=3)),
    ]
    top3 = set(logits[0].topk(3).indices.tolist())
    sorted_probs, order = torch.softmax(logits[2] / 2.0, -1).sort(descending=True)
    nucleus = set(order[: int((sorted_probs.cumsum(0) - sorted_probs < 0.05).sum())].tolist())
    for _ in range(300):
        tokens, raw = sample_next(logits, rows)
        assert int(tokens[0]) in top3
        assert int(tokens[1]) == int(logits[1].argmax())
        assert int(tokens[2]) in nucleus
        # Reported log-probs stay the model's raw distribution, whatever shaped the draw.
        assert torch.allclose(raw, torch.log_softmax(logits, -1))


def test_seeded_rows_repeat_whatever_else_is_batched() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 500)
    seeded = SamplingParams(max_tokens=1, temperature=1.0, seed=42)

    def draws(batch_logits: torch.Tensor, position: int) -> list[int]:
        rows = [_row(SamplingParams(max_tokens=1)) for _ in range(batch_logits.shape[0])]
        rows[position] = _row(seeded)
        return [int(sample_next(batch_logits, rows)[0][position]) for _ in range(50)]

    alone = draws(logits[:1], 0)
    batched = draws(torch.cat([logits[1:], logits[:1]]), 2)
    assert alone == batched


def test_processed_logprobs_are_the_sampling_distribution() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 200)
    rows = [
        _row(SamplingParams(max_tokens=1, temperature=0.5)),
        _row(SamplingParams(max_tokens=1, temperature=0.0)),
        _row(SamplingParams(max_tokens=1, temperature=1.0, top_k=5)),
    ]
    tokens, processed = sample_next(logits, rows, processed=True)
    assert torch.allclose(processed[0], torch.log_softmax(logits[0] / 0.5, -1))
    assert torch.allclose(processed[1], torch.log_softmax(logits[1], -1))  # greedy: raw
    top5 = logits[2].topk(5).indices
    assert torch.isinf(processed[2]).sum() == 200 - 5  # outside the top-k: impossible
    assert torch.allclose(processed[2, top5], torch.log_softmax(logits[2, top5], -1))
    assert torch.isfinite(processed[torch.arange(3), tokens]).all()  # drawn tokens are possible


def test_processed_logprobs_when_every_row_is_sampled_alike() -> None:
    """The sampler's two shortcuts: at temperature 1 without filters the draw uses the raw
    log-softmax (processed = raw), and when every row is sampled the processed rows are
    returned without copying the raw ones; the figures are those of the general path."""
    torch.manual_seed(3)
    logits = torch.randn(4, 300)
    plain = [_row(SamplingParams(max_tokens=1, temperature=1.0, seed=i)) for i in range(4)]
    tokens, processed = sample_next(logits, plain, processed=True)
    assert torch.allclose(processed, torch.log_softmax(logits, -1))
    hot = [_row(SamplingParams(max_tokens=1, temperature=0.5, seed=i)) for i in range(4)]
    _, processed = sample_next(logits, hot, processed=True)
    assert torch.allclose(processed, torch.log_softmax(logits / 0.5, -1))
    # Seeded rows draw the same tokens again (one uniform number per row from its generator).
    again, _ = sample_next(logits, [_row(SamplingParams(max_tokens=1, seed=i)) for i in range(4)])
    assert torch.equal(tokens, again)


def test_probabilities_are_exp_with_the_underflow_set_to_zero() -> None:
    """``probabilities`` equals ``exp`` where float32 keeps a normal number, is exactly 0 below
    that (where ``exp`` would take its slow subnormal path) and for masked (-inf) tokens."""
    logprobs = torch.tensor([[0.0, -1.5, -40.0, -86.0, -87.5, -120.0, -1e4, float("-inf")]])
    probs = probabilities(logprobs)
    assert torch.equal(probs[0, :4], logprobs[0, :4].exp())
    assert probs[0, 4:].eq(0).all()
    assert probs.dtype == torch.float32


def test_low_temperature_draws_follow_the_sharpened_distribution() -> None:
    """At temperature 0.25 most of a 4,000-token vocabulary's log-probabilities lie below the
    float32 underflow; the draws still follow softmax(logits / T) over the tokens that carry
    mass, and tokens whose probability underflows are never drawn."""
    torch.manual_seed(4)
    logits = torch.randn(1, 4000) * 3 - 5
    logits[0, :3] = torch.tensor([20.0, 19.6, 19.0])
    row = _row(SamplingParams(max_tokens=1, temperature=0.25, seed=11))
    expected = torch.softmax(logits[0] / 0.25, -1)
    assert (torch.log_softmax(logits[0] / 0.25, -1) < -87).float().mean() > 0.5
    draws = 6_000
    counts = torch.zeros(4000)
    for _ in range(draws):
        token, processed = sample_next(logits, [row], processed=True)
        counts[int(token[0])] += 1
    assert torch.allclose(processed[0], torch.log_softmax(logits[0] / 0.25, -1))
    assert counts[3:].sum() == 0
    for token in range(3):
        p = float(expected[token])
        assert abs(counts[token] / draws - p) < 5 * math.sqrt(p * (1 - p) / draws)


def _nucleus_reference(scores: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, margin) of one row in float64 by a full sort: kept tokens, and how far each
    token's preceding mass lies from ``top_p`` (where float32 rounding may decide)."""
    values = scores.double()
    probs = torch.softmax(values, -1)
    sorted_probs, order = probs.sort(descending=True)
    before = torch.empty_like(probs).scatter_(0, order, sorted_probs.cumsum(0) - sorted_probs)
    return (before < top_p) & torch.isfinite(values), (before - top_p).abs()


def test_top_p_nucleus_without_sorting_the_vocabulary() -> None:
    """Top-p ranks only the most likely tokens (doubling how many until they hold top_p of the
    mass) and keeps exactly the nucleus a full sort finds, in peaked and flat rows, beside
    rows without top-p and with top-k; only a token whose preceding mass is within float32
    rounding of top_p may be decided either way."""
    torch.manual_seed(5)
    vocab = 6000
    logits = torch.randn(5, vocab) * torch.tensor([[6.0], [0.05], [2.0], [1.0], [3.0]])
    params = [
        SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9),  # peaked: a few tokens
        SamplingParams(max_tokens=1, temperature=1.0, top_p=0.95),  # flat: ~5,700 tokens
        SamplingParams(max_tokens=1, temperature=1.0),  # no top-p: all kept
        SamplingParams(max_tokens=1, temperature=1.0, top_k=400, top_p=0.5),
        SamplingParams(max_tokens=1, temperature=0.5, top_p=0.99),
    ]
    rows = [_row(p) for p in params]
    _, processed = sample_next(logits, rows, processed=True)
    kept = torch.isfinite(processed)
    assert kept[2].all()
    for i, p in enumerate(params):
        if p.top_p >= 1.0:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0:
            row = row.masked_fill(row < row.topk(p.top_k).values[-1], float("-inf"))
        expected, margin = _nucleus_reference(row, p.top_p)
        differs = kept[i] != expected
        assert (margin[differs] < 1e-5).all(), f"row {i}: {int(differs.sum())} tokens differ"
        assert int(expected.sum()) > 0
    assert int(kept[1].sum()) > 4000  # the flat row needed far more than the first 256 ranked
    assert int(kept[3].sum()) <= 400
    # every row with a small top-k: only those tokens are ranked and normalised
    small = [SamplingParams(max_tokens=1, temperature=1.0, top_k=50, top_p=p) for p in (0.3, 0.9)]
    _, processed = sample_next(logits[1:3], [_row(p) for p in small], processed=True)
    for i, p in enumerate(small):
        row = logits[1 + i]
        row = row.masked_fill(row < row.topk(50).values[-1], float("-inf"))
        expected, margin = _nucleus_reference(row, p.top_p)
        differs = torch.isfinite(processed[i]) != expected
        assert (margin[differs] < 1e-5).all()
        assert 0 < int(expected.sum()) <= 50


def test_min_p_keeps_tokens_at_least_min_p_of_the_most_likely() -> None:
    """min-p masks each token whose probability is under ``min_p`` times the row's largest,
    at a low temperature too (compared in log space, never through a float32 ``exp``)."""
    torch.manual_seed(6)
    logits = torch.randn(3, 2000) * 2
    params = [
        SamplingParams(max_tokens=1, temperature=1.0, min_p=0.1),
        SamplingParams(max_tokens=1, temperature=0.2, min_p=0.05),
        SamplingParams(max_tokens=1, temperature=1.0, min_p=0.0),
    ]
    _, processed = sample_next(logits, [_row(p) for p in params], processed=True)
    for i, p in enumerate(params):
        probs = torch.softmax(logits[i].double() / p.temperature, -1)
        expected = probs >= p.min_p * probs.max()
        assert torch.equal(torch.isfinite(processed[i]), expected)
    assert int(torch.isfinite(processed[0]).sum()) < 2000


def test_sampler_bench_runs_and_compares_a_copy_of_the_sampler() -> None:
    """``bench/sampler_bench.py`` at toy size, compared with the sampler's own file: every
    setting is timed and both copies draw the same tokens."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            str(root / "bench" / "sampler_bench.py"),
            "--rows",
            "4",
            "--repeats",
            "1",
            "--compare",
            str(root / "atroposlib" / "inference" / "sampling.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "ms" not in line]
    assert len(rows) == 8, done.stdout
    assert all(line.rstrip().endswith("| yes |") for line in rows), done.stdout
