#!/usr/bin/env bash
# Sets up and runs the main job: a 1P1D cluster of the embedded tiny trained looped model on CPU
# (local Ray, NIXL over loopback) behind the gRPC server on 127.0.0.1:50051 and the
# OpenAI-compatible HTTP server on 127.0.0.1:8000, in the environment scripts/env.sh picks.
# Talk to it from another shell: loopserve client "o=7;z=o;c=8;p=c;j=a;a=p;j=?"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
exec loopserve serve --config configs/cpu-1p1d.yaml "$@"
