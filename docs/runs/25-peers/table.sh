#!/usr/bin/env bash
# Issue 25's tables on the H200, one call of the GPU machine (carry [".bench"]); call it again with the same
# arguments until it prints "table complete": the results file lives in /tmp of the warm machine (seeded from the
# repository's copy when the machine is fresh) and every call copies it, the table and the logs to $OUT.
#   [PROFILE_ARGS="--model M --batch B --seq S"] bash docs/runs/25-peers/table.sh NAME "BENCH ARGS" [BUDGET_S]
# e.g. NAME=bench3b-8x2048, BENCH ARGS="--model bench-3b --batch 8 --seq 2048 --configs ..."; PROFILE_ARGS: measure
# this machine's quick profile first (below), which every megatrain row then predicts with
set -uo pipefail
name=$1; args=$2; budget=${3:-520}
mkdir -p "$OUT" /tmp/25-logs
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .bench/wheels/*.whl
export PYTHONPATH=.:/tmp/site
repo=docs/runs/25-peers/$name.jsonl; res=/tmp/25-$name.jsonl
[ -f "$res" ] || { [ -f "$repo" ] && cp "$repo" "$res"; } || true
[ -f /tmp/25-machine.txt ] || { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; free -g | head -2; uptime; python3 -c "import torch, deepspeed; print('torch', torch.__version__,
  'deepspeed', deepspeed.__version__)"; command -v numactl || echo "no numactl"; } > /tmp/25-machine.txt 2>&1
cp /tmp/25-machine.txt "$OUT/machine.txt"
# this machine's quick profile (once per machine start, ~30-50 s): megatrain's predictions and physical bounds then
# rest on this machine's measured rates, not the shipped h200-measured profile of another start (out of sample:
# the profile is measured before, and apart from, the runs it predicts). The layer is timed eager and compiled:
# the arrival-resident schedules compile it, and start 2's eager-only profile predicted their compute 20-25% slow
if [ -n "${PROFILE_ARGS:-}" ] && [ ! -f "/tmp/25-profile-$name.json" ]; then
  # shellcheck disable=SC2086
  python3 -m megatrain profile --quick --device cuda --set compile_layers=true $PROFILE_ARGS \
    --out "/tmp/25-profile-$name.json" 2>&1 |
    tee "$OUT/profile-$name.txt"
fi
if [ -f "/tmp/25-profile-$name.json" ]; then
  export MEGATRAIN_PROFILE=/tmp/25-profile-$name.json  # what every megatrain process predicts with
  cp "$MEGATRAIN_PROFILE" "$OUT/profile-$name.json"
  # every timing behind it, in the logs' tar (scripts/accuracy.py ablate rebuilds a profile from them)
  cp "/tmp/25-profile-$name.measurements.json" /tmp/25-logs/ 2>/dev/null || true
fi
# the GPU's SM clock, power and temperature every 0.5 s while the table runs (into the logs' tar): what makes a
# layer slower back to back than in the profile's bursts (docs/accuracy.md, "The back-to-back compute rate")
clocks=/tmp/25-logs/gpu-clocks-$name-$(date +%H%M%S).csv
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv -lms 500 > "$clocks" 2>/dev/null &
sampler=$!
# shellcheck disable=SC2086
timeout $((budget + 60)) python3 scripts/bench.py --rounds 3 --steps 4 --budget-s "$budget" \
  --log-dir /tmp/25-logs --reference all-on-gpu $args --results "$res" 2>&1 | tee "$OUT/$name-$(date +%H%M%S).txt"
rc=${PIPESTATUS[0]}
kill "$sampler" 2>/dev/null || true
[ "$rc" = 0 ] && echo "table complete" | tee -a "$OUT/$name-done.txt"
cp "$res" "$OUT/$name.jsonl"
tar -C /tmp -czf "$OUT/$name-logs.tgz" 25-logs
exit 0
