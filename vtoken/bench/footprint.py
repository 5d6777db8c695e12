"""Footprint: lines of code per eviction policy, and vToken's metadata per token.

A policy is one small class in ``vtoken/core/policies/`` with one method; the base class does the rest. We
count every line of the policy's file and, separately, its code lines (no blanks, comments or
docstrings). Metadata: the TokenTable's bytes per logical token at 16K tokens (the paper: ~256 KB for a
16K-token sequence, ~16 B per token). No engine runs here, so there is nothing to compare side by side.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

from vtoken.bench.report import Table


def add_args(p) -> None:
    p.add_argument("--tokens", type=int, default=16384)


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    doc_lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(getattr(first, "value", None), ast.Constant)
                and isinstance(first.value.value, str)
            ):
                doc_lines.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (
            tokenize.COMMENT,
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - doc_lines)


def run(args) -> dict:
    from vtoken.core.policies import POLICIES
    from vtoken.core.token_table import TokenTable

    rows = []
    for name, cls in sorted(POLICIES.items()):
        path = Path(__import__(cls.__module__, fromlist=["_"]).__file__)
        src = path.read_text()
        rows.append(
            {
                "policy": name,
                "file": f"vtoken/core/policies/{path.name}",
                "lines": len(src.splitlines()),
                "code_lines": code_lines(src),
            }
        )
    base = Path(__import__("vtoken.core.policies.base", fromlist=["_"]).__file__).read_text()
    tokens = 2048 if args.quick else args.tokens
    table = TokenTable(32)
    table.append(tokens)
    return {
        "policies": rows,
        "base_class": {"lines": len(base.splitlines()), "code_lines": code_lines(base)},
        "metadata": {"tokens": tokens, "bytes": table.nbytes, "bytes_per_token": table.nbytes / tokens},
    }


def tables(result: dict) -> list[Table]:
    rows = [[r["policy"], r["file"], r["lines"], r["code_lines"]] for r in result["policies"]]
    b, m = result["base_class"], result["metadata"]
    return [
        Table(
            "Lines per policy (goal: < 30; paper: < 50)",
            ["policy", "file", "lines", "code lines"],
            rows,
            f"Shared mechanics (budget, sink/recent, protection, top-k) live once in vtoken/core/policies/base.py: "
            f"{b['lines']} lines, {b['code_lines']} of code.",
        ),
        Table(
            "Metadata",
            ["tokens", "TokenTable bytes", "bytes per token"],
            [[m["tokens"], m["bytes"], m["bytes_per_token"]]],
            "Goal: at most 8 bytes per token; paper: ~256 KB for 16K tokens (~16 B per token).",
        ),
    ]


def plot(result: dict, fig) -> None:
    ax = fig.subplots(1, 1)
    rows = result["policies"]
    ax.bar([r["policy"] for r in rows], [r["lines"] for r in rows], label="lines")
    ax.bar([r["policy"] for r in rows], [r["code_lines"] for r in rows], label="code lines")
    ax.axhline(30, color="k", ls="--", label="goal: 30")
    ax.axhline(50, color="grey", ls=":", label="paper: 50")
    ax.set(ylabel="lines", title="Lines of code per eviction policy")
    ax.legend()
