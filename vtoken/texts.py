"""Real text that is already on the machine (never model-generated), for prompts and benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path

# Python's own license ships with CPython; Debian keeps common licenses; numpy ships its license too.
CANDIDATES = [
    Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "LICENSE.txt",
    Path("/usr/share/common-licenses/GPL-3"),
    Path("/usr/share/common-licenses/Apache-2.0"),
]


def real_text(min_chars: int = 20000) -> str:
    """Concatenated real documents, at least ``min_chars`` long when the machine has that much."""
    parts, total = [], 0
    try:
        import numpy

        CANDIDATES.append(Path(numpy.__file__).parent.parent / f"numpy-{numpy.__version__}.dist-info" / "LICENSE.txt")
    except ImportError:
        pass
    for path in CANDIDATES:
        if path.is_file():
            text = path.read_text(errors="replace")
            parts.append(text)
            total += len(text)
            if total >= min_chars:
                break
    if total < min_chars:
        parts.append(python_docs())  # CPython's own reference text (pydoc_data), ~700K characters
    if not parts:
        raise FileNotFoundError(
            "no real text found on this machine (looked for " + ", ".join(str(p) for p in CANDIDATES) + ")"
        )
    return "\n\n".join(parts)


def python_docs() -> str:
    """The Python reference's topic pages, as shipped with CPython for ``help()``: human-written English."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def passages(n: int, chars: int, min_chars: int = 20000) -> list[str]:
    """``n`` passages of about ``chars`` characters, cut at paragraph boundaries where possible."""
    text = real_text(max(min_chars, n * chars))
    out, start = [], 0
    for _ in range(n):
        end = start + chars
        cut = text.rfind("\n\n", start + chars // 2, end)
        end = cut if cut > 0 else end
        if end >= len(text):
            start, end = 0, chars
        out.append(text[start:end].strip())
        start = end
    return out
