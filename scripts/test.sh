#!/usr/bin/env bash
# Sets up and runs the default test suite (what CI runs), in the environment scripts/env.sh picks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
python3 -m pytest "$@"
