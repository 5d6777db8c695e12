"""Held-out text: CPython's IDLE documentation, which ships inside every CPython built from source (python.org,
pyenv, uv's standalone builds) as ``idlelib/`` and which vToken never read before its held-out suites.

The tuning suite (``needles.py``) reads the standard library's docstrings, and ``vtoken/texts.py`` (the other
benchmarks' prompts) licences and the ``pydoc_data`` topics; none of them overlaps these files. Two genres:

  manual()         the IDLE manual (``help.html`` as plain text): menus and features, one per line, no numbers
                   longer than four digits, so a 7-digit needle value is never confused with the haystack
  release_notes()  IDLE's release notes (``NEWS.txt``, ``NEWS2x.txt``, ``HISTORY.txt``): short entries, each
                   about one change, with issue numbers and names of modules and features

The files change between Python releases, so every result carries ``digest()`` of the text it used.
"""

from __future__ import annotations

import functools
import hashlib
import re
from html.parser import HTMLParser
from pathlib import Path

NOTES = ("NEWS.txt", "NEWS2x.txt", "HISTORY.txt")


def folder() -> Path:
    try:
        import idlelib
    except ImportError as e:  # Debian's system python3 ships idlelib in a separate package (idle-python3.x)
        hint = "on Debian: apt-get install idle-python3.X, or use a CPython built from source"
        raise FileNotFoundError(
            f"the held-out suites read CPython's idlelib documentation, which this Python lacks ({hint})"
        ) from e
    return Path(idlelib.__file__).parent


class _Text(HTMLParser):
    """help.html's visible text, a line per block element (script and style dropped)."""

    BLOCKS = {"p", "li", "h1", "h2", "h3", "h4", "dt", "dd", "div", "br", "pre", "tr"}

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag, attrs) -> None:
        self.hidden += tag in ("script", "style")
        if tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag) -> None:
        self.hidden -= tag in ("script", "style")

    def handle_data(self, data) -> None:
        if not self.hidden:
            self.parts.append(data.replace("\n", " "))  # help.html wraps its paragraphs at 80 columns


@functools.cache
def manual() -> str:
    """The IDLE manual's body: from its first section to the end of the last (navigation and footer cut)."""
    p = _Text()
    p.feed((folder() / "help.html").read_text(encoding="utf-8"))
    text = re.sub(r"[ \t]*\n[ \t\n]*", "\n", "".join(p.parts)).replace("\u00b6", "")  # the pilcrow anchors
    lines = [" ".join(line.split()) for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("IDLE is Python"))
    end = next((i for i in range(len(lines) - 1, start, -1) if lines[i].startswith("Table of Contents")), len(lines))
    return "\n".join(line for line in lines[start:end] if line)


@functools.cache
def release_notes() -> str:
    """IDLE's release notes, newest first, as shipped (entries separated by blank lines)."""
    texts = [(folder() / name).read_text(encoding="utf-8", errors="replace") for name in NOTES]
    return "\n\n".join(re.sub(r"\n{3,}", "\n\n", t).strip() for t in texts)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
