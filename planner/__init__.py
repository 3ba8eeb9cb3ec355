"""zinf's planner: decides which shards live in DRAM and which on NVMe, from measurements.

* :mod:`planner.costmodel` - ``seconds = latency_s + bytes / bandwidth_Bps`` per tier and
  direction, fitted robustly from the profiler's I/O samples (or ``zinf bench-io`` calibrations).

Layering: imports ``zinf`` (errors) and ``profiler`` (queries) only; the dashboard builds on it.
"""

from __future__ import annotations

from planner.costmodel import CostModel, CostModelError, IOSetting, TierCost, fit_latency_bandwidth

__all__ = ["CostModel", "CostModelError", "IOSetting", "TierCost", "fit_latency_bandwidth"]
