#!/usr/bin/env bash
# Set everything up (venv, vLLM, models) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/vtoken models prepare
# Style is checked like the tests: lint, then formatting (config in pyproject.toml).
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The slowest tests are printed: the whole CI run must stay under 30 minutes.
exec .venv/bin/python -m pytest -q -ra --durations=40 "$@"
