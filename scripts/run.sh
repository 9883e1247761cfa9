#!/usr/bin/env bash
# Sets up and runs the main job on the embedded default (tiny looped model on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
loopserve generate "The loop" "Recurrent depth is" --model tiny-ouro --max-tokens 24 --exit-threshold 0.7 "$@"
