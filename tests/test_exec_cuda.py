"""The executor on the CUDA backend (skipped without a GPU): the same numbers as the CPU backend for several
schedules, pinned host memory as planned, and a measured timeline. Run on the GPU machine with
`python -m pytest -m gpu tests/test_exec_cuda.py -s`."""
from __future__ import annotations

import pytest
import torch

from megatrain.analysis.timeline import TIMELINE_COLUMNS
from megatrain.exec.optim import AdamWConfig
from megatrain.model.init import init_tiles
from megatrain.compile.knobs import knobs_for
from megatrain.plan.memory import NOT_STORE
from megatrain.compile.advice import plan_memory
from megatrain.model.presets import PRESETS
from megatrain.engine.trainer import StreamedTrainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEBUG = PRESETS["debug"]
STEPS, B, T = 5, 4, 32


def run(backend: str, knobs):
    tiles = init_tiles(DEBUG, seed=0, std=0.05)
    # 300 s, the run default: the first forward of a compiled layer on a machine with a cold Inductor cache compiles
    # inside the task (over 60 s on a fresh H100 machine: docs/runs/21-renovation/README.md)
    trainer = StreamedTrainer(DEBUG, knobs, tiles, optim=AdamWConfig(lr=2e-3, weight_decay=0.1), backend=backend,
                              timeout_s=300)
    g = torch.Generator().manual_seed(1)
    results = []
    for _ in range(STEPS):
        tokens = torch.randint(0, DEBUG.vocab_size, (B, T + 1), generator=g)
        results.append(trainer.step(tokens[:, :-1], tokens[:, 1:]))
    return trainer, results


VARIANTS = {"overlap-split-kept": ("overlap-split", dict(retain_grads=1)),
            "arrival-split-kept": ("arrival-split", dict(gpu_optimizer_fraction=0.5, retain_grads=1)),
            "arrival-resident": ("arrival", dict(resident_embeddings=True, resident_layers=2)),
            "arrival-compiled-resident": ("arrival", dict(compile_layers=True, resident_embeddings=True,
                                                           resident_layers=1)),
            # speculative clipping: host units deferred or undone/redone on the host, resident ones on the GPU
            "arrival-resident-clip": ("arrival", dict(clip=1.0, resident_embeddings=True, resident_layers=2)),
            "arrival-split-clip": ("arrival-split", dict(clip=1.0, gpu_optimizer_fraction=0.5))}


@pytest.mark.parametrize("name", ["serial", "overlap", "gpu-adam", "split-adam", "long-context", "arrival",
                                  "overlap-split", *VARIANTS])
def test_cuda_backend_gives_the_cpu_backends_numbers(name):
    name, extra = VARIANTS.get(name, (name, {}))
    knobs = knobs_for(name, compute_dtype="fp32", weight_wire="fp32", micro_batches=2, **extra)
    cpu_tr, cpu = run("cpu", knobs)
    gpu_trainer, gpu = run("cuda", knobs)
    for a, b in zip(cpu, gpu):
        assert b.loss == pytest.approx(a.loss, rel=1e-4), (name, a.step)
    ref = cpu_tr.state_dict()
    for k, v in gpu_trainer.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=3 * 2e-3)
    tl = gpu[-1].timeline
    assert list(tl.columns) == TIMELINE_COLUMNS and (tl.end_s >= tl.start_s).all()
    print(f"\n{name}: step time {gpu[-1].time_s * 1e3:.1f} ms, losses cpu {cpu[-1].loss:.5f} cuda {gpu[-1].loss:.5f}")


@pytest.mark.parametrize("name", ["overlap", "gpu-adam", "split-adam", "overlap-split"])
def test_cuda_store_pins_what_dma_touches(name):
    knobs = knobs_for(name)
    trainer, _ = run("cuda", knobs)
    store = trainer.store
    host = plan_memory(DEBUG, B, T, knobs).host
    assert store.bytes_by_component() == {k: v for k, v in host.components.items() if k not in NOT_STORE}
    planned = host.pinned_bytes
    pinned = store.pinned_bytes()
    pages = 4096 * 5 * len(DEBUG.units())
    print(f"\n{name}: pinned {pinned} B, planned {planned} B")
    assert planned <= pinned <= planned + pages
    # Tensor.is_pinned() only knows torch's own pinned allocator, not cudaHostRegister'ed memory, so check what
    # pinning means: a non_blocking copy from pinned memory returns to the host while the stream is still busy.
    for host in (store.grad(0), store.stream_tile(0)):
        assert copy_is_asynchronous(host), "host tile is not page-locked"


def copy_is_asynchronous(host: torch.Tensor) -> bool:
    """True if a non_blocking host->GPU copy of `host` is queued behind a busy stream instead of blocking the host
    (which is what CUDA does for pageable memory)."""
    dev = torch.empty(host.shape, dtype=host.dtype, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        start = torch.cuda.Event()
        start.record()
        dev.copy_(host, non_blocking=True)
        queued_before_sleep_ended = not start.query()
    side.synchronize()
    return queued_before_sleep_ended
