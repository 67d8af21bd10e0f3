"""Training checkpoints: bit-exact round trip, atomic save under kill / full disk, keep-last-N, exact resume."""
from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from megatrain.model.spec import EMBED, HEAD
from megatrain.io import safetensors_io as stio
from megatrain.io.checkpoint import CheckpointManager, check_writable, rng_state, set_rng_state
from megatrain.io.checkpoint_format import KINDS
from megatrain.io.errors import CheckpointError
from megatrain.train.config import DataConfig
from megatrain.data.batches import open_data

REPO = Path(__file__).resolve().parents[1]


def make_tiles(seed: int, sizes=None) -> dict[str, dict[int, torch.Tensor]]:
    sizes = sizes or {EMBED: 300, 0: 1000, 1: 1000, HEAD: 333}
    g = torch.Generator().manual_seed(seed)
    return {k: {u: torch.randn(n, generator=g) for u, n in sizes.items()} for k in KINDS}


def assert_tiles_equal(a, b):
    for kind in KINDS:
        assert a[kind].keys() == b[kind].keys()
        for u in a[kind]:
            assert torch.equal(a[kind][u], b[kind][u]), (kind, u)


def test_round_trip_is_bit_exact_and_loads_in_place(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    tiles = make_tiles(0)
    state = {"step": 5, "data": {"epoch": 1, "index": 3}, "config": {"optimizer": {"lr": 1e-3}}}
    path = mgr.save(5, tiles, state)
    assert path.name == "step_00000005" and sorted(p.name for p in path.iterdir()) == [
        "adam_m.safetensors", "adam_v.safetensors", "master.safetensors", "trainer_state.json"]
    loaded = mgr.load()
    assert loaded.step == 5 and loaded.state == state and loaded.path == path
    assert_tiles_equal(loaded.tensors, tiles)
    # Into existing buffers (the host store's tiles): filled in place, nothing returned.
    dest = {k: {u: torch.zeros_like(t) for u, t in d.items()} for k, d in tiles.items()}
    ptrs = {(k, u): t.data_ptr() for k, d in dest.items() for u, t in d.items()}
    assert mgr.load(path, dest=lambda kind, unit: dest[kind][unit]).tensors is None
    assert_tiles_equal(dest, tiles)
    assert all(dest[k][u].data_ptr() == p for (k, u), p in ptrs.items())
    # The files are ordinary safetensors.
    from safetensors import safe_open
    with safe_open(str(path / "master.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("layers.1"), tiles["master"][1])


def test_destination_of_the_wrong_size_is_an_error(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, make_tiles(0), {})
    with pytest.raises(CheckpointError, match=r"tile 'layers.0' is \(1000,\).*destination is \(999,\)"):
        mgr.load(dest=lambda kind, unit: torch.zeros(999 if unit == 0 else {EMBED: 300, 1: 1000, HEAD: 333}[unit]))


def test_rng_state_restores_every_generator():
    state = json.loads(json.dumps(rng_state()))
    first = (random.random(), np.random.rand(), torch.rand(3).tolist())
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(3).tolist()) == first


def test_keep_last_n(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        mgr.save(step, make_tiles(step), {"step": step})
    assert [s for s, _ in mgr.checkpoints()] == [30, 40]
    assert_tiles_equal(mgr.load().tensors, make_tiles(40))
    keep_all = CheckpointManager(tmp_path / "all", keep_last=0)
    for step in (1, 2, 3):
        keep_all.save(step, make_tiles(step), {})
    assert [s for s, _ in keep_all.checkpoints()] == [1, 2, 3]


def test_disk_full_mid_save_loses_nothing(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(10, make_tiles(10), {"step": 10})
    written = []
    real_write = stio._write

    def write_until_full(f, data):
        if sum(written) > 6000:  # a few KB into the new checkpoint
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(len(data) if not isinstance(data, memoryview) else data.nbytes)
        real_write(f, data)

    monkeypatch.setattr(stio, "_write", write_until_full)
    with pytest.raises(CheckpointError, match=r"step 20 was not saved: the disk is full.*step_00000010 is intact"):
        mgr.save(20, make_tiles(20), {"step": 20})
    assert sum(written) > 6000  # it failed in the middle, not before starting
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010"]  # no partial dir, nothing pruned
    monkeypatch.setattr(stio, "_write", real_write)
    loaded = mgr.load()
    assert loaded.step == 10
    assert_tiles_equal(loaded.tensors, make_tiles(10))
    mgr.save(20, make_tiles(20), {"step": 20})  # once there is space again, saving works
    assert [s for s, _ in mgr.checkpoints()] == [20]


def test_not_enough_space_is_refused_before_writing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    mgr = CheckpointManager(tmp_path)
    mgr.save(1, make_tiles(1), {})
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(CheckpointError, match=r"needs 0\.00 GiB but .* has only .*nothing was written"):
        mgr.save(2, make_tiles(2), {})
    assert [s for s, _ in mgr.checkpoints()] == [1] and len(list(tmp_path.iterdir())) == 1


def test_unwritable_directory_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*a_file/ckpt is not writable"):
        check_writable(blocker / "ckpt")
    with pytest.raises(CheckpointError, match="not writable"):
        CheckpointManager(blocker / "ckpt").save(1, make_tiles(1), {})
    # Permission denied (tests may run as root, where chmod does not stop writes: simulate the OS answer).
    real_open = open

    def deny(path, *a, **kw):
        if "probe" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(CheckpointError, match=r"no permission to write .*Permission denied.*run\.out_dir"):
        check_writable(tmp_path / "ok")


def test_truncated_checkpoint_file_is_a_clear_error(tmp_path):
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(3, make_tiles(3), {})
    f = path / "adam_v.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"adam_v\.safetensors is truncated: .*tensor 'head'"):
        mgr.load()
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        mgr.resolve(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"no checkpoint .* passes verification .*truncated"):
        mgr.resolve("latest")  # "latest" is the newest verified one (issue 22); the damaged one stays
    assert f.is_file()


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    from megatrain.io import safetensors_io as stio
    from megatrain.io.checkpoint import KINDS, CheckpointManager
    mgr = CheckpointManager(sys.argv[1], keep_last=1)
    tiles = lambda s: {k: {u: torch.full((50_000,), float(s + i)) for u in range(4)} for i, k in enumerate(KINDS)}
    mgr.save(1, tiles(1), {"step": 1})
    real, count = stio._write, [0]
    def killed_midway(f, data):
        count[0] += 1
        if count[0] == 7:  # in the second of the three tile files
            os.kill(os.getpid(), signal.SIGKILL)
        real(f, data)
    stio._write = killed_midway
    mgr.save(2, tiles(2), {"step": 2})
""")


def test_kill_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers, "the kill should have hit mid-save"
    mgr = CheckpointManager(tmp_path, keep_last=1)
    loaded = mgr.load()
    assert loaded.step == 1 and loaded.state == {"step": 1}
    assert all((loaded.tensors[k][u] == 1 + i).all() for i, k in enumerate(KINDS) for u in range(4))
    mgr.save(3, make_tiles(3), {})  # the next save clears the debris
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003"]


# ---- resume of a real (small) training loop ----------------------------------------------------------------
def toy_params(seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {EMBED: (torch.randn(256 * 16, generator=g) * 0.1).requires_grad_(),
            0: (torch.randn(16 * 16, generator=g) * 0.1).requires_grad_(),
            HEAD: (torch.randn(16 * 256, generator=g) * 0.1).requires_grad_()}


def toy_step(params, opt, batch) -> float:
    emb, w, out = params[EMBED].view(256, 16), params[0].view(16, 16), params[HEAD].view(16, 256)
    h = torch.nn.functional.dropout(torch.relu(emb[batch.inputs] @ w), p=0.1)  # dropout draws from torch's RNG
    loss = torch.nn.functional.cross_entropy((h @ out).view(-1, 256), batch.targets.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def test_resume_continues_bit_exactly(tmp_path):
    data_cfg = DataConfig(seq_len=32, batch_size=4, eval_fraction=0.0, seed=7)

    def fresh():
        torch.manual_seed(123)
        params = toy_params(0)
        opt = torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=0.1)
        return params, opt, open_data(data_cfg, vocab_size=256).train

    params, opt, loader = fresh()
    straight = [toy_step(params, opt, loader.next_batch()) for _ in range(8)]

    params, opt, loader = fresh()
    first = [toy_step(params, opt, loader.next_batch()) for _ in range(4)]
    mgr = CheckpointManager(tmp_path)
    order = list(params)
    mgr.save(4, {"master": {u: params[u].detach() for u in order},
                 "adam_m": {u: opt.state[params[u]]["exp_avg"] for u in order},
                 "adam_v": {u: opt.state[params[u]]["exp_avg_sq"] for u in order}},
             {"step": 4, "rng": rng_state(), "data": loader.state_dict(),
              "adam_step": float(opt.state[params[EMBED]]["step"])})
    del params, opt, loader
    torch.rand(1000), np.random.rand(10), random.random()  # the RNGs move on, as in a new process

    params, opt, loader = fresh()  # new objects: weights, moments and cursor all come from the checkpoint
    for p in params.values():
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.empty_like(p), "exp_avg_sq": torch.empty_like(p)}
    with torch.no_grad():
        ckpt = mgr.load(dest=lambda kind, u: {"master": params[u].data, "adam_m": opt.state[params[u]]["exp_avg"],
                                              "adam_v": opt.state[params[u]]["exp_avg_sq"]}[kind])
    for p in params.values():
        opt.state[p]["step"].fill_(ckpt.state["adam_step"])
    set_rng_state(ckpt.state["rng"])
    loader.load_state_dict(ckpt.state["data"])
    resumed = first + [toy_step(params, opt, loader.next_batch()) for _ in range(4)]
    assert resumed == straight  # exact float equality, not approximate
    assert straight[-1] < straight[0]
