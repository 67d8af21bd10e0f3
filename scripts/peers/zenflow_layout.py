"""Why ZenFlow's step 1 computes another loss: DeepSpeed 0.19.8 views its flat weights in the wrong layout.

ZenFlow (ZeRO-2) keeps every 2-D weight *transposed* in ZeRO's flat bit16 buffer, so that a gradient column is
contiguous: `deepspeed/runtime/zenflow/zenflow_utils._flatten_dense_tensors` stores `t.transpose(0, 1)` and its
`_unflatten_dense_tensors` transposes back. But ZeRO's `DeepSpeedZeroOptimizer._update_model_bit16_weights`
(deepspeed/runtime/zero/stage_1_and_2.py in the 0.19.8 wheel) points each parameter at its slice with
`flat.narrow(0, offset, numel).view(shape)`, a row-major view that ignores that layout: after
`deepspeed.initialize` every 2-D weight the model computes with holds W.T's memory read as W's shape (W.T itself
for a square matrix), and ZenFlow's gradients, reduced into the transposed layout, then update other elements
than those that produced them.

This script tests that reading without a GPU, in two parts:

  layout  (DeepSpeed's own functions, needs the bench wheel on PYTHONPATH): flatten a few tensors as ZenFlow
          does, view them back as `_update_model_bit16_weights` does, and report which come back unchanged;
  loss    (CPU, fp32; no DeepSpeed): the step-1 loss of the curve run's model, init and first batch, once with
          the weights as loaded and once with every 2-D parameter replaced by `W.t().contiguous().view(W.shape)`,
          beside the losses the H200 runs recorded at step 1 (all-on-GPU and ZeRO-2 offload 10.818, ZenFlow
          10.650; docs/runs/25-zenflow-curve/).

    PYTHONPATH=.:/tmp/site python3 scripts/peers/zenflow_layout.py layout
    PYTHONPATH=. python3 scripts/peers/zenflow_layout.py loss [--model scripts/peers/models/llama-1b] [--sequences 8]

The loss part runs the model one sequence at a time (a batch's loss is the mean over its equal-length sequences,
every target counted); llama-1b at 2,048 tokens took 25 s a sequence on a 2-core machine (about 7 min for 8 sequences
twice).
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import textwrap
import time
from importlib.metadata import PackageNotFoundError, version as dist_version
from pathlib import Path

CURVE_BATCH, CURVE_SEQ = 8, 2048  # the 200-step curves' shape: their first batch is the one checked
# step 1 of the 200-step curves on the H200 (llama-1b, 8 x 2048, megatrain init seed 0, the bundled corpus), bf16
RECORDED_STEP1 = {"all-on-gpu": "all-on-gpu.json", "zero2-offload": "zero2-offload.json", "zenflow": "zenflow.json"}


def zenflow_view(w):
    """What a 2-D parameter holds after ZenFlow's flatten and ZeRO's row-major view: W.T's memory read as W's shape
    (1-D tensors are stored as they are)."""
    return w.t().contiguous().view(w.shape) if w.dim() == 2 else w


def transposed_views(flat, metas, offsets) -> list:
    """Each parameter's view of a ZenFlow flat buffer as ZenFlow's own `_unflatten_dense_tensors` gives it: a 2-D
    weight of shape (out, in) is stored as its (in, out) transpose, so its view is `.view(in, out).t()` (strides
    (1, out)); other tensors are stored as they are. `metas`: tensors (meta device is enough) with the shapes;
    `offsets`: where each starts in `flat` (ZeRO pads between them)."""
    views = []
    for meta, offset in zip(metas, offsets):
        piece = flat.narrow(0, offset, meta.numel())
        views.append(piece.view(meta.shape[1], meta.shape[0]).t() if meta.dim() == 2 else piece.view(meta.shape))
    return views


def install_layout_fix() -> str:
    """Opt-in repair for DeepSpeed 0.19.8 (run_peer's `--zenflow-layout-fix`): after ZeRO's own
    `_update_model_bit16_weights`, a ZenFlow optimizer's parameters are pointed at `transposed_views` of its flat
    buffer, which is what the earlier ZeRO code did by calling `self.unflatten` (ZenFlow's) there. Non-ZenFlow
    optimizers are left as they are. Returns a note for the RESULT line.

    On the H200 (docs/peers.md, "The eleventh start") it gave step 1 bit for bit ZeRO-2 offload's loss at the same
    speed; ZenFlow's curve with it is far from AdamW's per-micro-step curve, mostly for its 4x fewer full updates
    and then its late one (control curves, "The twelfth to fourteenth starts")."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    original = DeepSpeedZeroOptimizer._update_model_bit16_weights
    if getattr(original, "zenflow_layout_fix", False):
        return "ZenFlow layout fix (already installed)"

    def update(self, group_index):
        original(self, group_index)
        if not getattr(self, "zenflow", False):
            return
        views = transposed_views(self.bit16_groups_flat[group_index], self.round_robin_bit16_meta[group_index],
                                 self.round_robin_bit16_offsets[group_index])
        # the round-robin group holds the model's own Parameter objects (reordered), so this re-points the model;
        # ZeRO's closing loop over bit16_groups, which copies .data between those same objects, has nothing to add
        for p, view in zip(self.round_robin_bit16_groups[group_index], views):
            p.data = view

    update.zenflow_layout_fix = True
    DeepSpeedZeroOptimizer._update_model_bit16_weights = update
    return "ZenFlow layout fix: 2-D weights viewed transposed in ZeRO's flat buffer (scripts/peers/zenflow_layout.py)"


def deepspeed_functions() -> tuple[dict, str, str]:
    """ZenFlow's flatten / unflatten and the source of ZeRO's `_update_model_bit16_weights`, read from the installed
    DeepSpeed's files without importing the package (which wants an accelerator and its pinned pydantic); also its
    version. Raises ImportError when DeepSpeed is not on the path."""
    import torch

    found = importlib.util.find_spec("deepspeed")
    if found is None or not found.submodule_search_locations:
        raise ImportError("no module named 'deepspeed'")
    root = Path(list(found.submodule_search_locations)[0])
    utils_src = (root / "runtime/zenflow/zenflow_utils.py").read_text()
    stage_src = (root / "runtime/zero/stage_1_and_2.py").read_text()
    wanted = {"_flatten_dense_tensors", "_unflatten_dense_tensors"}
    defs = [n for n in ast.parse(utils_src).body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    namespace: dict = {"torch": torch}
    exec(compile(ast.Module(body=defs, type_ignores=[]), "zenflow_utils.py", "exec"), namespace)
    update = next(textwrap.dedent(" " * n.col_offset + ast.get_source_segment(stage_src, n))
                  for n in ast.walk(ast.parse(stage_src))
                  if isinstance(n, ast.FunctionDef) and n.name == "_update_model_bit16_weights")
    try:
        version = dist_version("deepspeed")
    except PackageNotFoundError:  # a source tree on the path, not an installed wheel
        version = "(version unknown)"
    return {k: namespace[k] for k in wanted}, update, version


def check_layout() -> int:
    """Flatten with ZenFlow's function, view back with ZeRO's composition; print which tensors survive."""
    import torch
    try:
        fns, update_src, version = deepspeed_functions()
    except (ImportError, OSError, StopIteration) as e:
        print(f"zenflow_layout: cannot read DeepSpeed's sources ({e}); install the bench wheels with pip --target and "
              "put that folder on PYTHONPATH (shared/BENCHMARKS.md)", file=sys.stderr)
        return 2
    print(f"DeepSpeed {version}, ZeRO's _update_model_bit16_weights:\n" + "\n".join(
        "    " + line for line in update_src.splitlines()))
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(4, 4, generator=g), torch.randn(3, 5, generator=g), torch.randn(6, generator=g)]
    flat = fns["_flatten_dense_tensors"](tensors)
    offset, wrong = 0, 0
    print("ZenFlow's flatten, then that function's narrow(offset, numel).view(shape):")
    for t in tensors:
        viewed = flat.narrow(0, offset, t.numel()).view(t.shape)
        offset += t.numel()
        same = torch.equal(viewed, t)
        wrong += not same
        square_t = t.dim() == 2 and t.shape[0] == t.shape[1] and torch.equal(viewed, t.t())
        print(f"  {tuple(t.shape)}: the parameter back {same}; W.t().contiguous().view(W.shape) "
              f"{torch.equal(viewed, zenflow_view(t))}" + ("; that is W.T" if square_t else ""))
    back = fns["_unflatten_dense_tensors"](flat, tensors)
    print(f"ZenFlow's own unflatten gives every tensor back: {all(torch.equal(a, b) for a, b in zip(back, tensors))}")
    print(f"{wrong} of {len(tensors)} tensors come back changed through ZeRO's view")
    return 0


def step1_losses(model_path: str, sequences: int, seed: int = 0) -> dict:
    """Step-1 loss (fp32, CPU) of the curve run's first batch, as loaded and under ZenFlow's view."""
    import torch
    from megatrain.model.presets import get_model

    sys.path.insert(0, "scripts/peers")
    import peercurve
    import run_peer

    spec = get_model(model_path)
    b = peercurve.open_corpus(spec, CURVE_BATCH, CURVE_SEQ).train.next_batch()  # the curve's step 1
    x, y = b.inputs, b.targets  # (B, S) input ids and their targets
    model = run_peer.build_model(spec, CURVE_SEQ, seed, checkpointing=False)
    peercurve.megatrain_init(model, spec, seed)
    model.eval()
    n = min(sequences, x.shape[0])

    @torch.no_grad()
    def batch_loss(label: str) -> dict:
        per_seq, t0 = [], time.perf_counter()
        for i in range(n):
            per_seq.append(float(model(input_ids=x[i:i + 1], labels=y[i:i + 1], shift_labels=y[i:i + 1]).loss))
            print(f"  {label}: sequence {i + 1}: {per_seq[-1]:.4f} ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
        return {"mean": sum(per_seq) / n, "per_sequence": per_seq}

    out = {"batch_sha1": peercurve.batch_sha1(x), "sequences": n, "as loaded": batch_loss("as loaded")}
    with torch.no_grad():
        for p in model.parameters():  # tied weights are one parameter: changed once
            p.data = zenflow_view(p.data)
    out["ZenFlow's view"] = batch_loss("ZenFlow's view")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["layout", "loss"])
    ap.add_argument("--model", default="scripts/peers/models/llama-1b")
    ap.add_argument("--sequences", type=int, default=8, help=f"how many of the batch's {CURVE_BATCH} sequences to run")
    ap.add_argument("--recorded", default="docs/runs/25-zenflow-curve", help="the H200 curves' directory")
    ap.add_argument("--out", help="also write the result here as JSON")
    a = ap.parse_args(argv)
    if a.part == "layout":
        return check_layout()
    res = step1_losses(a.model, a.sequences)
    for label, name in RECORDED_STEP1.items():
        path = Path(a.recorded) / name
        if path.exists():
            first = json.loads(path.read_text())[0]
            res.setdefault("recorded_step1", {})[label] = {"loss": first["loss"],
                                                          "same_batch": first["batch_sha1"] == res["batch_sha1"]}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
