#!/usr/bin/env bash
# Issue 24: out-of-sample accuracy (scripts/accuracy.py) on one machine start. Run from the repository root with
# carry [".bench"]:
#   bash docs/runs/24-accuracy/run.sh SHAPE [SCHEDULES]   # SHAPE: bench-3b | llama-4.5b | qwen2-3b
# Rows accumulate under /tmp/acc on the warm machine; $OUT gets a tar of the shape's directory and the log.
set -uo pipefail
mkdir -p /tmp/acc "$OUT"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .bench/wheels/*.whl
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/machine.txt"
nproc >> "$OUT/machine.txt"; free -g | head -2 >> "$OUT/machine.txt"
python3 -c "import torch; print('torch', torch.__version__)" >> "$OUT/machine.txt"
case "$1" in
  bench-3b) model=bench-3b; batch=8; seq=2048 ;;
  llama-4.5b) model=scripts/shapes/llama-4.5b; batch=4; seq=4096 ;;
  qwen2-3b) model=scripts/shapes/qwen2-3b; batch=8; seq=2048 ;;
  *) echo "unknown shape $1"; exit 2 ;;
esac
extra=()
[ -n "${2:-}" ] && extra=(--schedules "$2")
timeout "${ACC_TIMEOUT:-560}" python3 scripts/accuracy.py measure --model "$model" --batch $batch --seq $seq \
  --out /tmp/acc "${extra[@]}" 2>&1 | tee "$OUT/measure-$1.txt"
tar -C /tmp/acc -czf "$OUT/acc-$1.tgz" "$1"
