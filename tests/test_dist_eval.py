"""Held-out evaluation in data-parallel runs: two ranks (gloo, CPU backend) under torchrun report the eval losses of
one process with grad_accum 2 over the same data (that process's eval is itself tested against transformers in
test_training.py), also when there are fewer eval rows than ranks; the layer-major forward reads each unit's tile
once and gives transformers' loss."""
from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_dist_cpu import LOSS_TOL, _train_cli

from megatrain.model.presets import PRESETS
from megatrain.train.evaluate import loss_sums, rank_share


def _eval_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in records if r["eval_loss"] is not None}


def _compare(tmp_path, *args, tol: float = LOSS_TOL) -> dict[int, float]:
    _, out = _train_cli(tmp_path, "dp", 2, *args)
    _train_cli(tmp_path, "one", 1, *args, "--set", "run.grad_accum=2")
    dp, one = _eval_losses(tmp_path / "dp"), _eval_losses(tmp_path / "one")
    assert dp.keys() == one.keys() and dp, (dp, one)
    errs = [abs(dp[s] - one[s]) / abs(one[s]) for s in one]
    assert max(errs) <= tol, (dp, one)
    assert out.count("eval") >= len(one)  # rank 0 logs the evals
    return dp


def test_torchrun_eval_equals_one_process_over_the_same_batches(tmp_path):
    """The bundled corpus's held-out split (data.eval_fraction), 2 eval batches of 2 rows: one row per rank and
    batch; evals at step 2 and at the end (3), after the weights moved."""
    dp = _compare(tmp_path, "--set", "run.eval_every=2", "--set", "run.eval_batches=2",
                  "--set", "data.eval_fraction=0.05")
    assert sorted(dp) == [2, 3] and dp[2] != dp[3]


def test_torchrun_eval_with_fewer_eval_rows_than_ranks(tmp_path):
    """A held-out file of one window (32 + 1 tokens at seq 32): rank 1 has no eval rows, gathers the tiles and
    adds zero; both ranks report the one-process loss."""
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("def add(a, b):\n    return a + b\n\n# ok\n")  # 38 bytes: (38 - 1) // 32 = 1 window
    dp = _compare(tmp_path, "--steps", "1", "--set", "run.eval_every=1", "--set", f"data.eval_path={held_out}")
    assert list(dp) == [1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_two_gpus_eval_equals_one_gpu_over_the_same_batches(tmp_path):
    """The same on CUDA: torchrun with NCCL for the steps, the eval's gathers on the host (gloo), the forward on
    each rank's GPU; one GPU with grad_accum 2 as the reference (tolerance of the CUDA training test)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
    dp = _compare(tmp_path, "--device", "cuda", "--set", "run.eval_every=2", "--set", "run.eval_batches=3",
                  tol=1e-5)
    assert sorted(dp) == [2, 3]


def test_rank_share_splits_rows_contiguously():
    for rows in range(7):
        for size in (1, 2, 3, 4):
            shares = [rank_share(rows, r, size) for r in range(size)]
            assert shares[0][0] == 0 and shares[-1][1] == rows
            assert all(a[1] == b[0] for a, b in itertools.pairwise(shares))
            assert max(h - lo for lo, h in shares) - min(h - lo for lo, h in shares) <= 1


def test_layer_major_loss_reads_each_tile_once_and_equals_transformers():
    """`loss_sums` over 5 rows in chunks of 2 (with -100 targets) equals transformers' LlamaForCausalLM
    cross-entropy on the same weights, reading each unit's tile once, in unit order."""
    import transformers  # a test dependency: missing, the suite fails (never skips)
    from megatrain.io.hf_io import state_dict_from_tiles
    from megatrain.model.init import init_tiles

    spec = PRESETS["debug"]
    tiles = init_tiles(spec, seed=3, std=0.05)
    reads = []

    class Counting(dict):
        def __getitem__(self, unit):
            reads.append(unit)
            return super().__getitem__(unit)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (5, 16), generator=g)  # (R, T)
    targets = torch.randint(0, spec.vocab_size, (5, 16), generator=g)
    targets[1, :7] = -100
    total, count = loss_sums(spec, Counting(tiles), ids, targets, 2, torch.device("cpu"))
    assert reads == list(spec.units())

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec.to_hf_config())).eval()
    model.load_state_dict(state_dict_from_tiles(spec, tiles), strict=False)
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # (R, T, V)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    assert count == int((targets != -100).sum()) == 5 * 16 - 7
    assert total == pytest.approx(float(want), rel=1e-5)
    reads.clear()  # a rank without rows reads (gathers) the same tiles in the same order, and adds nothing
    assert loss_sums(spec, Counting(tiles), ids[:0], targets[:0], 2, torch.device("cpu")) == (0.0, 0)
    assert reads == list(spec.units())
