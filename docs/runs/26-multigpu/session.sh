#!/usr/bin/env bash
# Issue 26 item 2 (and item 3's core binding) on a two-GPU machine, in as few calls as the budget allows: call it
# again with the same arguments until it prints "session complete". State lives in /tmp/26 of the warm machine
# (seeded from docs/runs/26-multigpu/state/ when the machine is fresh: copy a call's 26-state.tgz there, unpacked,
# to carry finished steps over to a new machine start); every call copies its output and a tar of the state to $OUT.
#   bash docs/runs/26-multigpu/session.sh [BUDGET_S]     (kind nvidia-h100-x2 or nvidia-h200-x2; carry [".bench"])
# Steps, in order, each skipped once done:
#   1. a quick profile of this machine for bench-3b (the predictions, made before any run), then the collectives
#      between the two GPUs (torchrun, `profile --collectives-only`) written into it
#   2. bench_multigpu.py scaling: bench-3b at 1 and 2 GPUs, 8 x 2048 per GPU, 3 interleaved runs each (tokens/s,
#      scaling efficiency, PSS of all ranks against the plan, the prediction written before the runs)
#   3. equality: 20 fp32 steps, 2 GPUs against 1 GPU with 2 micro-batches, bound measured in one process
#   4. curve: 300 bf16 steps on the bundled corpus, 2 GPUs against 1 GPU with 2 micro-batches (curve.png overlay)
#   5. the same 2-GPU bench-3b runs with MEGATRAIN_BIND_CORES=0 (every rank on every core): binding before/after
#   6. llama3-8b's own quick profile and collectives, then scaling as in 2 for it (/tmp/26/scaling-8b)
set -uo pipefail
budget=${1:-540}
t0=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t0) )); }
mkdir -p "$OUT" /tmp/26
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .bench/wheels/*.whl
export PYTHONPATH=.:/tmp/site NCCL_NVLS_ENABLE=0
[ -d docs/runs/26-multigpu/state ] && [ ! -f /tmp/26/.seeded ] && cp -rn docs/runs/26-multigpu/state/. /tmp/26/
touch /tmp/26/.seeded
[ -f /tmp/26/machine.txt ] || { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m; nproc; free -g | head -2; python3 -c "import torch; print('torch', torch.__version__)"
  } > /tmp/26/machine.txt 2>&1
log="$OUT/session-$(date +%H%M%S).txt"
run() {  # run NAME TIMEOUT_S CMD...: once; NAME.done marks success
  local name=$1 limit=$2; shift 2
  [ -f "/tmp/26/$name.done" ] && return 0
  [ "$(left)" -lt 60 ] && { echo "$name: no time left in this call" | tee -a "$log"; return 1; }
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  echo "== $name (limit ${limit}s)" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && touch "/tmp/26/$name.done"
  return "$rc"
}
P=/tmp/26/profile.json
run profile 300 python3 -m megatrain profile --quick --device cuda --model bench-3b --batch 8 --seq 2048 \
  --schedule arrival --out "$P"
# the collectives between the two GPUs (NCCL), written into that profile's other fields: what the 2-GPU predictions
# price the all-gathers and reduce-scatters with
run collectives 120 python3 -m torch.distributed.run --standalone --nproc_per_node=2 -m megatrain profile \
  --collectives-only --device cuda --base "$P" --out /tmp/26/profile-2gpu.json
[ -f /tmp/26/profile-2gpu.json ] && P=/tmp/26/profile-2gpu.json
# scaling resumes by itself (runs already in its folder are skipped) and exits 0 with runs left: it is done when it
# says so. bench-3b first, then the cheap correctness checks and the binding runs, llama3-8b last (the longest runs:
# what a cut budget loses is the least)
scale() {  # scale NAME MODELS GPUS [env...]: bench_multigpu.py scaling into /tmp/26/NAME until it reports no run left
  local name=$1 models=$2 gpus=$3; shift 3
  [ -f "/tmp/26/$name.done" ] && return 0
  [ "$(left)" -gt 90 ] || { echo "$name: no time left in this call" | tee -a "$log"; return 1; }
  echo "== $name" | tee -a "$log"
  env "$@" OUT="/tmp/26/$name" timeout "$(left)" python3 scripts/bench_multigpu.py scaling --models "$models" \
    --gpus-list "$gpus" --runs 3 --profile "$P" --budget-s "$(( $(left) - 30 ))" 2>&1 |
    tee -a "$log" "/tmp/26/$name.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && ! grep -q "left for the time budget" "/tmp/26/$name.txt" && touch "/tmp/26/$name.done"
  rm -f "/tmp/26/$name.txt"
}
scale scaling bench-3b 1,2
[ -f /tmp/26/scaling.done ] && run equality 400 env OUT=/tmp/26/equality python3 scripts/bench_multigpu.py equality
[ -f /tmp/26/scaling.done ] && run curve 500 env OUT=/tmp/26/curve python3 scripts/bench_multigpu.py curve
# every rank on every core: the same 2-GPU bench-3b runs, binding off
[ -f /tmp/26/scaling.done ] && scale nobind bench-3b 2 MEGATRAIN_BIND_CORES=0
# llama3-8b's own quick profile, its collectives written in: the host's update rate is measured on the profiled
# model's layer, and bench-3b's predicted llama3-8b 17% slow on two H200s (docs/accuracy.md; that start, 2026-11-27,
# profiled both models in one command)
P8=/tmp/26/profile-8b.json
[ -f /tmp/26/nobind.done ] && run profile-8b 300 python3 -m megatrain profile --quick --device cuda --model llama3-8b \
  --batch 8 --seq 2048 --schedule arrival --out "$P8"
[ -f "$P8" ] && run collectives-8b 120 python3 -m torch.distributed.run --standalone --nproc_per_node=2 -m megatrain \
  profile --collectives-only --device cuda --base "$P8" --out /tmp/26/profile-8b-2gpu.json
[ -f /tmp/26/profile-8b-2gpu.json ] && P=/tmp/26/profile-8b-2gpu.json
[ -f /tmp/26/collectives-8b.done ] && scale scaling-8b llama3-8b 1,2
done_all=1
for s in profile collectives scaling equality curve nobind profile-8b collectives-8b scaling-8b; do
  [ -f "/tmp/26/$s.done" ] || done_all=0
done
[ "$done_all" = 1 ] && echo "session complete" | tee -a "$log"
cp /tmp/26/machine.txt "$OUT/"
[ -f /tmp/26/curve/curve.png ] && cp /tmp/26/curve/curve.png "$OUT/"
tar -C /tmp -czf "$OUT/26-state.tgz" --exclude='*.tiles.pt' 26
exit 0
