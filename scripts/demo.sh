#!/usr/bin/env bash
# Set up (CPU torch first, then this package) and run the main job on the built-in default model.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[demo]"
python scripts/demo.py "$@"
