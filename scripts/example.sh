#!/usr/bin/env bash
# The main job: train the example GPT with dynshard on 2 CPU processes (2-way tensor parallel).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec torchrun --nproc-per-node 2 examples/train_gpt.py "$@"
