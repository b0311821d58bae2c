"""``atropos-launch``: one run description, launched locally, on Ray or on Slurm.

* :mod:`~atroposlib.launch.spec`: the run description (YAML, pydantic; CONFIG.md documents it).
* :mod:`~atroposlib.launch.plan`: the run's components (commands with host/port placeholders).
* :mod:`~atroposlib.launch.orchestrator`: start in order, wait for health, supervise (restart
  failed environment workers within a budget), stop everything, final counts.
* Backends: :mod:`~atroposlib.launch.local` (processes here), ``ray_backend`` (actors placed
  by Ray), ``slurm`` (a generated batch script with one ``srun`` step per component).
"""

from atroposlib.launch.orchestrator import Backend, Run, RunFailed
from atroposlib.launch.plan import Component, RunPlan, plan_run
from atroposlib.launch.spec import RunSpec, RunSpecError, load_run_spec

__all__ = [
    "Backend",
    "Component",
    "Run",
    "RunFailed",
    "RunPlan",
    "RunSpec",
    "RunSpecError",
    "load_run_spec",
    "plan_run",
]
