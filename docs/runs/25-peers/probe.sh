#!/usr/bin/env bash
# Issue 25, a first probe on the GPU machine (one call, carry [".bench"]): every DeepSpeed peer's dry run, now
# checked against DeepSpeed 0.19.8's own config models (importable here, not in CI), and the wall time of one
# process of each kind (start-up, DeepSpeed's CPU Adam build, 2 warm-up + 4 timed steps), to plan the table's calls.
#   bash docs/runs/25-peers/probe.sh [BUDGET_S]
set -uo pipefail
mkdir -p "$OUT"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .bench/wheels/*.whl
export PYTHONPATH=.:/tmp/site
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
  python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
  command -v numactl || echo "no numactl"; } > "$OUT/machine.txt" 2>&1
for peer in zero3-offload superoffload twinflow zenflow; do
  echo "== $peer"; t0=$(date +%s)
  timeout 120 python3 scripts/peers/run_peer.py "$peer" --dry-run 2>&1 | tail -4 | cut -c1-600
  echo "# $(( $(date +%s) - t0 )) s"
done > "$OUT/dryrun.txt" 2>&1
python3 scripts/bench.py --rounds 1 --steps 4 --model bench-3b --batch 8 --seq 2048 --budget-s "${1:-330}" \
  --configs "superoffload:clip=0,zero3-offload,all-on-gpu" --reference all-on-gpu \
  --results "$OUT/probe-bench3b-8x2048.jsonl" --log-dir /tmp/probe-logs 2>&1 | tee "$OUT/probe.txt"
tar -C /tmp -czf "$OUT/probe-logs.tgz" probe-logs
