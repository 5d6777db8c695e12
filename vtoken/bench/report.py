"""What every benchmark writes beside its JSON: a Markdown page (docs/results/ renders it again from the JSON,
scripts/render_docs.py) and a PNG plot."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple


class Table(NamedTuple):
    title: str
    columns: list[str]
    rows: list[list[Any]]
    note: str = ""


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def markdown(tables: list[Table]) -> str:
    out = []
    for t in tables:
        out.append(f"**{t.title}**\n")
        out.append("| " + " | ".join(t.columns) + " |")
        out.append("|" + "---|" * len(t.columns))
        out.extend("| " + " | ".join(_cell(v) for v in row) + " |" for row in t.rows)
        if t.note:
            out.append(f"\n{t.note}")
        out.append("")
    return "\n".join(out)


_MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|root|home)/[^\s,`)\]]+")


def machine_free(text: str) -> str:
    """Paths of the machine a run was made on, as a reader can use them: a committed result's path from
    docs/results/, any other path by its file name (it named a file on that machine only)."""

    def one(m: re.Match) -> str:
        path = m.group(0)
        return path[path.index("docs/results/") :] if "docs/results/" in path else path.rsplit("/", 1)[-1]

    return _MACHINE_PATH.sub(one, text)


def _command(result: dict) -> str:
    """The command as run, less ``--out``: where it wrote its files says nothing about the result. A tree it ran
    against (doorcost's ``--against``, a checkout on that machine) is named by the commit it recorded."""
    words = result["command"].split()
    against = result.get("trees", {}).get("against", {}).get("commit")
    words = [
        f"<checkout of {against}>" if against and i and words[i - 1] == "--against" else w for i, w in enumerate(words)
    ]
    return " ".join(w for i, w in enumerate(words) if w != "--out" and (i == 0 or words[i - 1] != "--out"))


def _budgets(result: dict) -> str:
    s = result.get("settings", {})
    b = s.get("budget", s.get("budgets"))
    return "" if b is None else f"; budget {b}"


def head(result: dict) -> str:
    """The line above a benchmark's tables: its command, how long it ran, on what, at which budget."""
    m = result["machine"]
    return (
        f"`{_command(result)}` - {result['seconds']:.0f} s on {m['processor']}, {m['cpus']} CPUs, "
        f"torch {m['torch']}, vLLM {m.get('vllm', '-')}{_budgets(result)}\n\n"
    )


def page(result: dict, tables: list[Table], name: str, plot: bool) -> str:
    """``name.md`` as written beside its JSON, and as docs/results/ renders it again from that JSON."""
    return machine_free(head(result) + markdown(tables) + (f"\n![{name}]({name}.png)\n" if plot else ""))


def write(out: Path, name: str, result: dict, tables: list[Table], plot: Callable | None) -> list[Path]:
    """``name.md`` (command, machine, tables) and ``name.png`` (``plot(result, fig)`` draws on ``fig``)."""
    paths = []
    md = out / f"{name}.md"
    md.write_text(page(result, tables, name, plot is not None))
    paths.append(md)
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(10, 4.5))
        plot(result, fig)
        fig.tight_layout()
        png = out / f"{name}.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        paths.append(png)
    return paths
