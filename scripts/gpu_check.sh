#!/usr/bin/env bash
# The project's GPU check (docs/benchmarks.md records where it passed): on one CUDA GPU,
#   tests:    the GPU tests (python -m pytest -m gpu tests/gpu; they turn the GPU features on);
#   serving:  the serving workload on configs/h200-1p1d.yaml with the shipped defaults (the GPU
#             paths on) in both modes (colocated, then 1P1D as plain processes; half the KV
#             pool on a GPU under 120 GiB): fails if any request fails or 1P1D's greedy
#             tokens differ from colocated's beyond a near-tie (--tie-nats);
#   features: (only when named) the same with EngineConfig's GPU_FEATURES given explicitly;
#   decode:   the decode benchmark at batches 1 and 8 (benchmarks/gpu_h200.py --parts 1).
# GPU_TEST_WORKERS=N runs the tests in N pytest-xdist processes on the one GPU (to fit a call).
# Prints one PASS/FAIL summary line last; the whole log goes to $GPU_CHECK_LOG
# (default out/gpu_check.log). Arguments name a subset of the steps; only a run of "tests serving
# decode" is the check (a device call of at most 10 minutes fits "tests", then "serving decode").
#
# Needs the project's Python dependencies: where one is missing and a folder of wheels is at
# $LOOPSERVE_WHEELS (default .whl; how to fetch them: docs/benchmarks.md), they are installed
# into a private folder for this run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${GPU_CHECK_LOG:-out/gpu_check.log}
mkdir -p "$(dirname "$LOG")"
: > "$LOG"
source scripts/gpu_env.sh

# The device's copy of .git may be older than the tree it runs (its `git rev-parse` answered a
# commit before the carried one): the commit comes from here, in GPU_CHECK_COMMIT.
commit=${GPU_CHECK_COMMIT:-"unknown (set GPU_CHECK_COMMIT)"}
ALL="tests serving decode"
steps=${*:-$ALL}
gpu=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))" 2>>"$LOG" || echo "no CUDA GPU")
declare -a failed=()
summary=()

step() {  # step NAME COMMAND...: runs it into the log, remembers a failure
  local name=$1; shift
  [[ " $steps " == *" $name "* ]] || return 0
  echo "=== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

step tests "$PY" -m pytest -p no:cacheprovider -rs --durations=25 ${GPU_TEST_WORKERS:+-n "$GPU_TEST_WORKERS"} -m gpu tests/gpu
summary+=("tests: $(grep -Eo '[0-9]+ (passed|failed|error)[^=]*' "$LOG" | tail -1)")

# The config's two workers hold 48 GiB of KV each: on a GPU under 120 GiB (an H100), 24 GiB.
gib=$("$PY" -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)" 2>/dev/null || echo 0)
small=(); [ "$gib" -ge 120 ] || small=(--num-blocks 2048)
serving=("$PY" benchmarks/pd_vs_colocated.py --config configs/h200-1p1d.yaml --requests 64 --rate 4
  --max-tokens 64 --min-words 40 --max-words 300 --slo-tpot-ms 50 "${small[@]}")
for name in serving features; do
  extra=(--png "out/pd_latency_cdf_gpu_$name.png"); [ "$name" = features ] && extra+=(--gpu-features)
  step "$name" "${serving[@]}" "${extra[@]}"
  [[ " $steps " == *" $name "* ]] && summary+=("$name: $(grep -E '^greedy tokens' "$LOG" | tail -1)")
done

step decode "$PY" benchmarks/gpu_h200.py --parts 1 --decode-batches 1,8
summary+=("decode: $(grep -E '^\[decode\] batch +[18] +(graphs|fused)' "$LOG" | sed 's/;.*//' | tr -s ' ' | paste -sd';')")

if [ ${#failed[@]} -ne 0 ]; then verdict="FAIL (${failed[*]})"
elif [[ " $steps " != *" tests "*" serving "*" decode "* ]]; then verdict="PASS (only: $steps)"
else verdict=PASS; fi
line="gpu_check: $verdict at $commit on $gpu; $(IFS='|'; echo "${summary[*]}")"
echo "$line" | tee -a "$LOG"
[ ${#failed[@]} -eq 0 ]
