"""`measure_profile`: measure this machine with the executor's own code and build a HardwareProfile from it.

    from megatrain.profiling import ProfileRequest, measure_profile
    cal = measure_profile(ProfileRequest(PRESETS["bench-3b"], batch=8, seqs=[2048], device="cuda"))
    cal.save("h200-measured.json")          # + h200-measured.measurements.json (every timing, for docs)
    simulate(program, cal.profile)

What is measured, and the profile field it fills:

    copies.py    h2d / d2h copy time by size (pinned buffers, each direction from its stream's thread)   h2d, d2h
                 each direction while the other runs                                                     duplex_Bps
    units.py     layer F / R / B, embedding F / B, head FH, by tokens per task             compute_tables
    rates.py     matmul FLOP/s by dtype (analytic fallback), efficiency from the tables    matmul_flops_per_s, ...
                 device memory bandwidth                                                   gpu_memory_Bps
                 CPU AdamW (+ streaming-copy refresh) by thread count, fixed cost per call cpu_adam_params_per_s
                 AdamW on device tiles                                                     gpu_adam_params_per_s
    host.py      host memory bandwidth alone (streaming read + write at the update threads)
    operating.py the runtime's own PREFETCH / OFFLOAD copies of a layer and its Updates.update: alone, both
                 copies at once, the update beside h2d, d2h, both   h2d / d2h points, duplex_Bps, cpu_adam_params_
                 and copies beside it (host.py's fit); the redo    per_s, host_memory_Bps, cpu_update_bytes_per_param
    overhead.py  ready-to-start gaps of real steps of a 2-layer cut of the model           task_overhead_s
    collectives.py  (under torchrun, every rank, before the rest: cli/profile.py) all-gather,
                 reduce-scatter, all-reduce by message size                                collectives

and, recorded in the notes and the measurements file but not (yet) used by the simulator: how much a CPU update
slows a layer's compute and a layer's compute the update (see docs/calibration.md). The profile records the machine
(`HardwareProfile.machine`, profiling/machine.py).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from megatrain.exec.backend import get_backend
from megatrain.ir.streams import COPY_STREAMS, ONE_GPU_STREAMS
from megatrain.model.layout import unit_layout
from megatrain.compile.knobs import ScheduleKnobs, knobs_for
from megatrain.sim.profile import HardwareProfile
from megatrain.model.spec import EMBED, HEAD, ModelSpec
from megatrain.engine.trainer import set_update_threads
from megatrain.profiling import copies, host, operating, rates, units
from megatrain.profiling.assemble import build_profile
from megatrain.profiling.bench import Progress, Worker, _fmt_s, median
from megatrain.profiling.machine import this_machine
from megatrain.profiling.overhead import cpu_update_samples, measure_runtime_gaps
from megatrain.units import MiB, GiB

STREAMS = ONE_GPU_STREAMS  # a profile is measured on one GPU: no comm stream (ir/streams.py)
LONG_PROFILE_S = 600.0  # an estimate above this suggests --quick


@dataclass
class ProfileRequest:
    """What to measure: the model shape, token counts (batch 1..`batch` at each of `seqs`), compute dtypes."""

    model: ModelSpec
    batch: int = 8
    seqs: list[int] = field(default_factory=lambda: [2048])
    device: str = "auto"
    dtypes: list[str] | None = None  # compute dtypes of the tables; default bf16 on CUDA, bf16 + fp32 on CPU
    quick: bool = False
    knobs: ScheduleKnobs = field(default_factory=lambda: knobs_for("overlap"))  # wire dtypes, loss chunk, the
    #                                                           schedule of the real steps that measure overheads
    cpu_threads: int | None = None  # AdamW threads of the runtime (default: what the trainer picks)
    also_models: list[ModelSpec] = field(default_factory=list)  # more shapes to measure compute tables for
    name: str | None = None


@dataclass
class Calibration:
    """The profile and everything measured to build it (JSON-able, for the record)."""

    profile: HardwareProfile
    measurements: dict

    def save(self, path: str | Path) -> tuple[Path, Path]:
        """Write the profile JSON (loadable by `load_profile`) and `<stem>.measurements.json` next to it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.profile.save(path)
        raw = path.with_name(path.stem + ".measurements.json")
        raw.write_text(json.dumps(self.measurements, indent=1, default=float) + "\n")
        return path, raw


