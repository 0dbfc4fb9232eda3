"""A pass's effect as a side-by-side diff of its before/after graph code.

``PassRecord`` keeps each pass's graph as readable code (only while ``dcp.explain`` collects, or
with a debug dir). Reading two 2,000-line listings to find the 40 lines a pass changed is what a
diff is for; ``difflib.HtmlDiff`` gives a side-by-side table with only the changed regions.
"""

from __future__ import annotations

import difflib
import html
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dcp_compile.compiler.record import PassRecord

# HtmlDiff compares lines pairwise within changed blocks; past this many lines a plain unified
# diff is shown instead, so the report of a very large graph still renders in seconds.
SIDE_BY_SIDE_MAX_LINES = 6000

DIFF_CSS = """
table.diff { font-family: ui-monospace, monospace; font-size: 11px; border-collapse: collapse; width: 100%; }
table.diff td { padding: 0 4px; vertical-align: top; white-space: pre-wrap; word-break: break-all; }
table.diff th { background: #eee; }
.diff_header { background: #f3f3f3; color: #999; text-align: right; }
.diff_next { display: none; }
table.diff td:not(.diff_header):not(.diff_next) { width: 50%; }
.diff_header { width: 3em; }
.diff_add { background: #d4f7d4; }
.diff_chg { background: #fff2b3; }
.diff_sub { background: #ffd6d6; }
"""


def pass_diff_html(record: "PassRecord") -> str:
    """HTML for one pass: a side-by-side table of changed regions, or why there is none."""
    if record.before is None or record.after is None:
        return "<p class='muted'>no snapshot kept (graphs are kept while <code>dcp.explain</code> runs)</p>"
    before, after = record.before.splitlines(), record.after.splitlines()
    if before == after:
        return "<p class='muted'>the pass left the graph unchanged</p>"
    if len(before) + len(after) > SIDE_BY_SIDE_MAX_LINES:
        lines = difflib.unified_diff(before, after, "before", "after", n=2, lineterm="")
        return f"<pre class='unified'>{html.escape(chr(10).join(lines))}</pre>"
    return difflib.HtmlDiff(tabsize=4).make_table(
        before, after, f"before {record.name}", f"after {record.name}", context=True, numlines=2)


def changed_lines(record: "PassRecord") -> int:
    """Lines added or removed by the pass (0 when no snapshot was kept)."""
    if record.before is None or record.after is None:
        return 0
    diff = difflib.unified_diff(record.before.splitlines(), record.after.splitlines(), n=0, lineterm="")
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))
