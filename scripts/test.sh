#!/usr/bin/env bash
# Set everything up (venv, vLLM, models) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/vtoken models prepare
# Style is checked like the tests: lint, then formatting (config in pyproject.toml).
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The docs site builds with every link and page resolving (mkdocs.yml: strict), into a folder that goes away.
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site" || { rm -rf "$site"; exit 1; }
rm -rf "$site"
# The slowest tests are printed: the whole CI run must stay under 30 minutes.
exec .venv/bin/python -m pytest -q -ra --durations=40 "$@"
