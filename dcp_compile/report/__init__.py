"""HTML reports: what DCP did to a model (:func:`save_model_report` of ``dcp.explain``'s record)
and a step's plan as a timeline (:func:`plan_html`). Self-contained pages: inline CSS and JS,
nothing fetched.

Imports point one way: this package reads records and plans; the compiler never imports it
(tests/test_import_graph.py), and this package imports neither the backend nor the scheduler.
"""

from __future__ import annotations

from dcp_compile.report.html_report import model_report_html, save_model_report
from dcp_compile.report.plan_chart import plan_html, plan_svg

__all__ = ["model_report_html", "plan_html", "plan_svg", "save_model_report"]
