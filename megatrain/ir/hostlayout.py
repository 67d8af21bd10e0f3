"""The host store's layout and its components, defined once: what the store holds and pins for a schedule, the same
for every batch shape (`Placement.host_layout` derives it; `exec.store.HostStore` allocates it,
`plan.memory.plan_host_memory` sizes it, `compile.collectives.rank_host_plan` slices it per rank).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class HostLayout:
    """What the host store holds and pins, the same for every batch shape of a schedule (`exec.store.HostStore`)."""

    weight_wire: str  # "bf16": a bf16 streaming copy is kept; "fp32": the master is streamed
    grad_wire: str  # dtype of the gradient landing tiles
    gpu_streamed_units: tuple[int, ...]  # units whose master and moments are copied to the GPU (pinned)
    grad_scratch_elements: int  # fp32 elements of the bf16 -> fp32 gradient conversion buffer (0: none needed)
    # Gradient ring (knob grad_ring): K landing tiles of `ring_tile_elements` each, and which tile each unit whose
    # gradients land on the host uses; K = 0: a landing tile per unit.
    grad_ring: int = 0
    ring_tiles: tuple[tuple[int, int], ...] = ()  # (unit, tile) in landing order
    ring_tile_elements: int = 0
    state_dtype: str = "fp32"  # Adam m and v
    state_scratch_elements: int = 0  # fp32 elements of each of the two m / v widening buffers (bf16 state)
    state_tier: str = "host"  # "nvme-moments" | "nvme-all": planned and simulated only
    # Layers resident on the GPU for the run (knob resident_layers): their gradients stay in their resident buffer
    # and their weights are never streamed, so the store gives them no landing tile and no streaming copy (4 + 2 B a
    # parameter; 19.5 GiB of llama3-8b's host store with 24 resident layers). Their master and moments stay: the
    # store is what checkpoints and schedule switches read (`DeviceBuffers.sync_resident_to_host`).
    resident_layers: tuple[int, ...] = ()

    def serves(self, other: HostLayout) -> bool:
        """Whether a store of this layout can run a Program whose placement needs `other`: the same layout, or
        `other` with more resident layers (a landing tile and streaming copy here for each unit that needs one
        there; a resident layer's go unused). A switch to a schedule this store serves keeps the store as it is."""
        return (replace(self, resident_layers=()) == replace(other, resident_layers=())
                and set(self.resident_layers) <= set(other.resident_layers))

    def host_tiled(self, units) -> list[int]:
        """Of `units`, those with a landing tile and a streaming copy in the store (every one but resident layers)."""
        resident = set(self.resident_layers)
        return [u for u in units if u not in resident]


@dataclass(frozen=True)
class HostComponent:
    """One component of the host store: its key (as the store and the planner index it), the name it is reported
    by, with `{dtype}` (and `{tiles}`) filled in from the layout, the dtype rule (a dtype word, or the HostLayout
    field that holds it), and whether a data-parallel rank holds only its slice (megatrain/parallel/shard.py)."""

    key: str
    name_format: str
    dtype: str  # "fp32" | "bf16" | a HostLayout field: "state_dtype", "grad_wire"
    sliced: bool

    def dtype_of(self, layout: HostLayout) -> str:
        return getattr(layout, self.dtype) if hasattr(layout, self.dtype) else self.dtype

    def name(self, layout: HostLayout) -> str:
        return self.name_format.format(dtype=self.dtype_of(layout), tiles=layout.grad_ring)


# The host store's components, defined once: the store (`exec.store.HostStore`) allocates them, the planner
# (`plan.memory.plan_host_memory`) sizes them and `compile.collectives.rank_host_plan` slices the `sliced` ones.
HOST_COMPONENTS = (
    HostComponent("master", "{dtype} master", "fp32", sliced=True),
    HostComponent("m", "adam m ({dtype})", "state_dtype", sliced=True),
    HostComponent("v", "adam v ({dtype})", "state_dtype", sliced=True),
    HostComponent("stream", "{dtype} streaming copy", "bf16", sliced=True),
    HostComponent("grads", "gradients ({dtype})", "grad_wire", sliced=True),  # a landing tile per unit
    # a ring of K tiles instead, each sized for the largest unit, whole on every rank
    HostComponent("grad_ring", "gradient ring ({tiles} tiles, {dtype})", "grad_wire", sliced=False),
    HostComponent("grad_scratch", "{dtype} gradient scratch", "fp32", sliced=False),
    HostComponent("state_scratch", "{dtype} m/v scratch", "fp32", sliced=False),
)
_COMPONENT = {c.key: c for c in HOST_COMPONENTS}


def host_components(layout: HostLayout) -> dict[str, HostComponent]:
    """The components of a layout's store by key; "grads" is the gradient ring's when the layout has one."""
    out = {c.key: c for c in HOST_COMPONENTS if c.key != "grad_ring"}
    if layout.grad_ring:
        out["grads"] = _COMPONENT["grad_ring"]
    return out


def host_component_names(layout: HostLayout) -> dict[str, str]:
    """The names of the host store's components, as the store (`exec.store.HostStore.bytes_by_component`) and the
    planner (`plan.memory.plan_host_memory`) both report them."""
    return {k: c.name(layout) for k, c in host_components(layout).items()}


def sliced_component_names(layout: HostLayout) -> set[str]:
    """Names of the components a data-parallel rank holds only its slice of."""
    return {c.name(layout) for c in host_components(layout).values() if c.sliced}


# Gradients that land in bf16 are converted to fp32 for the update this many elements at a time, in one reused
# host buffer (a fresh fp32 copy per update page-faulted ~0.9 GB per Llama-3-8B layer and made the update 1.5x
# slower on the H200 host).
GRAD_SCRATCH_ELEMENTS = 1 << 26
# bf16 moments are widened to fp32 for the update this many elements at a time (two 4 MiB buffers, m and v: small
# enough to stay in the cache between the widening, the update and the rounding back).
STATE_SCRATCH_ELEMENTS = 1 << 20
