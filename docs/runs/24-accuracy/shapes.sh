# The standing benchmark's shapes (sourced by run.sh and reprofile.sh): sets model, batch, seq for SHAPE.
shape_args() {
  case "$1" in
    bench-3b) model=bench-3b; batch=8; seq=2048 ;;
    llama-4.5b) model=scripts/shapes/llama-4.5b; batch=4; seq=4096 ;;
    qwen2-3b) model=scripts/shapes/qwen2-3b; batch=8; seq=2048 ;;
    *) echo "unknown shape $1 (bench-3b | llama-4.5b | qwen2-3b)"; return 2 ;;
  esac
}
