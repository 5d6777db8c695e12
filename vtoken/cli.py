"""The `vtoken` command. Sub-commands register themselves from their own modules (add_cli)."""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    from vtoken import bench, demo, models

    parser = argparse.ArgumentParser(prog="vtoken", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    models.add_cli(sub)
    demo.add_cli(sub)
    bench.add_cli(sub)
    __import__("cluster.cli").cli.add_cli(sub)  # serve, generate, status, scale (Ray imported on use)
    return parser


def main(argv: list[str] | None = None) -> int:
    # stdout carries results (tables, JSON); vLLM's own logging goes to stderr, warnings and up.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
