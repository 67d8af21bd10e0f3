#!/usr/bin/env bash
# Issue 24 item 5: `--schedule auto` (measuring the 3 best predicted) against the best named schedules, clip 0, one
# machine start. Run from the repository root with carry [".bench"], one or more steps per call (a call may run
# 10 min; state stays under /tmp and ~/.cache on the warm machine):
#   bash docs/runs/24-auto/run.sh SHAPE STEP...     # SHAPE: bench-3b | llama-4.5b | llama3-8b; STEP: auto | named
# The order used: auto, named (one process, 3 interleaved rounds of every named schedule that fits the budget),
# auto, auto. Outputs: $OUT/auto-SHAPE.txt (appended per auto process), named-SHAPE.txt and named-SHAPE.tgz.
set -uo pipefail
mkdir -p "$OUT" /tmp/auto-out
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .bench/wheels/*.whl
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/machine.txt"
nproc >> "$OUT/machine.txt"; free -g | head -2 >> "$OUT/machine.txt"
shape=$1; shift
# Named schedules: every named family with the knobs a user would try, each planned within the GPU budget
# (`megatrain plan ... --gpu-gib BUDGET`); the compiled layer on, as auto may choose it.
case "$shape" in
  bench-3b) model=bench-3b; batch=8; seq=2048; budget=16
    named="arrival-resident+resident_layers=2+clip=0,arrival-resident+resident_layers=2+compile_layers=false+clip=0,lean+clip=0,lean+compile_layers=true+clip=0,arrival+clip=0" ;;
  llama-4.5b) model=scripts/shapes/llama-4.5b; batch=4; seq=4096; budget=24
    named="arrival-resident+resident_layers=2+compile_layers=true+clip=0,lean+resident_layers=2+compile_layers=true+clip=0,arrival+resident_layers=2+compile_layers=true+clip=0,overlap-split+compile_layers=true+clip=0,lean+clip=0" ;;
  llama3-8b) model=llama3-8b; batch=8; seq=2048; budget=40
    named="lean+resident_layers=2+compile_layers=true+clip=0,lean+compile_layers=true+clip=0,lean+clip=0,arrival-resident+resident_layers=2+compile_layers=true+clip=0" ;;
  *) echo "unknown shape $shape"; exit 2 ;;
esac
for step in "$@"; do
  case "$step" in
    auto)
      timeout "${AUTO_TIMEOUT:-290}" python3 scripts/bench_megatrain.py --model "$model" --batch $batch --seq $seq \
        --schedule auto --gpu-budget-gib $budget --set clip=0 --steps 4 2>&1 | grep -v Warning \
        | tee -a "$OUT/auto-$shape.txt" ;;
    named)
      timeout "${NAMED_TIMEOUT:-400}" python3 scripts/accuracy.py measure --model "$model" --batch $batch --seq $seq \
        --out /tmp/auto-out --rounds 3 --schedules "$named" \
        --profile "$(ls ~/.cache/megatrain/profiles/*.json | head -1)" 2>&1 | tee "$OUT/named-$shape.txt"
      tar -C /tmp/auto-out -czf "$OUT/named-$shape.tgz" "$(basename "$model")" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
