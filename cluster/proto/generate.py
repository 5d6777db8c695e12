"""Regenerates vtoken_pb2.py, vtoken_pb2_grpc.py and vtoken_pb2.pyi from vtoken.proto.

    python -m cluster.proto.generate          # rewrite the checked-in modules
    python -m cluster.proto.generate --check  # exit 1 if they are out of date (CI)

Run from any directory; the include root is the repository root so the generated imports read
``from cluster.proto import vtoken_pb2``. Output depends only on the pinned grpcio-tools version.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = "cluster/proto/vtoken.proto"
OUTPUTS = ("vtoken_pb2.py", "vtoken_pb2_grpc.py", "vtoken_pb2.pyi")


def generate(out_root: Path) -> None:
    from importlib.resources import files

    from grpc_tools import protoc

    rc = protoc.main(
        [
            "protoc",
            f"-I{ROOT}",
            f"-I{files('grpc_tools') / '_proto'}",  # google/protobuf/*.proto (Struct), shipped with grpcio-tools
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(ROOT / PROTO),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {rc})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    if not args.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [
            n
            for n in OUTPUTS
            if (Path(tmp) / "cluster/proto" / n).read_bytes() != (ROOT / "cluster/proto" / n).read_bytes()
        ]
    if stale:
        print(f"out of date: {', '.join(stale)}; run python -m cluster.proto.generate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
