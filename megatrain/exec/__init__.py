"""The streaming executor: stateless layer functions bound to GPU buffer slots, a host store, and a runtime
that interprets a Program on CUDA streams (or CPU threads standing in for them)."""
