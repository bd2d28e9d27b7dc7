#!/usr/bin/env bash
# The test suite: set-up, then pytest (multi-rank tests spawn real gloo processes on this machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python -m pytest -q -p no:cacheprovider --durations=25 "$@"
