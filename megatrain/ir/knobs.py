"""Schedule knobs: what shapes a training step's DAG, the named schedules, and how knobs are read from names,
TOML files and `knob=value` overrides. Each knob changes the step's DAG (megatrain/ir/builders.py):

    buffers            k GPU weight slots in a ring (1 = no overlap, 2 = double buffering, ...); a layer still
                       resident from the forward is reused by its backward instead of being fetched again
    recompute_block    r: keep the input of every r-th layer; the backward of a block recomputes the inner
                       layers (RECOMPUTE tasks) and holds the block's r layers resident at once
    micro_batches      M micro-batches go through a layer per visit; gradients accumulate on the GPU
    optimizer          after   : every update after the step's backward (and global norm)
                       arrival : update a unit as soon as its gradients land (no exact clipping possible)
                       overlap : updates of the previous step's gradients run while this step streams forward;
                                 each PREFETCH(l) waits only for its own update
                       gpu     : decoder layers updated on the GPU with streamed master and moments
                       split   : the first `gpu_optimizer_fraction` of layers on the GPU, the rest on CPU threads
                       arrival-split : "arrival" with `gpu_optimizer_fraction` of the layers, spread evenly over
                                 the depth, updated on the GPU as their gradients land: S streams master + moments
                                 in during the backward of the layers above, U updates them on the compute stream,
                                 W sends them back; the host threads update the rest (no exact clipping)
                       overlap-split : "overlap" with `gpu_optimizer_fraction` of the layers, spread evenly over the
                                 depth, updated on the GPU: S streams master + moments (+ gradients) into a state
                                 slot, U updates them and writes the new weights straight into the layer's weight
                                 slot (no PREFETCH for its forward), W sends master + moments (+ streaming copy) back
    state_buffers      GPU state slots ("s0".."s{n-1}", 16 B/param of a layer each) for the GPU updates
    state_lookahead    "overlap-split": a layer's state copy S is queued on h2d before the weight copies of the
                       `state_lookahead` layers before it (so the link streams state while it waits for CPU updates)
    retain_grads       the first `retain_grads` GPU-updated layers (forward order) keep their gradients on the GPU
                       in a buffer of their own ("g<layer>") instead of sending them to the host and back: 4 B/param
                       of GPU memory each, saves 4 B/param on each PCIe direction
    weight_wire        "bf16": stream a bf16 copy kept on the host; "fp32": stream the fp32 master, cast on GPU
    grad_wire          dtype gradients travel to the host in ("fp32" or "bf16"); accumulation is fp32 on GPU
    clip               "exact": global-norm clipping over all gradients; "none"
    offload_checkpoints  send checkpointed activations to the host and back (long context)
    gpu_checkpoints    with offload_checkpoints: the checkpoints of the top n blocks stay on the GPU (their backward
                       comes first, so they would be fetched back at once); the host holds the rest
    resident_embeddings  keep the embedding and the head on the GPU for the whole run, with their fp32 master,
                       Adam moments and gradients (16 B/param): no copies for them, their update runs on the GPU as
                       their gradients land; the host copy is brought up to date by `StreamedTrainer.flush()`
                       (arrival placements; untied embeddings)
    resident_layers    r: the same for decoder layers 0..r-1 (the last gradients to land, the first weights needed)
    compile_layers     run the decoder layer through torch.compile (Inductor fuses the norms, RoPE, SwiGLU and
                       residual adds, forward and backward): the same DAG, faster F/R/B tasks; profile with the same
                       setting so that the simulator has compiled compute tables
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from ..spec import DTYPE_BYTES, EMBED, HEAD, ModelSpec
from .dag import ScheduleError

OPTIMIZER_PLACEMENTS = ("after", "arrival", "overlap", "gpu", "split", "overlap-split", "arrival-split")
GPU_PLACEMENTS = ("gpu", "split", "overlap-split", "arrival-split")
ARRIVAL_PLACEMENTS = ("arrival", "arrival-split")  # a unit is updated as soon as its gradients land  # placements that update layers on the GPU
WIRE_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class ScheduleKnobs:
    """Everything that shapes the step's DAG (see the module docstring)."""

    buffers: int = 2
    recompute_block: int = 1
    micro_batches: int = 1
    optimizer: str = "overlap"
    gpu_optimizer_fraction: float = 0.5
    weight_wire: str = "bf16"
    grad_wire: str = "fp32"
    clip: str = "exact"
    offload_checkpoints: bool = False
    gpu_checkpoints: int = 0
    compute_dtype: str = "bf16"
    loss_chunk_tokens: int = 2048
    state_buffers: int = 2
    state_lookahead: int = 1
    retain_grads: int = 0
    compile_layers: bool = False
    resident_embeddings: bool = False
    resident_layers: int = 0

    def __post_init__(self):
        def bad(name, allowed):
            raise ScheduleError(f"schedule knob {name}={getattr(self, name)!r} is invalid; use {allowed}")

        # bool is an int in Python: `True` is not a buffer count
        for name, least in (("buffers", 1), ("recompute_block", 1), ("micro_batches", 1), ("loss_chunk_tokens", 1),
                            ("state_buffers", 1), ("state_lookahead", 0), ("retain_grads", 0),
                            ("gpu_checkpoints", 0), ("resident_layers", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                bad(name, f"an integer >= {least}")
        for name in ("offload_checkpoints", "compile_layers", "resident_embeddings"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "true | false")
        if self.optimizer not in OPTIMIZER_PLACEMENTS:
            bad("optimizer", " | ".join(OPTIMIZER_PLACEMENTS))
        if not 0.0 <= self.gpu_optimizer_fraction <= 1.0:
            bad("gpu_optimizer_fraction", "a fraction in [0, 1]")
        for name in ("weight_wire", "grad_wire", "compute_dtype"):
            if getattr(self, name) not in WIRE_DTYPES:
                bad(name, " | ".join(WIRE_DTYPES))
        if self.clip not in ("exact", "none"):
            bad("clip", "exact | none")
        if self.optimizer in ARRIVAL_PLACEMENTS and self.clip == "exact":
            raise ScheduleError(
                f"optimizer={self.optimizer!r} updates a layer before the later layers' gradients exist, so the "
                "global norm that exact clipping needs is unknown then; use clip='none', or optimizer='overlap' "
                "(updates overlap the next forward and stay exact)"
            )
        if self.gpu_checkpoints and not self.offload_checkpoints:
            raise ScheduleError(f"gpu_checkpoints={self.gpu_checkpoints} keeps some offloaded checkpoints on the GPU, "
                                "but offload_checkpoints is false (every checkpoint is on the GPU already); set "
                                "offload_checkpoints=true or gpu_checkpoints=0")
        if (self.resident_embeddings or self.resident_layers) and self.optimizer not in ARRIVAL_PLACEMENTS:
            raise ScheduleError(f"resident_embeddings / resident_layers update their units on the GPU as the "
                                f"gradients land, which needs an arrival placement; optimizer={self.optimizer!r}: use "
                                f"optimizer='arrival' or 'arrival-split' (clip='none'), or no resident units")
        if self.retain_grads and self.optimizer not in GPU_PLACEMENTS:
            raise ScheduleError(f"retain_grads={self.retain_grads} keeps gradients of GPU-updated layers on the GPU, "
                                f"but optimizer={self.optimizer!r} updates every layer on the host; use one of "
                                f"{', '.join(GPU_PLACEMENTS)}, or retain_grads=0")

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


# Named schedules users refer to on the command line and in notebooks.
NAMED_SCHEDULES: dict[str, ScheduleKnobs] = {
    "serial": ScheduleKnobs(buffers=1, optimizer="after"),
    "double-buffer": ScheduleKnobs(buffers=2, optimizer="after"),
    "overlap": ScheduleKnobs(buffers=3, optimizer="overlap"),
    "arrival": ScheduleKnobs(buffers=3, optimizer="arrival", clip="none"),
    "gpu-adam": ScheduleKnobs(buffers=3, optimizer="gpu"),
    "split-adam": ScheduleKnobs(buffers=3, optimizer="split"),
    "overlap-split": ScheduleKnobs(buffers=3, optimizer="overlap-split", gpu_optimizer_fraction=0.4),
    "arrival-split": ScheduleKnobs(buffers=3, optimizer="arrival-split", clip="none", weight_wire="fp32",
                                   gpu_optimizer_fraction=0.25),
    "long-context": ScheduleKnobs(buffers=3, optimizer="overlap", offload_checkpoints=True),
    # The fastest without clipping (docs/performance.md): updates as gradients land, fp32 master streamed, the
    # layer compiled, embedding and head on the GPU for the whole run; add resident_layers as GPU memory allows.
    "arrival-resident": ScheduleKnobs(buffers=3, optimizer="arrival", clip="none", weight_wire="fp32",
                                      compile_layers=True, resident_embeddings=True),
}
DEFAULT_SCHEDULE = "overlap"


def knobs_for(name: str, **overrides) -> ScheduleKnobs:
    """A named schedule, with knobs overridden (`knobs_for("overlap", buffers=2)`)."""
    if name not in NAMED_SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; named schedules: {', '.join(NAMED_SCHEDULES)}")
    return replace(NAMED_SCHEDULES[name], **overrides)


def gpu_updated_layers(spec: ModelSpec, knobs: ScheduleKnobs) -> list[int]:
    """Decoder layers whose AdamW update runs on the GPU, in forward order.

    "gpu": all; "split": the first round(f * L); "overlap-split": round(f * L) spread evenly over the depth,
    starting with layer 0, so that during the next forward the host threads and the GPU each update every few
    layers and proceed side by side in forward order (layer 0 on the GPU: its state copy overlaps the host's
    update of the embedding, which the forward needs first).
    """
    L = spec.num_layers
    if knobs.optimizer == "gpu":
        return list(range(L))
    n = round(knobs.gpu_optimizer_fraction * L)
    if knobs.optimizer == "split":
        return list(range(n))
    if knobs.optimizer == "overlap-split":
        return [i * L // n for i in range(n)]
    if knobs.optimizer == "arrival-split":
        # From the top, where the backward starts: the host threads fall behind the gradients as they land, and
        # each GPU layer lets them catch up before the bottom layers, whose updates end the step.
        return sorted(L - 1 - i * L // n for i in range(n))
    return []


def offloaded_checkpoints(spec: ModelSpec, knobs: ScheduleKnobs) -> list[int]:
    """Layers whose checkpointed input goes to the host (the first layer of each recompute block), bottom up:
    none without offload_checkpoints; all but the top `gpu_checkpoints` blocks' with it."""
    if not knobs.offload_checkpoints:
        return []
    starts = list(range(0, spec.num_layers, knobs.recompute_block))
    return starts[:max(len(starts) - knobs.gpu_checkpoints, 0)]


def resident_units(spec: ModelSpec, knobs: ScheduleKnobs) -> list[int]:
    """Units that live on the GPU for the whole run (weights, Adam state, gradients): embedding and head with
    `resident_embeddings`, layers 0..resident_layers-1."""
    if knobs.resident_layers > spec.num_layers:
        raise ScheduleError(f"resident_layers={knobs.resident_layers} but the model has {spec.num_layers} layers")
    if knobs.resident_embeddings and spec.tie_word_embeddings:
        raise ScheduleError("resident_embeddings is not supported with tied embeddings (the head's matrix is the "
                            "embedding's, updated once for both); set resident_embeddings=false")
    clash = set(range(knobs.resident_layers)) & set(gpu_updated_layers(spec, knobs))
    if clash:
        raise ScheduleError(f"layers {sorted(clash)} are both resident (resident_layers={knobs.resident_layers}) and "
                            f"streamed for a GPU update (gpu_optimizer_fraction={knobs.gpu_optimizer_fraction}); "
                            f"lower one of them")
    return ([EMBED, HEAD] if knobs.resident_embeddings else []) + list(range(knobs.resident_layers))


def retained_grad_layers(spec: ModelSpec, knobs: ScheduleKnobs) -> list[int]:
    """GPU-updated layers whose gradients stay on the GPU (the first `retain_grads` of them, forward order)."""
    gpu = gpu_updated_layers(spec, knobs)
    if knobs.retain_grads > len(gpu):
        raise ScheduleError(f"retain_grads={knobs.retain_grads} but only {len(gpu)} layer(s) are updated on the GPU "
                            f"(optimizer={knobs.optimizer!r}, gpu_optimizer_fraction={knobs.gpu_optimizer_fraction}); "
                            f"use retain_grads <= {len(gpu)} or a larger fraction")
    return gpu[:knobs.retain_grads]


def parse_knob_value(name: str, text: str):
    """Convert `text` to the type of ScheduleKnobs field `name` ("3" -> 3, "true" -> True)."""
    types = {f.name: f.type for f in fields(ScheduleKnobs)}
    if name not in types:
        raise ScheduleError(f"unknown schedule knob {name!r}; known: {', '.join(sorted(types))}")
    kind = types[name] if isinstance(types[name], str) else types[name].__name__
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        return {"int": int, "float": float, "str": str}[kind](text)
    except ValueError:
        expected = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}[kind]
        raise ScheduleError(f"schedule knob {name} expects {expected}, got {text!r}") from None


def resolve_knobs(schedule: str = DEFAULT_SCHEDULE, overrides: list[str] | dict | None = None) -> tuple[str, ScheduleKnobs]:
    """Knobs from a named schedule or a TOML file (a [schedule] table of knob fields), then `knob=value` overrides.

    Returns (display name, knobs).
    """
    from pathlib import Path

    from ..tomlfile import read_toml

    if schedule in NAMED_SCHEDULES:
        name, knobs = schedule, NAMED_SCHEDULES[schedule]
    elif schedule.endswith(".toml") or Path(schedule).is_file():
        path = Path(schedule)
        data = read_toml(path, ScheduleError, "schedule file")
        table = data.get("schedule", data)
        base = table.pop("base", DEFAULT_SCHEDULE) if isinstance(table, dict) else DEFAULT_SCHEDULE
        name, knobs = path.stem, ScheduleKnobs.from_dict({**knobs_for(base).to_dict(), **table})
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
            pairs.append((k.strip(), parse_knob_value(k.strip(), v.strip())))
    if pairs:
        knobs = replace(knobs, **dict(pairs))
        name = name + "[" + ",".join(f"{k}={v}" for k, v in pairs) + "]"
    return name, knobs
