#!/usr/bin/env bash
# Set up (CPU torch first, then this package with its test extras) and run the linter and the tests, two test files at
# a time (pytest-xdist; `-n 0` runs them in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[test]"
ruff check .
python -m pytest -q -n 2 --dist loadfile "$@"
