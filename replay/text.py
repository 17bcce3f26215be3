"""Text that is safe to print: ``replay`` shows request ids a client chose and
details of damaged or hostile input, so nothing it writes may drive the
terminal, and no field may flood it.

* :func:`escape` writes every control character (C0 but newline and tab, DEL,
  C1, and the Unicode bidirectional overrides that reorder what a line
  shows) as a visible ``\\xNN`` / ``\\uNNNN`` escape;
* :func:`cut` keeps the first ``max_chars`` of a long text and says how much
  it left out;
* :func:`field` does both, for one value inside a line (:data:`FIELD_CHARS_MAX`);
* :class:`SafeWriter` escapes everything written through it: ``replay.cli``
  wraps its output streams in one, so no subcommand can forget.
"""

from __future__ import annotations

import re
from typing import TextIO

FIELD_CHARS_MAX = 120  # one value (a request id, a repr) inside a line
DETAIL_CHARS_MAX = 400  # one damage or rejection detail

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_CONTROL_IN_FIELD = re.compile(
    "[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` with every control character but newline and tab made visible."""
    return _CONTROL.sub(_visible, text)


def cut(text: str, max_chars: int) -> str:
    """``text``, or its first ``max_chars`` characters and a count of the rest."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}...(+{len(text) - max_chars} chars)"


def field(value: object, max_chars: int = FIELD_CHARS_MAX) -> str:
    """One value for a line: every control character (newline and tab too)
    made visible, then cut to ``max_chars``."""
    return cut(_CONTROL_IN_FIELD.sub(_visible, str(value)), max_chars)


class SafeWriter:
    """A text stream that escapes (:func:`escape`) whatever is written to it."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(escape(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()
