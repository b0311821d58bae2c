"""The trajectory API's routes, one router per concern: :mod:`.env` (what environments call),
:mod:`.trainer` (what trainers call), :mod:`.ops` (probes, metrics, reset)."""

from atroposlib.api.routers import env, ops, trainer

__all__ = ["env", "ops", "trainer"]
