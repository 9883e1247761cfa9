#!/usr/bin/env bash
# Regenerates the gRPC stubs from protos/loopserve.proto (grpcio-tools' bundled protoc).
# Usage: [PYTHON=python] scripts/gen_protos.sh [OUT_DIR]  (OUT_DIR relative to the repo root; default
# loopserve/entrypoints/grpc/proto). PYTHON: an interpreter with grpcio-tools (default python3 on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-loopserve/entrypoints/grpc/proto}
mkdir -p "$out"
"${PYTHON:-python3}" -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    protos/loopserve.proto
# protoc writes a top-level import; make it package-relative so loopserve.entrypoints.grpc.proto imports.
sed -i 's/^import loopserve_pb2 as/from . import loopserve_pb2 as/' "$out/loopserve_pb2_grpc.py"
[ -f "$out/__init__.py" ] || : > "$out/__init__.py"
