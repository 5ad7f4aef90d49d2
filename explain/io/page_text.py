"""Text for the static HTML pages (the report, the concept atlas, the VLM token page): what UTF-8 can write, escaped."""

from __future__ import annotations

import html
import re

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""A character UTF-8 cannot write: half of a pair that is not one (``writable``)."""


def writable(text: str) -> str:
    """``text`` as UTF-8 can write it: a lone surrogate (a byte that is not UTF-8, as Python reads it from a command
    line or file name; a "\\udce9" of a JSON file) as a \\x or \\u escape, the rest unchanged."""
    return LONE_SURROGATE.sub(lambda match: _surrogate_text(match.group()), text)


def _surrogate_text(character: str) -> str:
    code = ord(character)
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"


def escaped(text: object) -> str:
    """``text`` as a page's text or attribute value: ``writable``, with &, <, > and quotes escaped."""
    return html.escape(writable(str(text)), quote=True)
