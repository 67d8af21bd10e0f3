"""Data parallelism: process groups and CPU affinity (world.py), and the collective strategies, one module each
(sharded.py: each rank owns a slice of every unit). Importing the package registers every strategy's lowering
passes, costs, task bodies and host store with compile/, sim/ and exec/, which never import parallel/.
docs/multigpu.md describes the design and how to add a strategy."""

from megatrain.parallel import sharded  # noqa: F401  (registers the "sharded" strategy)
