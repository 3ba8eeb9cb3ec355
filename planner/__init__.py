"""zinf's planner: decides which shards live in DRAM and which on NVMe, from measurements.

* :mod:`planner.costmodel` - ``seconds = latency_s + bytes / bandwidth_Bps`` per tier and
  direction, fitted robustly from the profiler's I/O samples (or ``zinf bench-io`` calibrations).
* :mod:`planner.workload` - :class:`Workload`: the shards, their accesses per step, the compute
  and update seconds and the engine settings of one run (from a profile, or from plain numbers).
* :mod:`planner.hotness` - smoothed access rates (short and long EWMA, an ``unstable`` flag) and
  the linearised stall cost of each home on NVMe (seconds per step, per DRAM byte).
* :mod:`planner.simulator` - :func:`simulate`: the predicted step time of any placement (prefetch
  window, disk queue, optimizer pipeline, updates during backward), calibrated by :func:`calibrate`.
* :mod:`planner.solver` - :func:`solve`: the placement under a DRAM budget (greedy with
  re-simulation, or an exact MILP of the linear model).

Layering: imports ``zinf`` (core) and ``profiler`` (queries) only; the dashboard builds on it.
"""

from __future__ import annotations

from planner.costmodel import CostModel, CostModelError, IOSetting, TierCost, fit_latency_bandwidth
from planner.hotness import access_rates, stall_cost
from planner.simulator import Prediction, Simulator, calibrate, simulate
from planner.solver import Plan, PlanError, solve
from planner.workload import Workload, WorkloadError, home_dram_bytes

__all__ = [
    "CostModel", "CostModelError", "IOSetting", "TierCost", "fit_latency_bandwidth",
    "Workload", "WorkloadError", "home_dram_bytes",
    "access_rates", "stall_cost",
    "Prediction", "Simulator", "simulate", "calibrate",
    "Plan", "PlanError", "solve",
]
