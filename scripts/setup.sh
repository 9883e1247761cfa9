#!/usr/bin/env bash
# Installs loopserve and everything it needs on a fresh machine (CPU torch first).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
