"""Schedule knobs: what shapes a training step's DAG, the named schedules, and how knobs are read from names,
TOML files and `knob=value` overrides. What the knobs mean together is `placement.resolve`'s to say (it
refuses combinations that conflict or where a knob would change nothing); each knob changes the step's DAG
(megatrain/compile/builders.py) or how its tasks run.

The knobs fall in three groups by what they decide: placement, step shape and numerics (`KNOB_GROUPS`, read from
each field's metadata, the one place a knob's group is written; `megatrain plan` prints the knobs so, and
docs/training.md lists them so). `--set` takes the bare name whatever the group (`--set buffers=2`). Separately,
a field marked `numbers=True` changes the numbers training computes (`NUMERICS_KNOBS`): `--schedule auto` keeps
those as given and searches only the others (the weight wire, say, moves the same values in another dtype).

PLACEMENT: where the optimizer's work and state live, and when updates run

    optimizer          after   : every update after the step's backward (and global norm)
                       arrival : update a unit as soon as its gradients land (with clip > 0: speculatively, redone with the
                                 clip coefficient in the steps whose global norm exceeds the max)
                       overlap : updates of the previous step's gradients run while this step streams forward;
                                 each PREFETCH(l) waits only for its own update
                       gpu     : decoder layers updated on the GPU with streamed master and moments
                       split   : the first `gpu_optimizer_fraction` of layers on the GPU, the rest on CPU threads
                       arrival-split : "arrival" with `gpu_optimizer_fraction` of the layers, spread evenly over
                                 the depth, updated on the GPU as their gradients land: S streams master + moments
                                 in during the backward of the layers above, U updates them on the compute stream,
                                 W sends them back; the host threads update the rest (clip > 0: as "arrival")
                       overlap-split : "overlap" with `gpu_optimizer_fraction` of the layers, spread evenly over the
                                 depth, updated on the GPU: S streams master + moments (+ gradients) into a state
                                 slot, U updates them and writes the new weights straight into the layer's weight
                                 slot (no PREFETCH for its forward), W sends master + moments (+ streaming copy) back
    gpu_optimizer_fraction  split, overlap-split, arrival-split only: the share of the decoder layers updated on
                       the GPU (default 0.5; unset elsewhere)
    resident_embeddings  keep the embedding and the head on the GPU for the whole run, with their fp32 master,
                       Adam moments and gradients (16 B/param): no copies for them, their update runs on the GPU as
                       their gradients land; the host copy is brought up to date by `StreamedTrainer.flush()`
                       (arrival placements; untied embeddings)
    resident_layers    r: the same for decoder layers 0..r-1 (the last gradients to land, the first weights needed)
    state_buffers      GPU state slots ("s0".."s{n-1}", 16 B/param of a layer each) for the GPU updates (default 2,
                       at most the GPU-updated layers; unset without GPU-updated layers)
    state_lookahead    "overlap-split": a layer's state copy S is queued on h2d before the weight copies of the
                       `state_lookahead` layers before it (so the link streams state while it waits for CPU updates);
                       "arrival-split" with retain_grads: S is queued before the backward fetch of the layer that
                       many above the next (default 1; unset elsewhere, where it would change nothing)
    retain_grads       the first `retain_grads` GPU-updated layers (forward order) keep their gradients on the GPU
                       in a buffer of their own ("g<layer>") instead of sending them to the host and back: 4 B/param
                       of GPU memory each, saves 4 B/param on each PCIe direction
    grad_ring          K > 0: gradients land in a ring of K pinned host tiles (each sized for the largest streamed
                       unit) instead of a tile per unit, and the host update consumes each as it arrives; an OFFLOAD
                       into a ring tile waits for the update that read the tile's previous unit. With weight_wire
                       fp32 the host then holds master + m + v only (12 B/param). Arrival placements with clip=0
                       only (exact clipping keeps every unit's gradients until the global norm is known: 4 B/param)
    state_dtype        "fp32" | "bf16": Adam m and v on the host (bf16: 4 B/param less; the update's math stays
                       fp32, chunk by chunk through an fp32 scratch; host-updated units only)
    clip_redo          speculative clipping (clip > 0 with an arrival placement) with host-updated units: when a
                       host unit's CLIP_REDO runs. "next-step" (the default where it applies): at the start of the
                       next step, before the copy of the unit's weights, so a step that clips has its host redos
                       overlap the next forward, and after a step that clipped the resident units' GPU updates
                       wait for the norm too (one clipped update each instead of update, undo and redo);
                       "step-end": host redos at the end of their own step, resident units always redone (what
                       ran before the knob existed: the records of those runs rebuild with it); unset elsewhere
    state_tier         "host" | "nvme-moments" | "nvme-all": where the optimizer state lives (m and v, or master +
                       m + v, on an NVMe drive, read and written by each host update); planned and simulated only,
                       `train` refuses it

STEP SHAPE: how a step is cut into copies and compute (weight slots, recompute, micro-batches, checkpoints)

    buffers            k GPU weight slots in a ring (1 = no overlap, 2 = double buffering, ...); a layer still
                       resident from the forward is reused by its backward instead of being fetched again
    recompute_block    r: keep the input of every r-th layer; the backward of a block recomputes the inner
                       layers (RECOMPUTE tasks) and holds the block's r layers resident at once
    micro_batches      M micro-batches go through a layer per visit; gradients accumulate on the GPU
    offload_checkpoints  send checkpointed activations to the host and back (long context)
    gpu_checkpoints    with offload_checkpoints: the checkpoints of the top n blocks stay on the GPU (their backward
                       comes first, so they would be fetched back at once); the host holds the rest
    keep_activations   n: the last n resident layers (of resident_layers) keep their forward's autograd graph for
                       their backward instead of recomputing it: a backward of 2 forwards' work instead of 3, for
                       the activations the graph saves (held from the layer's forward to its backward; `megatrain
                       plan` counts them). One process, recompute_block 1, untiled MLP

NUMERICS: the dtypes and kernels of the math, clipping, and the tiles the head and MLP run in

    weight_wire        "bf16": stream a bf16 copy kept on the host; "fp32": stream the fp32 master, cast on GPU
    grad_wire          dtype gradients travel to the host in ("fp32" or "bf16"); accumulation is fp32 on GPU
    compute_dtype      "bf16" | "fp32": the layers' math and the activations (checkpoints in this dtype)
    clip               the max global gradient norm: exact clipping over all gradients (default 1.0), as
                       torch.nn.utils.clip_grad_norm_; 0 = no global norm and no clipping (the named arrival
                       schedules' default). Arrival placements clip speculatively: each update runs unclipped as
                       its gradients land and is undone and redone (CLIP_REDO) only in steps whose norm exceeds clip
    compile_layers     run the decoder layer through torch.compile (Inductor fuses the norms, RoPE, SwiGLU and
                       residual adds, forward and backward): the same DAG, faster F/R/B tasks; profile with the same
                       setting so that the simulator has compiled compute tables
    loss_chunk_tokens  tokens per chunk of the fused head + loss (the fp32 logits of one chunk live at once)
    mlp_tile_tokens    tokens per tile of the layer's norm + MLP half (its (tokens, ffn) intermediates live for one
                       tile at a time, forward and backward; one more MLP forward per backward); 0 = untiled;
                       unset = tiles of 8192 tokens when a micro-batch has more than 32768 tokens, else untiled
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from megatrain.settings import SettingError, check_setting, field_types, parse_setting
from megatrain.model.spec import DTYPE_BYTES
from megatrain.ir.dag import ScheduleError
from megatrain.ir.placement import WIRE_DTYPES
from megatrain.tomlfile import read_toml
from pathlib import Path

# Presets of a timing and a rule for the GPU-updated layers (megatrain/ir/placement.py: OPTIMIZER_PRESETS).
OPTIMIZER_PLACEMENTS = ("after", "arrival", "overlap", "gpu", "split", "overlap-split", "arrival-split")
STATE_TIERS = ("host", "nvme-moments", "nvme-all")
CLIP_REDO_TIMES = ("next-step", "step-end")  # when a host unit's CLIP_REDO runs (the first: the default)


KNOB_GROUP_NAMES = ("placement", "step shape", "numerics")


def _knob(default, group: str, numbers: bool = False):
    """A ScheduleKnobs field in `group` (one of KNOB_GROUP_NAMES); numbers: it changes the numbers computed."""
    assert group in KNOB_GROUP_NAMES, group
    return field(default=default, metadata={"group": group, "numbers": numbers})


@dataclass(frozen=True)
class ScheduleKnobs:
    """Everything that shapes the step's DAG (see the module docstring; each field's group is in its metadata)."""

    buffers: int = _knob(2, "step shape")
    recompute_block: int = _knob(1, "step shape")
    micro_batches: int = _knob(1, "step shape", numbers=True)  # the sum of micro-batch gradients: another order
    optimizer: str = _knob("overlap", "placement")
    gpu_optimizer_fraction: float | None = _knob(None, "placement")  # split placements only (default 0.5)
    weight_wire: str = _knob("bf16", "numerics")
    grad_wire: str = _knob("fp32", "numerics", numbers=True)
    clip: float = _knob(1.0, "numerics", numbers=True)  # max global gradient norm (exact clipping); 0 = none
    offload_checkpoints: bool = _knob(False, "step shape")
    gpu_checkpoints: int = _knob(0, "step shape")
    keep_activations: int = _knob(0, "step shape")
    compute_dtype: str = _knob("bf16", "numerics", numbers=True)
    loss_chunk_tokens: int = _knob(2048, "numerics", numbers=True)
    mlp_tile_tokens: int | None = _knob(None, "numerics", numbers=True)  # unset: from the tokens (resolve.mlp_tile)
    state_buffers: int | None = _knob(None, "placement")  # GPU updates on streamed state only (default 2)
    state_lookahead: int | None = _knob(None, "placement")  # overlap-split, or arrival-split with retain_grads (1)
    retain_grads: int = _knob(0, "placement")
    compile_layers: bool = _knob(False, "numerics", numbers=True)
    resident_embeddings: bool = _knob(False, "placement")
    resident_layers: int = _knob(0, "placement")
    grad_ring: int = _knob(0, "placement")  # 0: a landing tile per unit; K: a ring of K tiles (arrival, clip=0)
    state_dtype: str = _knob("fp32", "placement", numbers=True)  # dtype of Adam m and v on the host
    state_tier: str = _knob("host", "placement")  # "nvme-*": planned and simulated only
    clip_redo: str | None = _knob(None, "placement")  # speculative clipping's host redos; unset: "next-step"

    def __post_init__(self):
        """Each knob's own type and range. The rules between knobs live in `placement.resolve`."""
        def bad(name, allowed):
            raise ScheduleError(f"schedule knob {name}={getattr(self, name)!r} is invalid; use {allowed}")

        # bool is an int in Python: `True` is not a buffer count
        for name, least, optional in (("buffers", 1, False), ("recompute_block", 1, False),
                                      ("micro_batches", 1, False), ("loss_chunk_tokens", 1, False),
                                      ("state_buffers", 1, True), ("state_lookahead", 0, True),
                                      ("retain_grads", 0, False), ("gpu_checkpoints", 0, False),
                                      ("resident_layers", 0, False), ("mlp_tile_tokens", 0, True),
                                      ("grad_ring", 0, False), ("keep_activations", 0, False)):
            value = getattr(self, name)
            if optional and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                bad(name, f"an integer >= {least}" + (" (or unset)" if optional else ""))
        for name in ("offload_checkpoints", "compile_layers", "resident_embeddings"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "true | false")
        if self.optimizer not in OPTIMIZER_PLACEMENTS:
            bad("optimizer", " | ".join(OPTIMIZER_PLACEMENTS))
        f = self.gpu_optimizer_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0):
            bad("gpu_optimizer_fraction", "a fraction in [0, 1] (or unset)")
        if self.state_tier not in STATE_TIERS:
            bad("state_tier", " | ".join(STATE_TIERS))
        if self.clip_redo is not None and self.clip_redo not in CLIP_REDO_TIMES:
            bad("clip_redo", " | ".join(CLIP_REDO_TIMES) + " (or unset)")
        for name in ("weight_wire", "grad_wire", "compute_dtype", "state_dtype"):
            if getattr(self, name) not in WIRE_DTYPES:
                bad(name, " | ".join(WIRE_DTYPES))
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) or not 0 <= self.clip < math.inf:
            bad("clip", "the max global gradient norm (a number > 0), or 0 for no clipping")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ScheduleKnobs:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ScheduleError(f"unknown schedule knob(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    def wire_bytes(self, which: str) -> int:
        return DTYPE_BYTES[WIRE_DTYPES[getattr(self, which)]]


# The knobs of each group, in field order, and those that change the numbers computed: read from the fields.
KNOB_GROUPS: dict[str, tuple[str, ...]] = {
    g: tuple(f.name for f in fields(ScheduleKnobs) if f.metadata["group"] == g) for g in KNOB_GROUP_NAMES}
NUMERICS_KNOBS: tuple[str, ...] = tuple(f.name for f in fields(ScheduleKnobs) if f.metadata["numbers"])


def knobs_by_group(knobs: ScheduleKnobs) -> dict[str, dict[str, object]]:
    """{group: {knob: value}} of `knobs`, groups and knobs in KNOB_GROUPS order (what `plan` prints)."""
    return {g: {name: getattr(knobs, name) for name in names} for g, names in KNOB_GROUPS.items()}


# Named schedules users refer to on the command line and in notebooks.
NAMED_SCHEDULES: dict[str, ScheduleKnobs] = {
    "serial": ScheduleKnobs(buffers=1, optimizer="after"),
    "double-buffer": ScheduleKnobs(buffers=2, optimizer="after"),
    "overlap": ScheduleKnobs(buffers=3, optimizer="overlap"),
    "arrival": ScheduleKnobs(buffers=3, optimizer="arrival", clip=0),
    "gpu-adam": ScheduleKnobs(buffers=3, optimizer="gpu"),
    "split-adam": ScheduleKnobs(buffers=3, optimizer="split"),
    "overlap-split": ScheduleKnobs(buffers=3, optimizer="overlap-split", gpu_optimizer_fraction=0.4),
    "arrival-split": ScheduleKnobs(buffers=3, optimizer="arrival-split", clip=0, weight_wire="fp32",
                                   gpu_optimizer_fraction=0.25),
    "long-context": ScheduleKnobs(buffers=3, optimizer="overlap", offload_checkpoints=True),
    # The fastest without clipping (docs/performance.md): updates as gradients land, fp32 master streamed, the
    # layer compiled, embedding and head on the GPU for the whole run; add resident_layers as GPU memory allows.
    "arrival-resident": ScheduleKnobs(buffers=3, optimizer="arrival", clip=0, weight_wire="fp32",
                                      compile_layers=True, resident_embeddings=True),
    # 12 bytes per parameter with exact fp32 AdamW (docs/training.md): the host holds the fp32 master and the
    # moments only; gradients land in a ring of two pinned tiles and are consumed as they arrive (no clipping).
    "lean": ScheduleKnobs(buffers=3, optimizer="arrival", clip=0, weight_wire="fp32", grad_ring=2),
}
DEFAULT_SCHEDULE = "overlap"


def knobs_for(name: str, **overrides) -> ScheduleKnobs:
    """A named schedule, with knobs overridden (`knobs_for("overlap", buffers=2)`)."""
    if name not in NAMED_SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; named schedules: {', '.join(NAMED_SCHEDULES)}")
    return replace(NAMED_SCHEDULES[name], **overrides)


def parse_knob_value(name: str, text: str):
    """`text` as the type of ScheduleKnobs field `name` ("3" -> 3, "on" -> True), in the one `--set` grammar of
    every command (megatrain/settings.py)."""
    types = field_types(ScheduleKnobs)
    if name not in types:
        raise ScheduleError(f"unknown schedule knob {name!r}; known: {', '.join(sorted(types))}")
    try:
        return parse_setting(f"schedule knob {name}", text, types[name])
    except SettingError as e:
        raise ScheduleError(str(e)) from None


def knobs_from_table(table: dict, source: str = "[schedule]") -> tuple[str, ScheduleKnobs]:
    """(name, knobs) of a `[schedule]` table: `name` (a named schedule, default "overlap") and the knobs set on top
    of it. The one dialect of schedule files and of the run config's `[schedule]` section."""
    if not isinstance(table, dict):
        raise ScheduleError(f"{source}: expected a table of schedule knobs, got {type(table).__name__}")
    table = dict(table)
    if "base" in table:
        raise ScheduleError(f"{source}: 'base' is now 'name' (the named schedule the knobs start from): "
                            f"write name = {table['base']!r}")
    name = table.pop("name", DEFAULT_SCHEDULE)
    if not isinstance(name, str) or name not in NAMED_SCHEDULES:
        raise ScheduleError(f"{source}: name={name!r} is not a named schedule; use one of "
                            f"{', '.join(NAMED_SCHEDULES)}")
    types = field_types(ScheduleKnobs)
    unknown = sorted(set(table) - set(types))
    if unknown:
        raise ScheduleError(f"{source}: unknown schedule knob(s) {unknown}; known: name, {', '.join(sorted(types))}")
    try:
        values = {k: check_setting(f"schedule.{k}", v, types[k]) for k, v in table.items()}
    except SettingError as e:
        raise ScheduleError(f"{source}: {e}") from None
    return name, knobs_for(name, **values)


def resolve_knobs(schedule: str = DEFAULT_SCHEDULE,
                  overrides: list[str] | dict | None = None) -> tuple[str, ScheduleKnobs]:
    """Knobs from a named schedule or a TOML file (a [schedule] table: `name` plus knobs), then `knob=value`
    overrides. Returns (display name, knobs)."""

    if schedule in NAMED_SCHEDULES:
        name, knobs = schedule, NAMED_SCHEDULES[schedule]
    elif schedule.endswith(".toml") or Path(schedule).is_file():
        path = Path(schedule)
        data = read_toml(path, ScheduleError, "schedule file")
        _, knobs = knobs_from_table(data.get("schedule", data), f"{path}: [schedule]")
        name = path.stem
    else:
        raise ScheduleError(f"unknown schedule {schedule!r}: give one of {', '.join(NAMED_SCHEDULES)} or a .toml file")
    if isinstance(overrides, dict):
        pairs = list(overrides.items())
    else:
        pairs = []
        for item in overrides or []:
            if "=" not in item:
                raise ScheduleError(f"override {item!r} is not knob=value (e.g. buffers=3)")
            k, v = item.split("=", 1)
            k = k.strip().removeprefix("schedule.")
            pairs.append((k, parse_knob_value(k, v)))
    if pairs:
        knobs = replace(knobs, **dict(pairs))
        name = name + "[" + ",".join(f"{k}={v}" for k, v in pairs) + "]"
    return name, knobs
