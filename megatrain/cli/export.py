"""`megatrain export`: any checkpoint as a Hugging Face model directory (megatrain/train/export.py).

    megatrain export runs/ft-1 out/ft-1-hf                                   # the run's latest checkpoint
    megatrain export runs/ft-1/checkpoints/step_00000500 out/ft-500 --dtype fp32
"""
from __future__ import annotations
import time


def register(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face directory (from_pretrained loads it)")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a checkpoint directory (runs/NAME/checkpoints/step_...) or a run directory (its latest)")
    p.add_argument("out", metavar="OUT", help="the Hugging Face directory to write (must not exist)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="weight dtype (default bf16)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it is an earlier megatrain export (nothing else is ever replaced)")
    p.set_defaults(func=run)


def run(args) -> int:

    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.io.export_target import check_export_target
    from megatrain.train.export import export_checkpoint

    check_export_target(args.out, args.overwrite)  # before reading anything: only an earlier export is replaced
    t0 = time.perf_counter()
    out, prov = export_checkpoint(args.checkpoint, args.out, args.dtype, overwrite=args.overwrite)
    tok = prov.get("tokenizer") or {}
    print(f"exported {prov['checkpoint']} (step {prov['step']}) to {out} ({args.dtype}) in "
          f"{time.perf_counter() - t0:.1f} s; tokenizer: "
          + ("none (the data was byte-level)" if tok.get("kind", "bytes") == "bytes" else
             str(tok.get("files_dir") or tok.get("path"))))
    print(f"load it: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0
