# Sourced by the GPU scripts (gpu_check.sh, gpu_perf.sh): runs from the checkout with it on
# PYTHONPATH; where a project dependency is missing and a folder of wheels is at
# $LOOPSERVE_WHEELS (default .whl; how to fetch them: docs/benchmarks.md), installs them into
# a private folder for this run. Needs PY and LOG set.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
WHEELS=${LOOPSERVE_WHEELS:-.whl}
if ! "$PY" -c "import pydantic, yaml, grpc_health, nixl" 2>/dev/null && [ -d "$WHEELS" ]; then
  site=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl \
    >>"$LOG" 2>&1 && export PYTHONPATH="$PYTHONPATH:$site"
fi
