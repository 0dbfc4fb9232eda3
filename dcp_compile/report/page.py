"""The page around a report: one self-contained HTML file (inline CSS and JS, nothing fetched).

A report is opened from disk, attached to an issue, or copied off a cluster with no network; it
must not load a stylesheet, a font or a script from anywhere. The script only toggles views
(expand/collapse all, hide a role) and marks the body ``data-rendered`` once it has run, so a
headless browser test can tell that the page's script ran without error.
"""

from __future__ import annotations

import html

from dcp_compile.report.graph_view import ROLE_LABELS, ROLES
from dcp_compile.report.pass_diff import DIFF_CSS

ROLE_COLOURS = {
    "token_local": "#cfe8ff",
    "attention": "#8fd18f",
    "sequence_mixing": "#ffd08a",
    "gathered": "#ff8a8a",
    "collective": "#c9a6ff",
    "source": "#b8f0f0",
    "token_set": "#f0d8f0",
    "replicated": "#e8e8e8",
}

_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 8px; } h2 { font-size: 17px; margin: 22px 0 6px; }
h3 { font-size: 15px; margin: 14px 0 4px; }
code, pre, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12px; }
.muted { color: #777; }
.summary { font-family: ui-monospace, monospace; font-size: 13px; padding: 6px 10px; margin: 4px 0;
           border-left: 6px solid #999; background: #f7f7f7; white-space: pre-wrap; }
.summary.ok { border-color: #2e9e44; } .summary.warn { border-color: #e0a100; } .summary.bad { border-color: #d62c2c; }
table.stats { border-collapse: collapse; margin: 6px 0; font-size: 13px; }
table.stats td, table.stats th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
.role { display: inline-block; padding: 0 5px; border-radius: 3px; font-size: 11px; margin: 1px 2px; }
details { margin: 2px 0 2px 14px; } summary { cursor: pointer; }
details.module > summary { font-size: 13px; }
.ops { margin: 2px 0 4px 18px; }
.op { display: inline-block; font-family: ui-monospace, monospace; font-size: 11px; padding: 1px 4px;
      margin: 1px; border-radius: 3px; border: 1px solid rgba(0,0,0,.08); }
.count { font-size: 11px; color: #555; margin-left: 6px; }
.badge { font-size: 11px; padding: 0 5px; border-radius: 8px; background: #d62c2c; color: white; margin-left: 6px; }
ul.findings li { margin: 3px 0; font-size: 13px; }
a.src { font-family: ui-monospace, monospace; font-size: 12px; }
.toolbar { margin: 8px 0; font-size: 13px; } .toolbar button { font-size: 12px; margin-right: 6px; }
.toolbar label { margin-right: 8px; }
section.graph { border-top: 2px solid #ccc; margin-top: 18px; }
svg text { font-family: system-ui, sans-serif; }
"""

_SCRIPT = """
(function () {
  function setAll(open) {
    document.querySelectorAll('details.module').forEach(function (d) { d.open = open; });
  }
  document.querySelectorAll('[data-action]').forEach(function (button) {
    button.addEventListener('click', function () { setAll(button.dataset.action === 'expand'); });
  });
  document.querySelectorAll('input[data-role]').forEach(function (box) {
    box.addEventListener('change', function () {
      document.body.classList.toggle('hide-' + box.dataset.role, !box.checked);
    });
  });
  document.body.dataset.rendered = '1';
})();
"""


def role_chip(role: str, text: str | None = None) -> str:
    colour = ROLE_COLOURS.get(role, "#eee")
    return f"<span class='role' style='background:{colour}'>{html.escape(text or ROLE_LABELS.get(role, role))}</span>"


def role_css() -> str:
    """Colour per role, and the rule that hides a role when its box is unticked."""
    rules = [f".op.r-{role} {{ background: {colour}; }}" for role, colour in ROLE_COLOURS.items()]
    rules += [f"body.hide-{role} .op.r-{role} {{ display: none; }}" for role in ROLES]
    return "\n".join(rules)


def legend_and_toolbar() -> str:
    boxes = "".join(
        f"<label><input type='checkbox' checked data-role='{role}'> {role_chip(role)}</label>" for role in ROLES)
    return (f"<div class='toolbar'><button data-action='expand'>expand all</button>"
            f"<button data-action='collapse'>collapse all</button> roles: {boxes}</div>")


def page(title: str, body: str) -> str:
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        f"<style>{_CSS}{role_css()}{DIFF_CSS}</style></head>\n<body>\n{body}\n"
        f"<script>{_SCRIPT}</script>\n</body></html>\n"
    )
