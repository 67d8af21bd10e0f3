"""`megatrain train`: stream-train a model on synthetic tokens with a chosen schedule (minimal; no data files).

    megatrain train --model debug --steps 20 --schedule overlap --device cpu

The loop itself (`train_loop`) takes a trainer and an iterable of batches, so fuller front ends (configs, data,
checkpoints) reuse it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from ..builders import DEFAULT_SCHEDULE, NAMED_SCHEDULES, resolve_knobs
from ..cli import UserError
from ..presets import get_model
from ..spec import ModelSpec


def synthetic_batches(spec: ModelSpec, batch: int, seq: int, seed: int = 0) -> Iterator[tuple]:
    """Endless learnable token batches: arithmetic progressions mod vocab_size with random start and stride 1..4.
    Yields (ids, targets), each a (batch, seq) int64 tensor, targets = ids shifted by one."""
    import torch  # here, not at module level: `megatrain --help` should not wait for torch

    g = torch.Generator().manual_seed(seed)
    steps = torch.arange(seq + 1)
    while True:
        start = torch.randint(0, spec.vocab_size, (batch, 1), generator=g)
        stride = torch.randint(1, 5, (batch, 1), generator=g)
        tokens = (start + stride * steps) % spec.vocab_size  # (B, T+1)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train_loop(trainer, batches: Iterable[tuple], steps: int,
               log: Callable[[str], None] | None = print, on_step: Callable | None = None) -> list:
    """Run `steps` training steps of `trainer` (a StreamedTrainer) on `batches`, then apply any pending update
    (`flush`). Logs one line per step; `on_step(result)` is called after each. Returns the StepResults."""
    results = []
    it = iter(batches)
    for _ in range(steps):
        try:
            ids, targets = next(it)
        except StopIteration:
            break
        r = trainer.step(ids, targets)
        results.append(r)
        if log:
            norm = "n/a" if r.grad_norm is None else f"{r.grad_norm:.3f}"
            note = "  SKIPPED (non-finite gradients)" if r.skipped else ""
            log(f"step {r.step:5d}  loss {r.loss:.4f}  grad_norm {norm}  {r.tokens / r.time_s:,.0f} tok/s  "
                f"{r.time_s * 1e3:.1f} ms{note}")
        if on_step:
            on_step(r)
    trainer.flush()
    return results


def register(sub) -> None:
    p = sub.add_parser("train", help="train on synthetic tokens with a schedule (streamed from host memory)")
    p.add_argument("--model", default="debug", help="preset name or HF model dir / config.json")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE, help=f"{' | '.join(NAMED_SCHEDULES)} or a TOML file")
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="override a schedule knob")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 = no clipping")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeline", metavar="CSV", help="write the last step's measured timeline here")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from ..exec.optim import AdamWConfig
    from ..exec.trainer import StreamedTrainer

    if args.steps < 1 or args.batch < 1 or args.seq < 1:
        raise UserError("--steps, --batch and --seq must be positive")
    spec = get_model(args.model)
    name, knobs = resolve_knobs(args.schedule, args.set)
    max_norm = args.max_grad_norm if args.max_grad_norm > 0 else None
    if max_norm is not None and knobs.clip != "exact":
        raise UserError(f"schedule {name!r} has clip={knobs.clip!r}; pass --max-grad-norm 0 (no clipping) "
                        "or --set clip=exact")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: no CUDA device here; use --device cpu")
    optim = AdamWConfig(lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=max_norm)
    trainer = StreamedTrainer(spec, knobs, optim=optim, backend=args.device, seed=args.seed)
    trainer.schedule_name = name
    print(f"model {spec.name}: {spec.num_params / 1e6:.2f} M parameters; schedule {name}; "
          f"batch {args.batch} x seq {args.seq}; device {trainer.backend.name}")
    t0 = time.perf_counter()
    results = train_loop(trainer, synthetic_batches(spec, args.batch, args.seq, args.seed), args.steps)
    dt = time.perf_counter() - t0
    tokens = sum(r.tokens for r in results)
    print(f"done: {len(results)} steps in {dt:.2f} s, {tokens / dt:,.0f} tokens/s; "
          f"loss {results[0].loss:.4f} -> {results[-1].loss:.4f}")
    if args.timeline:
        results[-1].timeline.to_csv(args.timeline, index=False)
        print(f"timeline of step {results[-1].step} written to {args.timeline}")
    return 0
