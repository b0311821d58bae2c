"""Advantage helpers for GRPO-style training (same names, signatures and results as upstream).

Small deliberate differences from upstream Atropos 0.4:

* ``compute_stats`` accepts any nesting of lists, tuples and numpy arrays and numpy scalars
  (upstream only lists and Python ``int``/``float``), rejects booleans and strings with a clear
  error, and computes the variance in two passes so it is never negative from rounding.
* ``compute_discounted_returns`` always returns floats: an integer array no longer truncates the
  returns to integers, and lists become ``float64`` (upstream: ``float32``).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

number = int | float
"""A plain number (as ``atroposlib.type_definitions.number``)."""

NumpyArrayLike = np.ndarray | Sequence[np.ndarray] | Sequence[Sequence]
BoolVector = np.ndarray
"""A 1-D numpy array of bools."""

__all__ = [
    "BoolVector",
    "NumpyArrayLike",
    "allclose_to_first",
    "compute_discounted_returns",
    "compute_grpo_process_supervision_advantages",
    "compute_stats",
    "number",
]


def allclose_to_first(
    values: NumpyArrayLike,
    rtol: float = 1e-05,
    atol: float = 1e-08,
    equal_nan: bool = False,
    return_vector: bool = False,
) -> BoolVector | bool:
    """Whether every entry of ``values`` is close to the first one, ``values[0]``.

    Args:
        values: A rectangular (not necessarily 2-D) nested sequence or array; its first axis
            enumerates the entries to compare.
        rtol: Relative tolerance (as :func:`numpy.isclose`).
        atol: Absolute tolerance.
        equal_nan: Treat NaNs in the same position as equal.
        return_vector: Return one bool per entry instead of a single bool.

    Returns:
        ``True`` if all entries are close to the first (a Python ``bool``), or with
        ``return_vector`` a 1-D bool array whose first element is always ``True``.

    Raises:
        ValueError: ``values`` is empty.
    """
    arr = values if isinstance(values, np.ndarray) else np.asarray(values)
    if arr.ndim == 0 or arr.shape[0] == 0:
        raise ValueError("allclose_to_first needs at least one entry")
    is_close = np.isclose(arr, arr[0], rtol=rtol, atol=atol, equal_nan=equal_nan)
    # One verdict per entry: all of its elements (every axis after the first) must be close.
    vector = np.all(is_close.reshape(is_close.shape[0], -1), axis=1)
    return vector if return_vector else bool(np.all(vector))


def _flatten_numbers(data: object, out: list[float]) -> None:
    if isinstance(data, (bool, np.bool_)):
        raise ValueError(f"Invalid element type encountered: {type(data)}")
    if isinstance(data, numbers.Real):
        out.append(float(data))
        return
    if isinstance(data, np.ndarray):
        if data.dtype == np.bool_ or not np.issubdtype(data.dtype, np.number):
            if data.dtype != object:
                raise ValueError(f"Invalid element type encountered: array of {data.dtype}")
            for item in data.ravel():
                _flatten_numbers(item, out)
            return
        out.extend(data.astype(np.float64).ravel().tolist())
        return
    if isinstance(data, (list, tuple)):
        for item in data:
            _flatten_numbers(item, out)
        return
    raise ValueError(f"Invalid element type encountered: {type(data)}")


def compute_stats(data: Sequence[number | Sequence]) -> dict[str, float]:
    """Mean and (population) variance of all numbers in a possibly jagged nested list.

    Args:
        data: Numbers nested in lists, tuples or numpy arrays to any depth, e.g.
            ``[[1, 2], [3], [[4, 5]]]``.

    Returns:
        ``{"mean": float, "var": float}`` over the flattened numbers.

    Raises:
        ValueError: There are no numbers at all, or an element is not a number or a sequence.
    """
    flat: list[float] = []
    _flatten_numbers(data, flat)
    if not flat:
        raise ValueError("No numerical elements found in the input data.")
    values = np.asarray(flat, dtype=np.float64)
    mean = float(values.mean())
    var = float(np.mean((values - mean) ** 2))
    return {"mean": mean, "var": var}


def compute_discounted_returns(rewards: np.ndarray | Sequence[number], gamma: float) -> np.ndarray:
    """Discounted return at every step of a 1-D reward vector.

    ``G_t = rewards[t] + gamma * rewards[t + 1] + gamma**2 * rewards[t + 2] + ...``

    Args:
        rewards: A 1-D list or array of rewards.
        gamma: The discount factor (normally in ``[0, 1]``).

    Returns:
        A float array of the same length as ``rewards`` (same float dtype as a float input array,
        else ``float64``).
    """
    arr = np.asarray(rewards)
    if not np.issubdtype(arr.dtype, np.floating):
        arr = arr.astype(np.float64)
    returns = np.empty_like(arr)
    running = 0.0
    for t in range(len(arr) - 1, -1, -1):
        running = arr[t] + gamma * running
        returns[t] = running
    return returns


def compute_grpo_process_supervision_advantages(
    rewards: Sequence[Sequence[number]],
    gamma: float | None = None,
    std_tol: float = 1e-8,
) -> list[np.ndarray]:
    """GRPO advantages for process supervision from per-step rewards of several trajectories.

    All rewards (the trajectories may differ in length) are normalised by their joint mean and
    standard deviation; then each trajectory's advantage at a step is the sum of its normalised
    rewards from that step on (``gamma=None``) or their discounted return (``gamma`` given).

    Args:
        rewards: One list of per-step rewards per trajectory.
        gamma: Discount factor, or ``None`` for an undiscounted reverse cumulative sum.
        std_tol: Smallest acceptable standard deviation of the flattened rewards.

    Returns:
        One float array of advantages per trajectory, each as long as its rewards.

    Raises:
        ValueError: The standard deviation of the flattened rewards is below ``std_tol`` (e.g. all
            rewards equal), or there are no rewards.
    """
    stats = compute_stats(rewards)
    mean = stats["mean"]
    std = stats["var"] ** 0.5
    if std < std_tol:
        raise ValueError(f"`std` is smaller than tolerance of {std_tol}.")

    normalized = [(np.asarray(traj, dtype=np.float64) - mean) / std for traj in rewards]
    if gamma is None:
        return [np.flip(np.cumsum(np.flip(traj, axis=0), axis=0), axis=0) for traj in normalized]
    return [compute_discounted_returns(traj, gamma) for traj in normalized]
