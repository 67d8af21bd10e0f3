"""Data parallelism over the GPUs of one host: process groups and CPU affinity (world.py), the rank's slice of the
host store (shard.py), and the bodies of the collective tasks (work.py). The schedule side (slicing, the G and Z
tasks) is megatrain/ir/collectives.py; docs/multigpu.md describes the design."""
