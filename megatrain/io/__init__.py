"""Persistence: safetensors streaming, Hugging Face load and export, checkpoints (one process and sharded), one CheckpointError."""
