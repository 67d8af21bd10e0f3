#!/usr/bin/env bash
# Issue 24: out-of-sample accuracy (scripts/accuracy.py) on one machine start. Run from the repository root with
# carry [".bench"]:
#   bash docs/runs/24-accuracy/run.sh SHAPE...   # SHAPE: bench-3b | llama-4.5b | qwen2-3b
#   RESUME=docs/runs/24-accuracy/h100-run1 bash docs/runs/24-accuracy/run.sh SHAPE...
# Rows accumulate under /tmp/acc on the warm machine; $OUT gets a tar of each shape's directory and the logs.
# With RESUME, each shape starts from that run's rows (its quick profile kept as profile-quick-<run>.json): the
# machine is profiled again (a fresh --quick profile of this start) and only the missing (schedule, round) rows
# are measured.
set -uo pipefail
mkdir -p /tmp/acc
source docs/runs/24-accuracy/shapes.sh
device_setup machine.txt
for shape in "$@"; do
  shape_args "$shape" || exit 2
  if [ -n "${RESUME:-}" ] && [ ! -d /tmp/acc/$shape ]; then
    tar -C /tmp/acc -xzf "$RESUME/acc-$shape.tgz"
    run=$(basename "$RESUME")
    mv /tmp/acc/$shape/profile-quick.json /tmp/acc/$shape/profile-quick-$run.json
    mv /tmp/acc/$shape/log.txt /tmp/acc/$shape/log-$run.txt
  fi
  timeout "${ACC_TIMEOUT:-560}" python3 scripts/accuracy.py measure --model "$model" --batch $batch --seq $seq \
    --out /tmp/acc ${SCHEDULES:+--schedules "$SCHEDULES"} 2>&1 | tee "$OUT/measure-$shape.txt"
  tar -C /tmp/acc -czf "$OUT/acc-$shape.tgz" "$shape"
done
