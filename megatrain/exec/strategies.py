"""The executor's registry of collective strategies: the task bodies and the host store a strategy substitutes.

A collective strategy (megatrain/parallel/, one module per strategy) builds on exec/ and registers its parts here;
exec never imports parallel/. This module loads no torch, so registering a strategy keeps the CLI torch-free.
- handlers: factory(step_work, world) -> {task kind: body}, the bodies that replace the one-GPU ones (`world` is
  the strategy's own process-group object);
- host store: factory(spec, layout, world, backend, tiles) -> a HostStore holding what one rank owns.
"""
from __future__ import annotations

from collections.abc import Callable

PARALLEL_HANDLERS: dict[str, Callable[..., dict[str, Callable]]] = {}
PARALLEL_KINDS: dict[str, frozenset[str]] = {}  # the task kinds (letters) each strategy's factory gives bodies for
HOST_STORES: dict[str, Callable] = {}


def register_parallel_handlers(strategy: str, factory: Callable[..., dict[str, Callable]], kinds: str) -> None:
    """Register the task bodies a data-parallel strategy substitutes (called by the strategy's module); `kinds`:
    the letters of the task kinds its factory returns bodies for (tests/test_vocabulary.py checks the union of
    the one-GPU bodies and these covers every kind)."""
    PARALLEL_HANDLERS[strategy] = factory
    PARALLEL_KINDS[strategy] = frozenset(kinds)


def register_host_store(strategy: str, factory: Callable) -> None:
    """Register how a data-parallel strategy builds one rank's host store (called by the strategy's module)."""
    HOST_STORES[strategy] = factory


def _registered(table: dict, strategy: str, what: str, world: int):
    if strategy not in table:
        raise ValueError(f"the Program runs data parallel ({strategy!r} over {world} ranks) and no such strategy's "
                         f"{what} is registered: import megatrain.parallel")
    return table[strategy]


def parallel_handlers(strategy: str, world: int) -> Callable[..., dict[str, Callable]]:
    """The handler factory of `strategy`; ValueError saying to import megatrain.parallel when none is registered."""
    return _registered(PARALLEL_HANDLERS, strategy, "task bodies", world)


def host_store(strategy: str, spec, layout, world, backend=None, tiles=None):
    """One rank's host store of `strategy` (`world`: the strategy's process-group object, with `.size`), built by
    the factory the strategy registered; ValueError saying to import megatrain.parallel when none is."""
    return _registered(HOST_STORES, strategy, "host store", world.size)(spec, layout, world, backend, tiles)