def _machine(backend) -> dict:
    """This machine (profiling/machine.py: CPU model, cores, memory, GPU name and count, torch, date) and the
    backend measured; the GPU name as torch sees the device measured."""
    info = this_machine(backend.name)
    if backend.name == "cuda":
        info["gpu"] = torch.cuda.get_device_name(backend.device)
    return info


class _Plan:
    """The measurements, each with an estimated duration (from a first probe) and the function that runs it."""

    def __init__(self):
        self.items: list[tuple[str, float, callable]] = []

    def add(self, label: str, est_s: float, fn) -> None:
        self.items.append((label, est_s, fn))

    @property
    def total_s(self) -> float:
        return sum(est for _, est, _ in self.items)


def _max_copy_bytes(spec: ModelSpec, on_gpu: bool, quick: bool) -> int:
    """The largest copy measured: 4x a layer's fp32 bytes rounded up to a power of two, within [4 MiB, 1 GiB]
    (64 MiB on the CPU backend, where copies are memcpy); smaller with `quick`."""
    layer_n = unit_layout(spec, 0).numel
    n = max(4 * MiB, min((1 * GiB) if on_gpu else 64 * MiB, 1 << (4 * layer_n - 1).bit_length()))
    return min(n, (256 if on_gpu else 16) * MiB) if quick else n


def profile_host_reserve(spec: ModelSpec, device: str, quick: bool) -> int:
    """Host bytes a profile holds besides its 2-layer cut: two pairs of copy buffers (pinned host + device; on
    the CPU backend the "device" half is host memory too). For the memory check before measuring."""
    on_gpu = device.startswith("cuda")
    return 2 * (1 if on_gpu else 2) * _max_copy_bytes(spec, on_gpu, quick)


def _probe_matmul(worker: Worker, backend, on_gpu: bool) -> float:
    """FLOP/s of a small matmul, the fastest call of a second round: the first calls in a fresh worker thread
    pay for its OpenMP pool (12 ms for a 0.2 ms matmul on the 2-core CPU machine), which made the estimate of the
    same profile swing between 4 hours and 12 days."""
    n, dtype = (2048, torch.bfloat16) if on_gpu else (256, torch.float32)
    a, b = (worker.call(lambda: torch.randn(n, n, device=backend.device).to(dtype)) for _ in range(2))
    worker.time_for(lambda: a @ b, 0.05, warmup=2)  # warms the thread
    return 2.0 * n**3 / min(worker.time_for(lambda: a @ b, 0.1, warmup=1))


def long_profile_hint(plan: _Plan, quick: _Plan | None) -> str:
    """What a long profile can do about it: --quick (when not already), and its longest measurement."""
    label, est, _ = max(plan.items, key=lambda item: item[1])
    hint = "that is long: "
    if quick is not None:
        hint += (f"--quick measures fewer sizes, token counts and repetitions (about {_fmt_s(quick.total_s)}); ")
    return hint + (f"the longest measurement is {label} (about {_fmt_s(est)}): a smaller --batch or --seq shortens "
                   "the compute tables; Ctrl-C now costs nothing")


