"""`python -m vtoken.bench <name> ...`: the same as `vtoken bench`, without the rest of the CLI."""

import argparse
import sys

from vtoken.bench import add_cli

parser = argparse.ArgumentParser(prog="python -m vtoken.bench")
add_cli(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(["bench", *sys.argv[1:]])
sys.exit(args.func(args))
