"""``atroposlib.utils.advantages``: results match upstream Atropos 0.4.

The expected values below were produced by upstream ``atroposlib==0.4.0`` on the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atroposlib.utils.advantages import (
    allclose_to_first,
    compute_discounted_returns,
    compute_grpo_process_supervision_advantages,
    compute_stats,
)


def test_allclose_to_first_vector_and_bool() -> None:
    vec = allclose_to_first([[1, 2], [1, 2.0000001], [1, 3]], return_vector=True)
    assert isinstance(vec, np.ndarray)
    assert vec.tolist() == [True, True, False]
    result = allclose_to_first([[1, 2], [1, 2.0000001]])
    assert result is True
    assert allclose_to_first([[1, 2], [1, 3]]) is False


def test_allclose_to_first_higher_rank_nan_and_tolerances() -> None:
    arr = np.array([[[1, 2], [3, 4]], [[1, 2], [3, 4]], [[1, 2], [3, 5]]])
    assert allclose_to_first(arr, return_vector=True).tolist() == [True, True, False]
    nan = [[np.nan, 1], [np.nan, 1]]
    assert allclose_to_first(nan, equal_nan=True) is True
    assert allclose_to_first(nan) is False
    assert allclose_to_first([[1.0], [1.1]], rtol=0.2, return_vector=True).tolist() == [True, True]
    assert allclose_to_first([[1.0], [1.1]], atol=0.05) is False
    # A 1-D input compares scalars.
    assert allclose_to_first([3.0, 3.0, 3.0]) is True


def test_allclose_to_first_empty_raises() -> None:
    with pytest.raises(ValueError):
        allclose_to_first([])


def test_compute_stats_matches_upstream() -> None:
    stats = compute_stats([[1, 2], [3], [4.5, [5, 6]]])
    assert stats["mean"] == pytest.approx(3.5833333333333335, rel=1e-12)
    assert stats["var"] == pytest.approx(3.0347222222222214, rel=1e-12)
    assert compute_stats([1.5, 2.5]) == {"mean": 2.0, "var": 0.25}


def test_compute_stats_accepts_tuples_arrays_and_numpy_scalars() -> None:
    stats = compute_stats([(1, 2), np.array([3.0]), [np.float32(4.5), [np.int64(5), 6]]])
    assert stats["mean"] == pytest.approx((1 + 2 + 3 + 4.5 + 5 + 6) / 6)


@pytest.mark.parametrize("bad", [[], [[], []], [[1], ["a"]], [True, 1.0], [None]])
def test_compute_stats_rejects(bad: list) -> None:
    with pytest.raises(ValueError):
        compute_stats(bad)


def test_compute_stats_variance_never_negative() -> None:
    stats = compute_stats([0.1] * 1000)
    assert stats["var"] >= 0.0
    assert stats["var"] == pytest.approx(0.0, abs=1e-20)


def test_compute_discounted_returns_matches_upstream() -> None:
    out = compute_discounted_returns([1, 2, 3, 4], 0.9)
    np.testing.assert_allclose(out, [8.146, 7.9399996, 6.6, 4.0], rtol=1e-6)
    out = compute_discounted_returns(np.array([1.0, 0.0, -1.0, 2.0]), 0.5)
    np.testing.assert_array_equal(out, [1.0, 0.0, 0.0, 2.0])
    assert out.dtype == np.float64


def test_compute_discounted_returns_int_array_not_truncated() -> None:
    out = compute_discounted_returns(np.array([1, 1]), 0.5)
    np.testing.assert_allclose(out, [1.5, 1.0])
    assert compute_discounted_returns([], 0.9).shape == (0,)


def test_grpo_advantages_match_upstream() -> None:
    rewards = [[1, 2, 3], [0, 1], [4]]
    expected_cumsum = [
        [0.3721042037676253, 0.9922778767136674, 0.868243142124459],
        [-1.9845557534273346, -0.6201736729460421],
        [1.6124515496597098],
    ]
    expected_discounted = [
        [0.1947345333050573, 0.9054535625012216, 0.868243142124459],
        [-1.9225383861327305, -0.6201736729460421],
        [1.6124515496597098],
    ]
    for got, want in zip(
        compute_grpo_process_supervision_advantages(rewards), expected_cumsum, strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    got_all = compute_grpo_process_supervision_advantages(rewards, gamma=0.9)
    for got, want in zip(got_all, expected_discounted, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    got_all = compute_grpo_process_supervision_advantages(
        [[0.5, -1.0], [2.0, 0.0, 1.0, 3.0]], gamma=0.5
    )
    expected = [
        [-1.0541463322499007, -1.4694160994998617],
        [0.6947782644374348, -0.27152254012497434, 0.8624833627499191, 1.59719141249985],
    ]
    for got, want in zip(got_all, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_grpo_advantages_constant_rewards_raise() -> None:
    with pytest.raises(ValueError, match="tolerance"):
        compute_grpo_process_supervision_advantages([[1, 1], [1]])


jagged = st.lists(
    st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=6),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(jagged)
def test_grpo_advantages_properties(rewards: list[list[float]]) -> None:
    flat = np.array([r for traj in rewards for r in traj])
    if flat.std() < 1e-6:
        with pytest.raises(ValueError):
            compute_grpo_process_supervision_advantages(rewards, std_tol=1e-6)
        return
    adv = compute_grpo_process_supervision_advantages(rewards, std_tol=1e-6)
    normed = [(np.array(t) - flat.mean()) / flat.std() for t in rewards]
    for a, n in zip(adv, normed, strict=True):
        assert a.shape == n.shape
        # The reverse cumulative sum of normalised rewards: a[t] - a[t+1] == n[t].
        np.testing.assert_allclose(np.append(a[:-1] - a[1:], a[-1]), n, rtol=1e-7, atol=1e-7)
    # gamma == 1 equals the undiscounted version.
    adv1 = compute_grpo_process_supervision_advantages(rewards, gamma=1.0, std_tol=1e-6)
    for a, b in zip(adv, adv1, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-7)
