#!/usr/bin/env bash
# Regenerates loopserve/cluster/proto/ from protos/loopserve.proto (grpcio-tools).
set -euo pipefail
cd "$(dirname "$0")/.."
out=loopserve/cluster/proto
mkdir -p "$out"
python3 -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" protos/loopserve.proto
# protoc writes absolute imports; make them package-relative.
sed -i 's/^import loopserve_pb2 as/from . import loopserve_pb2 as/' "$out/loopserve_pb2_grpc.py"
touch "$out/__init__.py"
