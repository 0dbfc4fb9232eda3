"""``dcp.report``: what DCP did. HTML reports of a model (:func:`save_model_report` of
``dcp.explain``'s record) and of a step's plan as a timeline (:func:`plan_html`), self-contained
pages (inline CSS and JS, nothing fetched); :func:`recording` (a context manager that collects the
record of the compiled graphs run inside it) and :func:`sharding_summary` (that record as text:
how many graphs ran and why, what each sharded or gathered).

Imports point one way: this package reads records and plans; the compiler never imports it
(tests/test_import_graph.py), and this package imports neither the backend nor the scheduler.
"""

from __future__ import annotations

from dcp_compile.lazy_exports import lazy_getattr

from dcp_compile.report.html_report import model_report_html, save_model_report
from dcp_compile.report.plan_chart import plan_html, plan_svg

# read from the compiler's records on first use (the compiler never imports this package)
_EXPORTS = {
    "recording": "dcp_compile.compiler.inspection",
    "sharding_summary": "dcp_compile.compiler.sharding_summary",
}

__all__ = ["model_report_html", "plan_html", "plan_svg", "recording", "save_model_report", "sharding_summary"]


__getattr__ = lazy_getattr(__name__, _EXPORTS)
