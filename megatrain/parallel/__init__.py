"""Data parallelism over the GPUs of one host: process groups and CPU affinity (world.py), the rank's slice of the
host store (shard.py), and the bodies of the collective tasks (work.py). The schedule side (slicing, the G and Z
tasks) is megatrain/compile/collectives.py; docs/multigpu.md describes the design."""

# Importing the package registers its strategies' task bodies with the executor (exec/ never imports parallel/).
from megatrain.parallel import work as _sharded_work  # noqa: E402,F401
