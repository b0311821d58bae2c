"""The trainer's side of the trajectory API: register, then pull batches.

The client lives in the library, :mod:`atroposlib.api.client` (also used by the data tools and
the viewer); these are its upstream-facing names for the example trainer. Requests carry the
key of ``run-api --api-key`` from the ``ATROPOS_API_KEY`` environment variable when it is set.
"""

from __future__ import annotations

from atroposlib.api.client import TrainerClient, TrajectoryAPIError

__all__ = ["TrainerAPIClient", "TrajectoryAPIError"]

#: The example trainer's name for :class:`atroposlib.api.client.TrainerClient`.
TrainerAPIClient = TrainerClient
