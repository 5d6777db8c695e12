"""What every benchmark writes beside its JSON: a Markdown table (for the README) and a PNG plot."""

from __future__ import annotations

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


def write(out: Path, name: str, result: dict, tables: list[Table], plot: Callable | None) -> list[Path]:
    """``name.md`` (command, machine, tables) and ``name.png`` (``plot(result, fig)`` draws on ``fig``)."""
    paths = []
    m = result["machine"]
    head = (
        f"`{result['command']}` - {result['seconds']:.0f} s on {m['processor']}, {m['cpus']} CPUs, "
        f"torch {m['torch']}, vLLM {m.get('vllm', '-')}\n\n"
    )
    md = out / f"{name}.md"
    md.write_text(head + markdown(tables))
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
