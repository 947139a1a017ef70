"""Pure scheduling logic (no torch): queues, batching, the per-device memory model and residency.

The ``Scheduler`` is driven by the engine core; it never imports torch, so a simulation can drive it too.
"""

from .scheduler import POLICIES, Bound, Scheduler, SchedulerConfig
from .slo import ModelCost, Slo
from .state import LOADING, OFFLOADED, RESIDENT, Batch, ModelState, SchedRequest, SharedPrefix, StepPlan

__all__ = ["POLICIES", "Bound", "Scheduler", "SchedulerConfig", "Batch", "ModelState", "SchedRequest", "StepPlan",
           "LOADING", "OFFLOADED", "RESIDENT", "SharedPrefix", "ModelCost", "Slo"]
