"""HTML reports: what DCP did to a model (``ModelRecord.save_html``) and a step's plan as a
timeline (:func:`plan_html`). Self-contained pages: inline CSS and JS, nothing fetched.

Imports point one way: the compiler's records import this package only inside ``save_html``;
this package reads records and plans and imports neither the backend nor the scheduler.
"""

from __future__ import annotations

from dcp_compile.report.html_report import model_report_html, save_model_report
from dcp_compile.report.plan_chart import plan_html, plan_svg

__all__ = ["model_report_html", "plan_html", "plan_svg", "save_model_report"]
