"""Each data-parallel rank reads only its slices of a Hugging Face directory (written by transformers
`save_pretrained`, sharded): the ranks' slices put together equal a one-process load, and the ranks together read
every weight byte exactly once."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatrain.io.errors import CheckpointError
from megatrain.io.sharded_hf_load import load_hf_slices
from megatrain.parallel.shard import ShardedHostStore
from megatrain.parallel.world import World
from megatrain.ir.placement import Parallelism
from megatrain.compile.knobs import knobs_for
from megatrain.compile.resolve import resolve
from megatrain.io.hf_checkpoint import load_hf_tiles, weight_files

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_checkpoint import DEBUG, hf_model

import transformers  # a test dependency: missing, the suite fails (never skips)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks", [2, 3])
def test_rank_slices_of_a_hf_directory_equal_a_one_process_load(tmp_path, dtype, ranks):
    path = tmp_path / "hf"
    hf_model(DEBUG).to(dtype).save_pretrained(path, max_shard_size="100KB")  # several shards + index
    ref = load_hf_tiles(path, DEBUG)  # one process, whole tiles (fp32)
    layout = resolve(DEBUG, 2, 16, knobs_for("overlap"), Parallelism(ranks)).host_layout
    got, read = {u: [] for u in DEBUG.units()}, []
    for rank in range(ranks):
        store = ShardedHostStore(DEBUG, layout, World(rank=rank, size=ranks))
        read.append(load_hf_slices(path, store))
        for u in DEBUG.units():
            _, valid = store.shard(u)
            assert torch.equal(store.master(u)[valid:], torch.zeros(store.master(u).numel() - valid))  # padding
            got[u].append(store.master(u)[:valid])
    for u in DEBUG.units():
        assert torch.equal(torch.cat(got[u]), ref[u]), u
    total = sum(info.end - info.begin for _, info in weight_files(path).values())
    assert sum(read) == total and max(read) < 0.75 * total  # every byte once; no rank reads the whole model


def test_a_truncated_shard_fails_before_any_rank_reads(tmp_path):
    path = tmp_path / "hf"
    hf_model(DEBUG).save_pretrained(path, max_shard_size="100KB")
    shard = max(path.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8])
    layout = resolve(DEBUG, 2, 16, knobs_for("overlap"), Parallelism(2)).host_layout
    with pytest.raises(CheckpointError) as e:
        load_hf_slices(path, ShardedHostStore(DEBUG, layout, World(rank=1, size=2)))
    assert shard.name in str(e.value), e.value
