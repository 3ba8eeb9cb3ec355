"""zinf's dashboard: the live web app and the offline HTML report over the profile database.

* :mod:`dashboard.figures` - plotly figures built from :mod:`profiler.queries` DataFrames and a
  :class:`planner.CostModel`, shared by the live dashboard and the offline HTML report.
* :mod:`dashboard.views` - which data each figure and table needs (``run_figures`` for the report,
  ``DashboardData`` with its cache for the app).
* :mod:`dashboard.app` (``create_app``), :mod:`dashboard.api` (JSON under ``/api``),
  :mod:`dashboard.pages` (HTML shells) - ``zinf dashboard``.
* :mod:`dashboard.report` - ``zinf report``: one self-contained HTML file plus ``plan.json``.

Layering: the top layer; imports ``planner``, ``profiler`` and ``zinf``, and nothing imports it.
"""

from __future__ import annotations

__all__ = ["figures"]
