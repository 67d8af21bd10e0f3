# Sourced by run.sh and reprofile.sh: the standing benchmark's shapes (shape_args SHAPE sets model, batch, seq)
# and the device set-up.
shape_args() {
  case "$1" in
    bench-3b) model=bench-3b; batch=8; seq=2048 ;;
    llama-4.5b) model=scripts/shapes/llama-4.5b; batch=4; seq=4096 ;;
    qwen2-3b) model=scripts/shapes/qwen2-3b; batch=8; seq=2048 ;;
    *) echo "unknown shape $1 (bench-3b | llama-4.5b | qwen2-3b)"; return 2 ;;
  esac
}

# The device machine's set-up: the simpy wheel (carried .bench), PYTHONPATH, and what the machine is, into FILE.
device_setup() {
  mkdir -p "$OUT"
  [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .bench/wheels/*.whl
  export PYTHONPATH=.:/tmp/site
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
    python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/$1"
}
