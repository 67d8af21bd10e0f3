"""Training data: tokenizers and batch streams (token files, JSONL, synthetic)."""
