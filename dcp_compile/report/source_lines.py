"""Which line of the user's model produced an op: read from Dynamo's ``stack_trace``.

A gather's reason says *what* mixes the sequence; the user also needs *where* in their code it is.
Dynamo keeps, on every node, the Python stack of the traced call; its innermost frame is the
model's own line (``File "model.py", line 132, in forward`` then the code).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n(?P<code>[^\n]*)')


@dataclass(frozen=True)
class SourceLine:
    file: str
    line: int
    function: str
    code: str

    @property
    def uri(self) -> str:
        """A link an editor or browser opens at the file (``file://``; line as a fragment)."""
        path = Path(self.file)
        return (path.as_uri() if path.is_absolute() else self.file) + f"#L{self.line}"

    @property
    def short(self) -> str:
        return f"{Path(self.file).name}:{self.line} in {self.function}"


def source_line(stack_trace: str | None) -> SourceLine | None:
    """The innermost frame of ``stack_trace`` (the line that made the op), or None."""
    if not stack_trace:
        return None
    frames = list(_FRAME.finditer(stack_trace))
    if not frames:
        return None
    last = frames[-1]
    return SourceLine(last["file"], int(last["line"]), last["function"], last["code"].strip())