def measure_profile(req: ProfileRequest, log=print) -> Calibration:
    """Measure the machine for `req.model` and return the Calibration (see the module docstring)."""
    spec = req.model
    backend = get_backend(req.device)
    on_gpu = backend.name == "cuda"
    # CPUs without bf16 arithmetic run the CPU backend fastest in fp32, so fp32 comes first there (the dtype of
    # contention tests, the real steps and the fitted efficiency).
    dtypes = req.dtypes or (["bf16"] if on_gpu else ["fp32", "bf16"])
    req = replace(req, dtypes=dtypes)
    threads = set_update_threads(backend, req.cpu_threads)  # as the trainer will: the updates' thread count
    info = _machine(backend)
    w = {s: Worker(backend, s) for s in STREAMS}
    m: dict = {"machine": info, "request": {"model": spec.name, "signature": None, "batch": req.batch,
                                             "seqs": req.seqs, "dtypes": dtypes, "quick": req.quick,
                                             "knobs": req.knobs.to_dict(), "cpu_threads": threads}}
    bufs: dict = {}  # the copy buffers, allocated by the first measurement and released at the end
    # -- probe: rough rates, to say up front how long this takes --
    probe_rate = _probe_matmul(w["compute"], backend, on_gpu)

    def build(req: ProfileRequest) -> _Plan:
        """The measurements `req` asks for, each with its estimated duration (nothing is measured yet)."""
        quick = req.quick
        layer_n = unit_layout(spec, 0).numel
        max_copy = _max_copy_bytes(spec, on_gpu, quick)
        budget = 0.25 if quick else 1.0  # seconds of timed calls per measurement (compute: per unit class)

        per_op = 5e-6 if on_gpu else 15e-6  # dispatch of one op (a kernel launch, or Python + ATen on the CPU)
        ops = {"layer": 50, "embed": 3, "head": 40}

        def call_s(shape, uclass, kind, b, seq, dtype) -> float:
            """Rough seconds of one compute task: its ops' dispatch, or its FLOPs at a third of the probed rate."""
            slow = {True: {"fp32": 15.0}, False: {"bf16": 4.0}}[on_gpu].get(dtype, 1.0)  # the dtype not probed
            flops = units.analytic_flops(shape, uclass, kind, b, seq)
            return max(ops[uclass] * per_op * (3 if kind == "B" else 1), slow * flops / (0.3 * probe_rate))

        def timed(budget_s: float, call: float) -> float:
            """`Worker.time_for`: warm-up + first call, then up to 3 rounds of at most 50 calls within the budget."""
            return 2 * call + min(budget_s, 150 * call)

        plan = _Plan()
        plan.add("copy buffers", 0.5 + 3 * max_copy / 2e9, lambda: _alloc(bufs, backend, max_copy))
        sizes = copies.copy_sizes(max_copy, quick)
        for d in ("h2d", "d2h"):
            plan.add(f"{d} copies, {len(sizes)} sizes up to {max_copy / MiB:.0f} MiB",
                     0.2 + sum(copies._reps_for(n, quick) * (n / 5e9 + 2e-5) for n in sizes),
                     lambda d=d: _copy_curve(m, bufs, w, d, sizes, quick))
        dup = min(max_copy, 256 * MiB)
        plan.add("both directions at once", 0.5 + 12 * dup / 5e9, lambda: _duplex(m, bufs, w, dup, quick))
        for shape in [spec, *req.also_models]:
            for dt in dtypes:
                knobs = replace(req.knobs, compute_dtype=dt)
                for seq in req.seqs:
                    bs = units.token_batches(req.batch, quick)
                    for uc in ("layer", "embed", "head"):
                        kinds = units.KINDS_OF_CLASS[uc]
                        each = budget / (len(bs) * len(kinds))
                        est = sum(timed(each, call_s(shape, uc, k, b, seq, dt)) for b in bs for k in kinds)
                        what = f"{shape.name} " if req.also_models else ""
                        plan.add(f"{what}{uc} compute, {dt}, seq {seq}, tokens {[b * seq for b in bs]}", est,
                                 lambda uc=uc, knobs=knobs, seq=seq, bs=bs, shape=shape: _unit(
                                     m, shape, uc, knobs, seq, bs, backend, w["compute"], budget, quick))
        for dt in ("bf16", "fp32"):
            plan.add(f"matmul {dt}", budget / 2 + 0.1, lambda dt=dt: _matmul(m, w, backend, dt, on_gpu, budget / 2))
        plan.add("device memory bandwidth", budget / 2 + 0.1, lambda: _memory(m, w, backend, max_copy, budget / 2))
        stream_copy = req.knobs.weight_wire == "bf16"
        adam_1 = 1e-4 + layer_n / 3e8  # one update on one thread
        counts = rates.thread_counts(threads, info["cores"], quick)
        plan.add(f"CPU AdamW on {layer_n / 1e6:.2f} M-parameter tiles by threads",
                 sum(timed(2 * budget / (len(counts) + 2), adam_1 / t) for t in counts) + layer_n * 18 / 2e9,
                 lambda: _cpu_adam(m, w, layer_n, threads, info["cores"], False, quick, 2 * budget))
        plan.add("bf16 streaming-copy refresh", budget / 2 + 0.1,
                 lambda: _refresh(m, w, layer_n, threads, budget / 2))
        plan.add("AdamW on device tiles", budget / 2 + 0.2, lambda: _gpu_adam(m, w, backend, layer_n, budget / 2))
        host_bytes = _host_stream_bytes(on_gpu, quick)
        plan.add(f"host memory bandwidth ({host_bytes // MiB} MiB streaming copy, {threads} threads)",
                 budget / 2 + 0.1 + 3 * host_bytes / 5e9, lambda: _host_memory(m, w, threads, host_bytes, budget / 2))
        unit_bytes = 6 * layer_n  # a layer's weights in (bf16) and gradients out (fp32), about
        plan.add("the runtime's copies (a layer's PREFETCH / OFFLOAD) alone, both at once, beside its CPU update "
                 "(Updates.update) and the update beside them; its clipping redo",
                 budget + 0.5 + 60 * unit_bytes / 5e9 + 4 * layer_n * 4e-9 + 60 * adam_1 / threads,
                 lambda: _operating_point(m, spec, req, backend, w, threads, budget, quick))
        plan.add("layer forward and backward beside copies in both directions", 4 * budget + 0.5,
                 lambda: _compute_beside_copies(m, spec, req, backend, w, bufs, 4 * budget))
        plan.add("layer forward and backward back to back, a step's pattern (burst vs sustained)", 4 * budget + 0.5,
                 lambda: _compute_sustained(m, spec, req, backend, w, 4 * budget))
        plan.add("layer forward while a CPU update runs", budget + 0.2,
                 lambda: _compute_under_update(m, spec, req, backend, w, layer_n, stream_copy, budget))
        plan.add("CPU update while the compute stream runs a layer forward", budget + 0.2,
                 lambda: _update_under_compute(m, spec, req, backend, w, layer_n, stream_copy, budget))
        plan.add("first layer forward in a fresh thread", 0.3, lambda: _fresh_thread(m, spec, req, backend, w))
        plan.add("host wait on a device event", 0.2 if on_gpu else 0.0,
                 lambda: _host_wait(m, backend, w))
        steps = 3 if quick else 5
        step_s = sum(call_s(spec, uc, k, req.batch, req.seqs[0], dtypes[0])
                     for uc, k in (("layer", "F"), ("layer", "F"), ("layer", "B"), ("layer", "B"), ("head", "F")))
        cut_params = 2 * layer_n + unit_layout(spec, EMBED).numel + unit_layout(spec, HEAD).numel
        plan.add(f"{steps} real steps of a 2-layer cut ({req.knobs.optimizer} placement, {req.knobs.buffers} buffers)",
                 0.1 + cut_params * 30e-9 + steps * (step_s + 2 * adam_1 / threads),  # init + store, then steps
                 lambda: _runtime(m, spec, req, backend, threads, steps))
        return plan


    plan = build(req)
    progress = Progress([(label, est) for label, est, _ in plan.items], log)
    progress.announce(f"profiling {backend.name} for {spec.name} (batch {req.batch}, seq {req.seqs}, "
                      f"{'/'.join(dtypes)}{', quick' if req.quick else ''})")
    if plan.total_s > LONG_PROFILE_S:  # say so before the hours start, not after
        log(long_profile_hint(plan, None if req.quick else build(replace(req, quick=True))))
    m["phases_s"] = {}  # what each measurement cost (`slowest_phases`): where a slow profile's time went
    try:
        for label, _, fn in plan.items:
            t0 = time.perf_counter()
            result = fn() or "done"
            m["phases_s"][label] = round(time.perf_counter() - t0, 2)
            progress.done(label, result)
    finally:
        for wk in w.values():
            wk.close()
        if "buffers" in bufs:
            for b in bufs["buffers"]:
                b.release(backend)
    profile = build_profile(m, spec, req, dtypes, threads, info)
    m["request"]["signature"] = profile.compute_tables[0].model if profile.compute_tables else None
    return Calibration(profile, m)


