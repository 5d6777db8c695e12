#!/usr/bin/env bash
# Set everything up (venv, vLLM, models) and run the main job: `vtoken demo` on SmolLM2.
# Extra arguments go to `vtoken demo` (see `.venv/bin/vtoken demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/vtoken models prepare
exec .venv/bin/vtoken demo "$@"
