"""zinf's dashboard: figures (and, later, the FastAPI app and ``zinf report``) over the profile database.

* :mod:`dashboard.figures` - plotly figures built from :mod:`profiler.queries` DataFrames and a
  :class:`planner.CostModel`, shared by the live dashboard and the offline HTML report.

Layering: the top layer; imports ``planner``, ``profiler`` and ``zinf``, and nothing imports it.
"""

from __future__ import annotations

__all__ = ["figures"]
