"""Pure scheduling logic (no torch): queues, batching, residency. Drives the engine and the simulator."""

from .scheduler import POLICIES, Scheduler, SchedulerConfig
from .state import ModelState, SchedRequest, StepPlan

__all__ = ["POLICIES", "Scheduler", "SchedulerConfig", "ModelState", "SchedRequest", "StepPlan"]
