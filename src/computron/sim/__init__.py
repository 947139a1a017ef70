"""Discrete-event simulation of the engine: the real ``EngineCore`` and ``Scheduler`` on a simulated
executor and a virtual clock. Imports no torch.

``simulate(trace, models, calibration, engine_config)`` → ``SimResult`` (per-request records and a
summary); ``SimExecutor`` (the executor protocol over modelled times), ``VirtualClock``,
``Calibration`` (the cost model, JSON load/save) and ``weight_bytes`` (a model's image bytes from its
config).
"""

from .clock import VirtualClock
from .costs import CPU_DEFAULT, Calibration
from .executor import SimExecutor, arena_capacity
from .layout import group_bytes, weight_bytes
from .run import Arrival, RequestRecord, SimResult, Simulation, simulate

__all__ = ["Arrival", "CPU_DEFAULT", "Calibration", "RequestRecord", "SimExecutor", "SimResult", "Simulation",
           "VirtualClock", "arena_capacity", "group_bytes", "simulate", "weight_bytes"]
