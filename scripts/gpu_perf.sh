#!/usr/bin/env bash
# The performance figures of issues 41 and 42 in one device call (at most 10 minutes: each step
# has a time limit, and the tables start no cell past their --budget-s; cells print as they end):
#   read:  a handoff's NIXL READ vs a device-to-device copy of the same bytes, and the wait
#          before it (benchmarks/kv_read_gpu.py on configs/h200-1p1d.yaml, 1040-token prompt);
#          then NIXL alone at that size, one transfer, with and without the READ's notification
#          (benchmarks/experiments/nixl_split_gpu.py --notif);
#   bf16:  the throughput table (benchmarks/throughput.py: C = 1..256, 1K and 4K prompts, fixed
#          and adaptive exit, bf16 KV) and the same workload at C = 64 through `loopserve serve`;
#   served: that C = 64 cell alone, engine only and through `loopserve serve` (bf16 runs it too);
#   fp8:   the table with --kv-cache-dtype fp8_e4m3, where EngineConfig has that field;
#   profile: where a decode step's time goes at C = 1, 32, 64 (bf16) and C = 32 (FP8), 1K
#          prompts (benchmarks/profile_gpu.py: GPU busy vs wall, kernel families, host);
#   sweep: the paged decode kernel's launches and the FMA kernel against the K/V floor, bf16 and
#          FP8 (benchmarks/experiments/attn_sweep_gpu.py);
#   policy: adaptive exit at C = 32, 64 (1K prompts, bf16) under the default policy (refill) and
#          under mixed, one after the other: whether mixed's wider batches pay on a GPU;
#   adaptive: why adaptive exit ran at 0.4-0.5x fixed depth (905a56a): a profile of its steps at
#          C = 32 (GPU busy vs wall, host functions), then C = 32, 64 with async scheduling;
#   split: the C = 32 cell (1K prompts) step by step, its wall split by graph vs eager batches
#          per Operation (profile_gpu.py --closed-loop), adaptive exit then fixed depth.
# The default is "read bf16 fp8" (one call); "adaptive policy profile" fits a second. A step
# with two parts (read, policy, adaptive) runs both; a part may be named alone (read_product,
# read_nixl, policy_refill, policy_mixed, adaptive_profile, adaptive_async, split_adaptive,
# split_fixed).
# Logs and JSON go to $OUT if set, else out/. Arguments name a subset of the steps.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${OUT:-out}
LOG=$DIR/gpu_perf.log
mkdir -p "$DIR"
: > "$LOG"
source scripts/gpu_env.sh
steps=" ${*:-read bf16 fp8} "
for pair in "read:read_product read_nixl" "policy:policy_refill policy_mixed" "adaptive:adaptive_profile adaptive_async" \
  "profile:profile_fp8" "split:split_adaptive split_fixed"; do
  [[ $steps == *" ${pair%%:*} "* ]] && steps="$steps ${pair#*:} "
done
# The device's copy of .git may be older than the tree it runs (its `git rev-parse` answered a
# commit before the carried one): the commit comes from here, in GPU_CHECK_COMMIT.
commit=${GPU_CHECK_COMMIT:-"unknown (set GPU_CHECK_COMMIT)"}
echo "gpu_perf at $commit on $("$PY" -c "import torch; print(torch.cuda.get_device_name(0))" 2>>"$LOG")" | tee -a "$LOG"

step() {  # step NAME SECONDS COMMAND...: runs it into the log (and NAME.log), cut after SECONDS
  local name=$1 limit=$2; shift 2
  [[ " $steps " == *" $name "* ]] || return 0
  echo "=== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee "$DIR/$name.log" >>"$LOG"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$LOG"
}

TABLE=("$PY" benchmarks/throughput.py --cs 1,8,32,64,128,256 --prompt-lens 1024,4096 --output-len 128 --max-seconds 30)
step read_product 140 "$PY" benchmarks/kv_read_gpu.py --config configs/h200-1p1d.yaml --prompt-tokens 1040 --reps 5 \
  --backlog 16 --json "$DIR/kv_read.json"
step read_nixl 40 "$PY" benchmarks/experiments/nixl_split_gpu.py --blocks 272 --splits 1 --ops READ --reps 5 --notif
step bf16 260 "${TABLE[@]}" --budget-s 140 --server-c 64 --json "$DIR/throughput_bf16.json"
[[ $steps == *" bf16 "* ]] || step served 200 "$PY" benchmarks/throughput.py --cs 64 --prompt-lens 1024 \
  --output-len 128 --modes fixed --max-seconds 30 --server-c 64 --json "$DIR/throughput_served.json"
if "$PY" -c "from loopserve.engine.config import EngineConfig as E; assert 'kv_cache_dtype' in E.model_fields" 2>/dev/null; then
  step fp8 120 "${TABLE[@]}" --budget-s 90 --kv-cache-dtype fp8_e4m3 --json "$DIR/throughput_fp8.json"
elif [[ " $steps " == *" fp8 "* ]]; then
  echo "=== fp8: skipped: EngineConfig has no kv_cache_dtype at $commit" | tee -a "$LOG"
fi
step profile 100 "$PY" benchmarks/profile_gpu.py --cs 1,32,64 --prompt-len 1024 --steps 32
step profile_fp8 70 "$PY" benchmarks/profile_gpu.py --cs 32 --prompt-len 1024 --steps 32 --kv-cache-dtype fp8_e4m3
POLICY=("$PY" benchmarks/throughput.py --cs 32,64 --prompt-lens 1024 --output-len 128 --modes adaptive --max-seconds 30
  --budget-s 60)
step policy_refill 100 "${POLICY[@]}" --policy refill --json "$DIR/throughput_refill.json"
step policy_mixed 100 "${POLICY[@]}" --policy mixed --json "$DIR/throughput_mixed.json"
step adaptive_profile 100 "$PY" benchmarks/profile_gpu.py --cs 32 --prompt-len 1024 --steps 24 --mode adaptive
step adaptive_async 100 "${POLICY[@]}" --async-scheduling --json "$DIR/throughput_async.json"
for m in adaptive fixed; do
  step split_$m 90 "$PY" benchmarks/profile_gpu.py --cs 32 --prompt-len 1024 --mode $m --closed-loop
done
step sweep 120 env PYTHONPATH=".:$PYTHONPATH" "$PY" benchmarks/experiments/attn_sweep_gpu.py --batches 32 --splits 1
grep -hE '^\[(idle|backlog)\]|^## closed loop|^(graph|eager) | blocks \(|^torch copy_|^ +[0-9]+ +(fixed|adaptive)|^greedy tokens|^served|^rates' \
  "$DIR"/read_*.log "$DIR"/bf16.log "$DIR"/served.log "$DIR"/fp8.log "$DIR"/policy*.log \
  "$DIR"/adaptive*.log "$DIR"/split_*.log 2>/dev/null | tee "$DIR/gpu_perf_summary.txt"
