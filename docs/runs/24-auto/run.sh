#!/usr/bin/env bash
# Issue 24 item 5: `--schedule auto` (measuring the 3 best predicted) against the best named schedule, bench-3b
# 8 x 2048, clip 0, 16 GiB GPU budget, one machine start. Run from the repository root with carry [".bench"]:
#   bash docs/runs/24-auto/run.sh
# Order: auto, the named schedules (one process, 3 interleaved rounds), auto again, auto a third time if time allows.
set -uo pipefail
mkdir -p "$OUT"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .bench/wheels/*.whl
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/machine.txt"
nproc >> "$OUT/machine.txt"; free -g | head -2 >> "$OUT/machine.txt"
auto() {
  timeout 200 python3 scripts/bench_megatrain.py --model bench-3b --batch 8 --seq 2048 --schedule auto \
    --gpu-budget-gib 16 --set clip=0 --steps 4 2>&1 | grep -v Warning | tee -a "$OUT/auto.txt"
}
auto
timeout 240 python3 scripts/accuracy.py measure --model bench-3b --batch 8 --seq 2048 --out /tmp/named --rounds 3 \
  --schedules arrival-resident-2,lean,arrival --profile "$(ls ~/.cache/megatrain/profiles/*.json | head -1)" \
  2>&1 | tee "$OUT/named.txt"
tar -C /tmp/named -czf "$OUT/named.tgz" bench-3b
auto
auto
