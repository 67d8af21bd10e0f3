"""The resolver: what the schedule knobs mean for a model, a batch and a sequence length, as a Placement.

`resolve()` is the only code that reads placement knobs and the only place that checks the rules between them:
every invalid combination is refused here with a message naming the knobs that conflict and what to set instead,
and a knob that would have no effect in a combination is refused rather than ignored (tests/test_placement.py
walks the knob space to prove it); settings that a model's shape clamps are reported in `Placement.notes`.

The seven optimizer placements users name are presets of the placement: a timing and a rule for choosing the
decoder layers updated on the GPU (`OPTIMIZER_PRESETS`).

The run's shape of parallelism (`Parallelism`: ranks, hosts, collective strategy) is resolved here too, and the
Placement carries it: everything the number of ranks and hosts supports is decided in this module
(`check_parallelism`, `check_model_shards`, `check_run_for_ranks`), and the store, the checkpoints and the run read
those checks instead of deciding again.
"""
from __future__ import annotations

from collections.abc import Callable

from megatrain.model.spec import EMBED, HEAD, ModelSpec
from megatrain.ir.dag import ScheduleError
from megatrain.compile.knobs import ScheduleKnobs
from megatrain.ir.hostlayout import HostLayout
from megatrain.ir.placement import (
    ONE_GPU,
    GradLanding,
    Parallelism,
    Placement,
    Timing,
    UnitPlacement,
    UpdateSite,
    gpu_buffers,
)


