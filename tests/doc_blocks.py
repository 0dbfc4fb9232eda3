"""The code blocks of README.md and docs/, read out of the Markdown exactly as written.

A test that documents a block calls :func:`doc_block` with the file and the heading the block sits
under and gets the block's text, byte for byte; it runs that text unchanged (``exec`` for Python,
``bash -c`` for shell). :func:`run_python_block` also checks the block's ``# needs:`` line: the
names the test binds must be exactly the names the block declares, no more, no fewer.

``tests/test_docs.py`` finds every ``doc_block(...)`` call in the tests and checks that each
Python or shell block of the docs is either one of them or followed by a line starting
``*Not run by the doc tests`` that says why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DOC_FILES = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("**/*.md")))
NOT_RUN = "*Not run by the doc tests"
RUN_LANGUAGES = ("python", "bash")

_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_HEADING = re.compile(r"^(#{1,6}) (.+?)\s*$", re.M)


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root
    heading: str  # the nearest heading above the block ("" before the first)
    index: int  # the block's position among the blocks under that heading, from 0
    language: str
    text: str  # the code, exactly as in the file (ends with a newline)
    after: str  # the file's text after the closing fence

    @property
    def key(self) -> tuple[str, str, int]:
        return self.file, self.heading, self.index

    @property
    def marked_not_run(self) -> bool:
        return self.after.lstrip("\n").startswith(NOT_RUN)

    @property
    def needs(self) -> set[str] | None:
        """The names in a first line ``# needs: a, b (what b is), c; more words``, or None."""
        first = self.text.split("\n", 1)[0]
        if not first.startswith("# needs:"):
            return None
        names = first[len("# needs:"):].split(";", 1)[0]
        while re.search(r"\([^()]*\)", names):
            names = re.sub(r"\([^()]*\)", "", names)
        return {name.strip() for name in names.split(",") if name.strip()}


def blocks(file: str) -> list[Block]:
    text = (REPO / file).read_text()
    found, counts = [], {}
    for match in _FENCE.finditer(text):
        headings = [h.group(2) for h in _HEADING.finditer(text, 0, match.start()) if not _inside_fence(text, h.start())]
        heading = headings[-1] if headings else ""
        index = counts.get(heading, 0)
        counts[heading] = index + 1
        found.append(Block(file, heading, index, match.group(1), match.group(2), text[match.end():]))
    return found


def _inside_fence(text: str, position: int) -> bool:
    return text.count("\n```", 0, position) % 2 == 1


def all_blocks() -> list[Block]:
    return [block for file in DOC_FILES for block in blocks(file)]


def doc_block(file: str, heading: str, index: int = 0) -> str:
    """The text of block ``index`` under ``heading`` in ``file``, exactly as written."""
    for block in blocks(file):
        if block.key == (file, heading, index):
            assert not block.marked_not_run, f"{block.key} is marked as not run"
            return block.text
    raise LookupError(f"no block {index} under heading {heading!r} in {file}")


def run_python_block(text: str, name: str, **fixtures: Any) -> dict[str, Any]:
    """``exec`` the block's text unchanged with ``fixtures`` as its globals; return them after.

    The fixtures must be exactly the names the block's ``# needs:`` line declares."""
    declared = Block("", "", 0, "python", text, "").needs or set()
    assert set(fixtures) == declared, f"{name}: the block declares {sorted(declared)}, the test binds {sorted(fixtures)}"
    namespace = dict(fixtures)
    exec(compile(text, name, "exec"), namespace)
    return namespace
