"""What a user reads when something is off: one-line warnings and one-line error texts."""

from __future__ import annotations

import sys


def one_line(message, limit: int = 0) -> str:
    """`message` (text or an exception) as a single line, so a user never gets a library's dump.

    An exception reads "TypeName: text"; runs of whitespace and line breaks become one space; with
    `limit`, text past that many characters is cut and marked with "...".
    """
    if isinstance(message, BaseException):
        text = str(message).strip()
        message = f"{type(message).__name__}: {text}" if text else type(message).__name__
    text = " ".join(str(message).split())
    if limit and len(text) > limit:
        text = text[: limit - 3].rstrip() + "..."
    return text


def warn(message: str) -> None:
    """Print one line "jaxgpt: warning: ..." on stderr (a warning the user should see, not a log entry)."""
    print(f"jaxgpt: warning: {one_line(message)}", file=sys.stderr, flush=True)
