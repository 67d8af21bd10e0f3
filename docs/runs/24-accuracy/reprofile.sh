#!/usr/bin/env bash
# Issue 24: a fresh `--quick` profile of every shape on this machine start, with no training run, for rows measured
# on an earlier start of the same kind (run.sh). Run from the repository root with carry [".bench"]:
#   bash docs/runs/24-accuracy/reprofile.sh SHAPE...
# $OUT gets profile-quick-SHAPE.json (+ its measurements) and the logs; put them beside the rows as
# <shape>/profile-quick.json before `accuracy.py report`.
set -uo pipefail
mkdir -p /tmp/reprof
source docs/runs/24-accuracy/shapes.sh
device_setup machine-reprofile.txt
for shape in "$@"; do
  shape_args "$shape" || exit 2
  rm -f /tmp/reprof/$shape/profile-quick*.json
  timeout 200 python3 scripts/accuracy.py measure --model "$model" --batch $batch --seq $seq --out /tmp/reprof \
    --profile-only 2>&1 | tee -a "$OUT/reprofile.txt"
done
tar -C /tmp/reprof -czf "$OUT/reprofile.tgz" .