def slowest_phases(measurements: dict, n: int = 3) -> str:
    """The `n` measurements of a profile that took longest, with their seconds ("" for a profile measured before
    `phases_s` was recorded)."""
    phases = sorted(measurements.get("phases_s", {}).items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{label} {seconds:.1f} s" for label, seconds in phases)


# ---- the measurement steps (each stores into m and returns a one-line result) ---------------------------------
def _alloc(bufs, backend, nbytes):
    bufs["buffers"] = [copies.CopyBuffers.allocate(backend, nbytes) for _ in range(2)]
    return f"2 x {nbytes / MiB:.0f} MiB pinned host + device"


def _copy_curve(m, bufs, w, direction, sizes, quick):
    r = copies.measure_curve(bufs["buffers"][0], w[direction], direction, sizes, quick)
    m[direction] = {"sizes_bytes": r["sizes_bytes"], "time_s": r["time_s"], "latency_s": r["curve"].latency_s,
                    "Bps": list(r["curve"].Bps)}
    c = r["curve"]
    return f"latency {c.latency_s * 1e6:.1f} us, {c.Bps[-1] / 1e9:.2f} GB/s at {sizes[-1] / MiB:.0f} MiB"


def _duplex(m, bufs, w, nbytes, quick):
    r = copies.measure_duplex(bufs["buffers"][0], bufs["buffers"][1], w["h2d"], w["d2h"], nbytes, quick)
    m["duplex"] = r
    return (f"h2d {r['h2d_shared_Bps'] / 1e9:.2f} + d2h {r['d2h_shared_Bps'] / 1e9:.2f} = "
            f"{r['duplex_Bps'] / 1e9:.2f} GB/s")


def _unit(m, spec, uclass, knobs, seq, bs, backend, worker, budget, quick):
    tables, raw = units.measure_unit(spec, uclass, knobs, seq, bs, backend, worker, budget, quick)
    m.setdefault("compute_tables", []).extend(asdict(t) for t in tables)
    m.setdefault("compute_raw", []).extend(raw)
    return ", ".join(f"{t.kind} {t.dur_s[-1] * 1e3:.3f} ms" for t in tables) + f" at {tables[0].tokens[-1]} tokens"


def _matmul(m, w, backend, dt, on_gpu, budget):
    n = 4096 if on_gpu else (512 if dt == "fp32" else 256)
    r = rates.measure_matmul(w["compute"], backend, {"bf16": torch.bfloat16, "fp32": torch.float32}[dt], n, budget)
    m.setdefault("matmul_flops_per_s", {})[dt] = r
    return f"{r / 1e12:.3f} TFLOP/s at {n}^3"


def _memory(m, w, backend, nbytes, budget):
    m["gpu_memory_Bps"] = rates.measure_memory(w["compute"], backend, nbytes, budget)
    return f"{m['gpu_memory_Bps'] / 1e9:.1f} GB/s (read + write)"


def _cpu_adam(m, w, n, threads, cores, stream_copy, quick, budget):
    r = rates.measure_cpu_adam(w["cpu"], n, threads, cores, stream_copy, quick, budget)
    m["cpu_adam"] = r
    by = ", ".join(f"{t}: {v / 1e9:.2f}" for t, v in r["by_threads"].items())
    return f"Gparam/s by threads {by}; fixed {r['fixed_s'] * 1e6:.0f} us per update ({threads} threads)"


def _refresh(m, w, n, threads, budget):
    r = rates.measure_refresh(w["cpu"], n, threads, budget)
    m["cpu_refresh"] = r
    return f"{r['rate'] / 1e9:.2f} Gparam/s ({threads} threads)"


def _gpu_adam(m, w, backend, n, budget):
    m["gpu_adam"] = rates.measure_gpu_adam(w["compute"], backend, n, budget)
    return f"{m['gpu_adam']['rate'] / 1e9:.2f} Gparam/s"


def _update_fn(n, stream_copy):
    tiles = rates.AdamTiles(n, torch.device("cpu"), stream_copy)
    return tiles.update


def _host_stream_bytes(on_gpu: bool, quick: bool) -> int:
    """The streaming copy that measures host memory bandwidth: well beyond the last-level cache (256 MiB on a GPU
    host, 64 MiB on the CPU backend; half with `quick`)."""
    return (256 if on_gpu else 64) * MiB // (2 if quick else 1)


def _host_memory(m, w, threads, nbytes, budget):
    m["host_memory"] = host.measure_host_memory(w["cpu"], threads, nbytes, budget)
    return f"{m['host_memory']['Bps'] / 1e9:.1f} GB/s read + write"


def _operating_point(m, spec, req, backend, w, threads, budget, quick):
    r = operating.measure_operating_point(spec, req.batch, req.seqs[0], _run_knobs(req, backend), backend, w,
                                          threads, budget, quick)
    m["operating_point"] = r
    m["host_contention"] = r["contention"]  # the host fit's input (profiling/assemble.py)
    c, k = r["copies"], r["contention"]
    g = 1e9
    return (f"h2d {r['weight_bytes'] / MiB:.1f} MiB {c['h2d_alone_Bps'] / g:.1f} GB/s, d2h "
            f"{r['grad_bytes'] / MiB:.1f} MiB {c['d2h_alone_Bps'] / g:.1f}, both at once "
            f"{c['duplex_Bps'] / g:.1f}; update {k['update_alone_s'] * 1e3:.2f} ms alone, "
            f"{k['update_both_s'] * 1e3:.2f} beside both; "
            f"redo x{r['redo_over_update']:.2f}")


def _layer_forward(spec, req, backend, w):
    """A layer forward at the full batch in the first compute dtype: the compute of the contention tests."""
    slot = w["compute"].call(units.UnitSlot, spec, 0, _run_knobs(req, backend), backend)
    return w["compute"].call(units.unit_bodies, slot, req.batch, req.seqs[0], req.knobs.loss_chunk_tokens)["F"]


def _run_knobs(req, backend):
    return replace(req.knobs, compute_dtype=req.dtypes[0])


def _compute_under_update(m, spec, req, backend, w, n, stream_copy, budget):
    body = _layer_forward(spec, req, backend, w)
    r = rates.measure_compute_under_update(w["compute"], w["cpu"], body, _update_fn(n, stream_copy), budget)
    m["compute_under_update"] = r
    return f"layer F {r['alone_s'] * 1e3:.3f} -> {r['with_update_s'] * 1e3:.3f} ms (x{r['factor']:.2f})"


def _compute_beside_copies(m, spec, req, backend, w, bufs, budget):
    """A layer's F and B alone and beside copies in both directions (the profile's compute_beside_copy)."""
    slot = w["compute"].call(units.UnitSlot, spec, 0, _run_knobs(req, backend), backend)
    bodies = w["compute"].call(units.unit_bodies, slot, req.batch, req.seqs[0], req.knobs.loss_chunk_tokens)
    nbytes = bufs["buffers"][0].host.numel()  # 256 MiB on a GPU (quick): a layer's copies are of this order
    copiers = [(w[d], bufs["buffers"][i].copier(d, nbytes)) for i, d in enumerate(COPY_STREAMS)]
    r = rates.measure_compute_beside_copies(w["compute"], {k: bodies[k] for k in ("F", "B")}, copiers, budget)
    m["compute_beside_copies"] = {**r, "copy_bytes": nbytes}
    return ", ".join(f"layer {k} {v['alone_s'] * 1e3:.3f} -> {v['beside_copies_s'] * 1e3:.3f} ms (x{v['factor']:.2f})"
                     for k, v in r.items()) + f" beside {nbytes / MiB:.0f} MiB copies"


def _compute_sustained(m, spec, req, backend, w, budget):
    """A layer's F and B in short bursts and back to back for seconds: the profile's decoder-layer tables are
    scaled to the back-to-back rate (profiling/assemble.sustained_factors)."""
    slot = w["compute"].call(units.UnitSlot, spec, 0, _run_knobs(req, backend), backend)
    bodies = w["compute"].call(units.unit_bodies, slot, req.batch, req.seqs[0], req.knobs.loss_chunk_tokens)
    r = rates.measure_compute_sustained(w["compute"], {k: bodies[k] for k in ("F", "B")}, budget)
    m["compute_sustained"] = r
    return ", ".join(f"layer {k} {v['burst_s'] * 1e3:.3f} -> {v['sustained_s'] * 1e3:.3f} ms (x{v['factor']:.2f})"
                     for k, v in r.items()) + " in bursts -> back to back"


def _update_under_compute(m, spec, req, backend, w, n, stream_copy, budget):
    body = _layer_forward(spec, req, backend, w)
    r = rates.measure_update_under_compute(w["cpu"], _update_fn(n, stream_copy), w["compute"], body, budget)
    m["update_under_compute"] = r
    return f"{r['alone_s'] * 1e3:.3f} -> {r['with_compute_s'] * 1e3:.3f} ms (x{r['factor']:.2f})"


def _fresh_thread(m, spec, req, backend, w):
    r = rates.measure_fresh_thread(backend, _layer_forward(spec, req, backend, w))
    m["fresh_thread"] = r
    return f"first call {r['first_s'] * 1e3:.3f} ms, later {r['later_s'] * 1e3:.3f} ms (+{r['extra_s'] * 1e3:.3f} ms)"


def _host_wait(m, backend, w):
    m["host_wait_late_s"] = rates.measure_host_wait(backend, w["cpu"], w["compute"])
    return f"{m['host_wait_late_s'] * 1e6:.0f} us late" if backend.name == "cuda" else "immediate (CPU backend)"


def _runtime(m, spec, req, backend, threads, steps):
    r = measure_runtime_gaps(spec, req.batch, req.seqs[0], _run_knobs(req, backend), backend, steps, threads)
    r["cpu_update_samples"] = cpu_update_samples(r["timelines"][1:], r["program"])
    r["weight_wire"], r["grad_wire"] = r["program"].placement.weight_wire, r["program"].placement.grad_wire
    r.pop("timelines"), r.pop("program")
    m["runtime"] = r
    gaps = ", ".join(f"{s} {v * 1e6:.0f} us" for s, v in r["gap_by_stream_s"].items())
    return (f"mean gap before a task: {gaps}; N {r['norm_span_s'] * 1e6:.0f} us; "
            f"steps {median(r['step_s']) * 1e3:.1f} ms")