def _layer_selectors() -> dict[str, Callable[[int, int], list[int]]]:
    """Rules choosing n of L decoder layers for GPU updates, in forward order."""
    return {
        "none": lambda n, L: [],
        "all": lambda n, L: list(range(L)),
        "first": lambda n, L: list(range(n)),
        # n layers spread evenly over the depth from layer 0: during the next forward the host threads and the GPU
        # each update every few layers and proceed side by side (layer 0 on the GPU: its state copy overlaps the
        # host's update of the embedding, which the forward needs first).
        "spread": lambda n, L: [i * L // n for i in range(n)],
        # The same from the top, where the backward starts: the host threads fall behind the gradients as they
        # land, and each GPU layer lets them catch up before the bottom layers, whose updates end the step.
        "top-spread": lambda n, L: sorted(L - 1 - i * L // n for i in range(n)),
    }


LAYER_SELECTORS = _layer_selectors()

# optimizer placement name -> (timing, rule for the GPU-updated layers, whether gpu_optimizer_fraction sizes it)
OPTIMIZER_PRESETS: dict[str, tuple[Timing, str]] = {
    "after": (Timing.AFTER, "none"),
    "gpu": (Timing.AFTER, "all"),
    "split": (Timing.AFTER, "first"),
    "overlap": (Timing.OVERLAP, "none"),
    "overlap-split": (Timing.OVERLAP, "spread"),
    "arrival": (Timing.ARRIVAL, "none"),
    "arrival-split": (Timing.ARRIVAL, "top-spread"),
}
FRACTION_RULES = ("first", "spread", "top-spread")  # the rules gpu_optimizer_fraction sizes
DEFAULT_GPU_FRACTION = 0.5
DEFAULT_STATE_BUFFERS = 2
DEFAULT_STATE_LOOKAHEAD = 1
# mlp_tile_tokens unset: a micro-batch of more than AUTO_MLP_TILE_ABOVE tokens runs its MLP in tiles of
# AUTO_MLP_TILE tokens (up to there the (tokens, ffn) intermediates are small next to the rest; tiles of 8192 rows
# keep the matmuls as efficient as whole ones).
AUTO_MLP_TILE_ABOVE = 32768
AUTO_MLP_TILE = 8192


def resolve(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs,
            parallel: Parallelism = ONE_GPU) -> Placement:
    """The placement `knobs` mean for `spec` at batch x seq, run over `parallel`'s ranks and hosts (`batch` is one
    rank's share of the global batch); raises ScheduleError naming the conflicting knobs."""
    k, L = knobs, spec.num_layers
    if batch < 1 or seq < 1:
        raise ScheduleError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    if batch % k.micro_batches:
        raise ScheduleError(f"batch {batch} does not split into micro_batches={k.micro_batches}; choose a "
                            "micro-batch count that divides the batch")
    notes: list[str] = []
    ring_buffers, recompute_block = _ring(k, L, notes)
    timing, rule = OPTIMIZER_PRESETS[k.optimizer]
    gpu_layers = _gpu_layers(k, rule, L)
    _check_state_knobs(k, timing, gpu_layers)
    _check_ring_timing(k, timing)
    clip = _resolve_clip(k, timing)
    resident = _resident_units(spec, k, timing, gpu_layers)
    kept = _kept_grad_layers(k, gpu_layers)
    _check_host_state(k, gpu_layers, resident)
    state_order = gpu_layers[::-1] if timing is Timing.ARRIVAL else list(gpu_layers)
    state_buffers = min(k.state_buffers or DEFAULT_STATE_BUFFERS, len(gpu_layers))
    state_of = {u: f"s{i % state_buffers}" for i, u in enumerate(state_order)}
    units = tuple(_unit_placement(u, resident, gpu_layers, kept, state_of) for u in spec.units())
    grad_ring, ring_tiles = _gradient_ring(spec, k, units, notes)
    redo_next_step = _resolve_clip_redo(k, timing, clip, units)
    checkpoint_layers = tuple(range(0, L, recompute_block))
    offloaded = _offloaded_checkpoints(k, checkpoint_layers)
    tokens_mb = batch // k.micro_batches * seq
    if k.loss_chunk_tokens > tokens_mb:
        notes.append(f"loss_chunk_tokens={k.loss_chunk_tokens} is above the {tokens_mb} tokens of a micro-batch: "
                     "the loss runs in one chunk")
    mlp_tile_tokens = mlp_tile(k, tokens_mb, notes)
    graph_layers = _graph_layers(k, recompute_block, mlp_tile_tokens, parallel.world)
    check_parallelism(parallel, spec)
    _check_rank_updates(parallel, len(gpu_layers) + len(resident))
    placement = Placement(
        model=spec, batch=batch, seq=seq, timing=timing, units=units, ring_buffers=ring_buffers,
        recompute_block=recompute_block, micro_batches=k.micro_batches, checkpoint_layers=checkpoint_layers,
        offloaded_checkpoints=offloaded, state_order=tuple(state_order), state_buffers=state_buffers,
        state_lookahead=DEFAULT_STATE_LOOKAHEAD if k.state_lookahead is None else k.state_lookahead,
        buffers=(), weight_wire=k.weight_wire, grad_wire=k.grad_wire, compute_dtype=k.compute_dtype,
        layer_kernel="compiled" if k.compile_layers else "eager", clip_max_norm=clip,
        loss_chunk_tokens=k.loss_chunk_tokens, mlp_tile_tokens=mlp_tile_tokens, notes=tuple(notes),
        grad_ring=grad_ring, ring_tiles=ring_tiles, state_dtype=k.state_dtype, state_tier=k.state_tier,
        world=parallel.world, hosts=parallel.hosts, strategy=parallel.strategy, redo_next_step=redo_next_step,
        graph_layers=graph_layers)
    object.__setattr__(placement, "buffers", gpu_buffers(placement))
    return placement


def resolve_host_layout(spec: ModelSpec, knobs: ScheduleKnobs) -> HostLayout:
    """The host store's layout for a schedule, before any batch shape is known (it does not depend on one)."""
    return resolve(spec, knobs.micro_batches, 1, knobs).host_layout


# ---- what ranks and hosts support ------------------------------------------------------------------------------
def check_parallelism(parallel: Parallelism, spec: ModelSpec | None = None) -> None:
    """The rank and host counts, and (given `spec`) the model, that data parallelism supports whatever the
    schedule; ScheduleError naming the knob and the fix otherwise."""
    world, hosts = parallel.world, parallel.hosts
    if world < 1:
        raise ScheduleError(f"world size {world}: there must be at least one rank")
    if hosts < 1 or world % hosts:
        raise ScheduleError(f"{world} ranks cannot be spread evenly over {hosts} host(s): the world size must be a "
                            "multiple of the number of hosts (give --gpus per host)")
    if world > 1 and spec is not None:
        check_model_shards(spec)


def check_model_shards(spec: ModelSpec) -> None:
    """A model whose units the ranks can slice: the sharded store, its checkpoints and its HF loads ask here."""
    if spec.tie_word_embeddings:
        raise ScheduleError(f"{spec.name} ties its embeddings; data parallel training does not shard a tied "
                            "head yet. Train it on one GPU")


def _check_rank_updates(parallel: Parallelism, gpu_units: int) -> None:
    """Every rank updates its slices on its host: a unit updated on the GPU would need the whole unit's state."""
    if parallel.world > 1 and gpu_units:
        raise ScheduleError(f"data parallel over {parallel.world} ranks updates on the host only; this schedule "
                            f"updates {gpu_units} unit(s) on the GPU (optimizer gpu/split placements, "
                            "resident_layers, resident_embeddings). Use optimizer after, overlap or arrival with "
                            "world > 1")


def check_run_for_ranks(world: int, *, auto: bool = False, export_hf: bool = False,
                        checkpoint_at_end: bool = True) -> None:
    """The run-level choices `world` ranks support (`megatrain train` under torchrun): `--schedule auto` (each rank
    would choose on its own, and ranks must run one Program) and an HF export without the final checkpoint (the
    export reads every rank's slices from it). ScheduleError naming the setting and the fix otherwise."""
    if world <= 1:
        return
    if auto:
        raise ScheduleError(f"--schedule auto is not supported under torchrun ({world} ranks): choose the schedule "
                            "first (`megatrain simulate --schedule auto --gpus N ...`) and pass it to every rank")
    if export_hf and not checkpoint_at_end:
        raise ScheduleError(f"run.export_hf with {world} ranks exports the final checkpoint (rank 0 reads every "
                            "rank's slices): set run.checkpoint_at_end=true, or export later with `megatrain "
                            "export`")


def _ring(k: ScheduleKnobs, L: int, notes: list[str]) -> tuple[int, int]:
    """(weight ring slots, recompute block) in use: a model with fewer layers than either uses fewer (reported
    in the notes: the same schedule runs on a model cut to a few layers, as the profiler's real steps do)."""
    if k.buffers < k.recompute_block:
        r = k.recompute_block
        raise ScheduleError(f"{k.buffers} weight buffer(s) cannot hold the {r} layers that a recompute block keeps "
                            f"resident during its backward; use buffers >= {r} ({r + 1} to overlap the copies), "
                            "or a smaller recompute_block")
    buffers, block = k.buffers, k.recompute_block
    if L and buffers > L:
        notes.append(f"buffers={buffers} but the model has {L} layers: {L} ring slots are used")
        buffers = L
    if L and block > L:
        notes.append(f"recompute_block={block} but the model has {L} layers: one block of {L} spans the model")
        block = L
    return buffers, block


def _gpu_layers(k: ScheduleKnobs, rule: str, L: int) -> list[int]:
    """Decoder layers updated on the GPU with streamed state, in forward order."""
    if rule not in FRACTION_RULES:
        if k.gpu_optimizer_fraction is not None:
            what = "every layer" if rule == "all" else "no layer"
            raise ScheduleError(f"gpu_optimizer_fraction={k.gpu_optimizer_fraction} has no effect with "
                                f"optimizer={k.optimizer!r}, which updates {what} on the GPU; use one of "
                                f"split, overlap-split, arrival-split, or leave gpu_optimizer_fraction unset")
        return LAYER_SELECTORS[rule](L, L)
    fraction = DEFAULT_GPU_FRACTION if k.gpu_optimizer_fraction is None else k.gpu_optimizer_fraction
    return LAYER_SELECTORS[rule](round(fraction * L), L) if round(fraction * L) else []


def _check_state_knobs(k: ScheduleKnobs, timing: Timing, gpu_layers: list[int]) -> None:
    """state_buffers and state_lookahead exist only for GPU updates on streamed state."""
    if k.state_buffers is not None:
        if not gpu_layers:
            raise ScheduleError(f"state_buffers={k.state_buffers} sizes the GPU buffers of streamed GPU updates, "
                                f"but optimizer={k.optimizer!r} (gpu_optimizer_fraction="
                                f"{k.gpu_optimizer_fraction}) updates no layer on the GPU; leave it unset")
        if k.state_buffers > len(gpu_layers):
            raise ScheduleError(f"state_buffers={k.state_buffers} but only {len(gpu_layers)} layer(s) are updated on "
                                f"the GPU: the extra buffers would stay unused; use state_buffers <= "
                                f"{len(gpu_layers)}")
    if k.state_lookahead is not None:
        # Only where a state copy can be queued ahead of weight copies: "overlap" with GPU layers, and "arrival"
        # when the GPU layer's gradients stay on the GPU (otherwise S waits for its own gradients' OFFLOAD anyway).
        useful = gpu_layers and (timing is Timing.OVERLAP or (timing is Timing.ARRIVAL and k.retain_grads))
        if not useful:
            raise ScheduleError(f"state_lookahead={k.state_lookahead} has no effect with optimizer={k.optimizer!r}"
                                f" and retain_grads={k.retain_grads}: it queues state copies ahead of weight copies "
                                "for optimizer='overlap-split', or 'arrival-split' with retain_grads >= 1; leave "
                                "it unset")


def _resolve_clip_redo(k: ScheduleKnobs, timing: Timing, clip: float | None, units) -> bool:
    """Whether host units' CLIP_REDO runs at the start of the next step (knob clip_redo; unset: yes). Only
    speculative clipping (clip > 0, arrival timing) with a unit updated off the GPU-resident state has such redos."""
    applies = clip is not None and timing is Timing.ARRIVAL and any(not u.resident for u in units)
    if k.clip_redo is not None and not applies:
        raise ScheduleError(f"clip_redo={k.clip_redo!r} has no effect with optimizer={k.optimizer!r} and clip={k.clip}"
                            ": it times the redo of host updates under speculative clipping (an arrival placement "
                            "with clip > 0 and units not resident on the GPU); leave it unset")
    return applies and k.clip_redo != "step-end"


def _resolve_clip(k: ScheduleKnobs, timing: Timing) -> float | None:
    """The max norm of exact clipping, or None. With "arrival" timing the updates run before the global norm is
    known and are redone when it exceeds the max (speculative clipping): that needs each unit's gradients where the
    redo can read them until the norm is known."""
    if not k.clip:
        return None
    if timing is Timing.ARRIVAL and k.retain_grads:
        raise ScheduleError(f"clip={k.clip} with optimizer={k.optimizer!r} updates each unit as its gradients land "
                            "and redoes the update on the host when the global norm exceeds the max, which needs "
                            f"the gradients on the host; retain_grads={k.retain_grads} keeps them on the GPU: use "
                            "retain_grads=0, or clip=0")
    return float(k.clip)


def _check_ring_timing(k: ScheduleKnobs, timing: Timing) -> None:
    """A gradient ring needs updates that consume gradients as they land, and no global norm."""
    if not k.grad_ring:
        return
    if timing is not Timing.ARRIVAL:
        raise ScheduleError(f"grad_ring={k.grad_ring} lands gradients in a ring of tiles that the update must consume "
                            f"as they arrive, but optimizer={k.optimizer!r} updates after the backward (or in the "
                            "next step), when every unit's gradients must still be held; use optimizer='arrival' "
                            "(or 'arrival-split') with clip=0, or grad_ring=0")
    if k.clip:
        raise ScheduleError(f"grad_ring={k.grad_ring} cannot clip exactly (clip={k.clip}): the global norm is known "
                            "only once every unit's gradients have landed, so each unit's gradients must be kept "
                            "until then (a landing tile per unit: 4 B/param with grad_wire=fp32, 2 with bf16); use "
                            "clip=0 with the ring, or grad_ring=0 to clip")


def _gradient_ring(spec: ModelSpec, k: ScheduleKnobs, units: tuple[UnitPlacement, ...],
                   notes: list[str]) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(ring tiles, (unit, tile) in landing order) of the gradient ring; (0, ()) without one.

    Units land in backward order (head, layers L-1..0, embedding); a unit's tile is released by the tasks that read
    its gradients from the host: its host update or its state copy S (a GPU update), and for a tied head also the
    embedding's update (which adds the head's lm_head gradient into its own). Each landing takes the tile released
    earliest (builders.add_gradient_ring turns each reuse into an edge)."""
    if not k.grad_ring:
        return 0, ()
    landing = [u for u in [HEAD, *reversed(range(spec.num_layers)), EMBED]
               if next(p for p in units if p.unit == u).grads is GradLanding.HOST]
    if not landing:
        raise ScheduleError(f"grad_ring={k.grad_ring} but no unit's gradients land on the host (every unit is "
                            "resident or keeps its gradients on the GPU); use grad_ring=0")
    tied = spec.tie_word_embeddings and HEAD in landing and EMBED in landing
    if tied and k.grad_ring < 2:
        raise ScheduleError(f"grad_ring={k.grad_ring} with tied embeddings: the head's tile holds the lm_head "
                            "gradient until the embedding's update adds it into its own (the last to land), so the "
                            "other units need a tile of their own; use grad_ring >= 2")
    ring = k.grad_ring
    if ring > len(landing):
        notes.append(f"grad_ring={ring} but only {len(landing)} unit(s) land gradients on the host: {len(landing)} "
                     "ring tiles are used")
        ring = len(landing)
    free_at = [-1] * ring  # landing index after which each tile is free again
    release = {u: i for i, u in enumerate(landing)}
    if tied:
        release[HEAD] = len(landing)  # held until the embedding's update, the last landing's reader
    tiles = []
    for i, u in enumerate(landing):
        tile = min((t for t in range(ring) if free_at[t] < i), key=lambda t: (free_at[t], t))
        tiles.append((u, tile))
        free_at[tile] = release[u]
    return ring, tuple(tiles)


def _check_host_state(k: ScheduleKnobs, gpu_layers: list[int], resident: list[int]) -> None:
    """bf16 moments and the NVMe tier are layouts of the host store, for units the host threads update."""
    for name, value, default in (("state_dtype", k.state_dtype, "fp32"), ("state_tier", k.state_tier, "host")):
        if value != default and (gpu_layers or resident):
            raise ScheduleError(f"{name}={value!r} is a layout of the host updates' optimizer state, but optimizer="
                                f"{k.optimizer!r} (gpu_optimizer_fraction={k.gpu_optimizer_fraction}, resident "
                                f"units {len(resident)}) updates some units on the GPU, whose state buffers hold "
                                f"fp32 moments; use optimizer 'after', 'overlap' or 'arrival' without resident "
                                f"units, or {name}={default!r}")
    if k.state_dtype == "bf16" and k.clip and OPTIMIZER_PRESETS[k.optimizer][0] is Timing.ARRIVAL:
        raise ScheduleError(f"state_dtype='bf16' with clip={k.clip} and optimizer={k.optimizer!r}: speculative "
                            "clipping undoes an update from the moments it produced, which bf16 storage has "
                            "rounded; use clip=0, or optimizer='overlap' / 'after' (exact clipping without undo)")
    if k.state_tier == "nvme-all" and k.weight_wire == "fp32":
        raise ScheduleError("state_tier='nvme-all' puts the fp32 master on the NVMe drive, but weight_wire='fp32' "
                            "streams the master itself to the GPU from host memory; use weight_wire='bf16' (a bf16 "
                            "copy stays on the host) or state_tier='nvme-moments'")


def _resident_units(spec: ModelSpec, k: ScheduleKnobs, timing: Timing, gpu_layers: list[int]) -> list[int]:
    if not (k.resident_embeddings or k.resident_layers):
        return []
    if timing is not Timing.ARRIVAL:
        raise ScheduleError(f"resident_embeddings / resident_layers update their units on the GPU as the gradients "
                            f"land, which needs an arrival placement; optimizer={k.optimizer!r}: use "
                            "optimizer='arrival' or 'arrival-split' (clip=0), or no resident units")
    if k.resident_layers > spec.num_layers:
        raise ScheduleError(f"resident_layers={k.resident_layers} but the model has {spec.num_layers} layers")
    if k.resident_embeddings and spec.tie_word_embeddings:
        raise ScheduleError("resident_embeddings is not supported with tied embeddings (the head's matrix is the "
                            "embedding's, updated once for both); set resident_embeddings=false")
    clash = set(range(k.resident_layers)) & set(gpu_layers)
    if clash:
        raise ScheduleError(f"layers {sorted(clash)} are both resident (resident_layers={k.resident_layers}) and "
                            f"streamed for a GPU update (gpu_optimizer_fraction={k.gpu_optimizer_fraction}); lower "
                            "one of them")
    return ([EMBED, HEAD] if k.resident_embeddings else []) + list(range(k.resident_layers))


def _graph_layers(k: ScheduleKnobs, recompute_block: int, mlp_tile_tokens: int, world: int) -> tuple[int, ...]:
    """The layers whose forward keeps its autograd graph for the backward (knob keep_activations): the last n of the
    resident layers. Only a resident layer's weights stay put from its forward to its backward; the recompute
    block, the tiled MLP and a data-parallel rank's gathered weights each change what the backward would see."""
    n = k.keep_activations
    if not n:
        return ()
    if n > k.resident_layers:
        raise ScheduleError(f"keep_activations={n} but resident_layers={k.resident_layers}: only resident layers "
                            "keep their forward's graph (their weights stay on the GPU); raise resident_layers or "
                            "lower keep_activations")
    for bad, why in ((recompute_block > 1, f"recompute_block={recompute_block} (a block recomputes its layers)"),
                     (mlp_tile_tokens > 0, f"the tiled MLP (mlp_tile_tokens={mlp_tile_tokens}, long sequences)"),
                     (k.offload_checkpoints, "offload_checkpoints"),
                     (world > 1, f"{world} data-parallel ranks (a rank holds a slice of each resident layer)")):
        if bad:
            raise ScheduleError(f"keep_activations={n} is not supported with {why}; set keep_activations=0")
    return tuple(range(k.resident_layers - n, k.resident_layers))


def _kept_grad_layers(k: ScheduleKnobs, gpu_layers: list[int]) -> list[int]:
    """GPU-updated layers whose gradients stay on the GPU: the first `retain_grads` of them, in forward order."""
    if k.retain_grads > len(gpu_layers):
        if not gpu_layers:
            raise ScheduleError(f"retain_grads={k.retain_grads} keeps gradients of GPU-updated layers on the GPU, "
                                f"but optimizer={k.optimizer!r} updates every layer on the host; use one of gpu, "
                                "split, overlap-split, arrival-split, or retain_grads=0")
        raise ScheduleError(f"retain_grads={k.retain_grads} but only {len(gpu_layers)} layer(s) are updated on the "
                            f"GPU (optimizer={k.optimizer!r}, gpu_optimizer_fraction={k.gpu_optimizer_fraction}); "
                            f"use retain_grads <= {len(gpu_layers)} or a larger fraction")
    return gpu_layers[:k.retain_grads]


def _unit_placement(unit: int, resident: list[int], gpu_layers: list[int], kept: list[int],
                    state_of: dict[int, str]) -> UnitPlacement:
    if unit in resident:
        return UnitPlacement(unit, UpdateSite.GPU_RESIDENT, GradLanding.GPU_RESIDENT)
    if unit in gpu_layers:
        grads = GradLanding.GPU_KEPT if unit in kept else GradLanding.HOST
        return UnitPlacement(unit, UpdateSite.GPU_STREAMED, grads, state_of[unit])
    return UnitPlacement(unit, UpdateSite.HOST, GradLanding.HOST)


def mlp_tile(k: ScheduleKnobs, tokens_mb: int, notes: list[str]) -> int:
    """Tokens per tile of the layer's norm + MLP half (0: untiled): the knob, or chosen from the micro-batch."""
    if k.mlp_tile_tokens is None:
        return AUTO_MLP_TILE if tokens_mb > AUTO_MLP_TILE_ABOVE else 0
    if k.mlp_tile_tokens >= tokens_mb:
        notes.append(f"mlp_tile_tokens={k.mlp_tile_tokens} is not below the {tokens_mb} tokens of a micro-batch: "
                     "the MLP runs in one piece")
        return 0
    return k.mlp_tile_tokens


def _offloaded_checkpoints(k: ScheduleKnobs, checkpoint_layers: tuple[int, ...]) -> tuple[int, ...]:
    """Checkpoints that go to the host, bottom up: all but the top `gpu_checkpoints` blocks'."""
    if not k.offload_checkpoints:
        if k.gpu_checkpoints:
            raise ScheduleError(f"gpu_checkpoints={k.gpu_checkpoints} keeps some offloaded checkpoints on the GPU, "
                                "but offload_checkpoints is false (every checkpoint is on the GPU already); set "
                                "offload_checkpoints=true or gpu_checkpoints=0")
        return ()
    if k.gpu_checkpoints >= len(checkpoint_layers):
        raise ScheduleError(f"gpu_checkpoints={k.gpu_checkpoints} keeps every one of the {len(checkpoint_layers)} "
                            "checkpoints on the GPU, so offload_checkpoints offloads none; use gpu_checkpoints < "
                            f"{len(checkpoint_layers)} or offload_checkpoints=false")
    return checkpoint_layers[:len(checkpoint_layers) - k.gpu_checkpoints]
