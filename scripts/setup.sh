#!/usr/bin/env bash
# Install dynshard and its test dependencies into the current Python (torch is pinned to the CPU 2.13.0 wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
