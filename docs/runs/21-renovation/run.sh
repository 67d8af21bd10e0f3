#!/usr/bin/env bash
# Issue 21's GPU acceptance on one machine start (nvidia-h100-x1): the GPU tests of the renovated tree, then
# bench-3b 8 x 2048 with two schedules, before (.r21old = main at c98a3b4) and after (this tree), interleaved
# round by round (old, new, old, new, ...). Run from the repository root with carry [".bench", ".r21old"]:
#   bash docs/runs/21-renovation/run.sh tests     # the GPU tests -> $OUT/gpu_tests.txt
#   bash docs/runs/21-renovation/run.sh ROUND     # one round of both trees (repeat for ROUND = 1, 2, 3)
# Results accumulate in /tmp/r21/{old,new}.jsonl on the warm machine and are copied to $OUT after each call.
set -uo pipefail
mkdir -p /tmp/r21/logs-old /tmp/r21/logs-new "$OUT"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .bench/wheels/*.whl
export PYTHONPATH=.:/tmp/site
CONFIGS="arrival-resident:resident_layers=4,overlap"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/machine.txt"
nproc >> "$OUT/machine.txt"; free -g | head -2 >> "$OUT/machine.txt"
python3 -c "import torch; print('torch', torch.__version__)" >> "$OUT/machine.txt"
if [ "$1" = compiled ]; then  # the compiled-layer GPU test, before (cold Inductor cache) and after
  T="tests/test_exec_cuda.py::test_cuda_backend_gives_the_cpu_backends_numbers"
  (cd .r21old && python3 -m pytest -q -p no:cacheprovider -x "$T" -k compiled 2>&1 | tail -5) | tee "$OUT/compiled-old.txt"
  python3 -m pytest -q -p no:cacheprovider -x "$T" -k compiled 2>&1 | tail -5 | tee "$OUT/compiled-new.txt"
  exit 0
fi
if [ "$1" = tests ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.txt"
  exit 0
fi
r=$1
for tree in old new; do
  if [ $tree = old ]; then dir=.r21old; else dir=.; fi
  (cd $dir && PYTHONPATH=.:/tmp/site python3 scripts/bench.py --bench-dir "$PWD/.bench" --model bench-3b --batch 8 \
     --seq 2048 --rounds "$r" --configs "$CONFIGS" --results /tmp/r21/$tree-b.jsonl --log-dir /tmp/r21/logs-$tree \
     2>&1 | tee "$OUT/round$r-$tree.txt")
done
cp /tmp/r21/old-b.jsonl /tmp/r21/new-b.jsonl "$OUT/"
