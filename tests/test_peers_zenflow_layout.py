"""ZenFlow's weight layout (scripts/peers/zenflow_layout.py): the view DeepSpeed 0.19.8 gives a ZenFlow model's
weights, and run_peer's opt-in repair of it, checked on the CPU without DeepSpeed.

The flat buffer below is built the way ZenFlow's `_flatten_dense_tensors` builds it (each 2-D tensor stored as its
transpose, ZeRO's padding between tensors); the repaired views must give back the very tensors that went in, and
share the buffer's memory as ZeRO's views do (an optimizer step writes the buffer, the model reads the views)."""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "peers"))
import zenflow_layout  # noqa: E402


def _zenflow_flat(tensors, pad=3):
    """(flat buffer, offsets): each tensor's transpose (2-D) or itself, `pad` zeros after every one but the last."""
    pieces, offsets, at = [], [], 0
    for i, t in enumerate(tensors):
        offsets.append(at)
        pieces.append((t.t() if t.dim() == 2 else t).contiguous().view(-1))
        at += t.numel()
        if i < len(tensors) - 1:
            pieces.append(torch.zeros(pad))
            at += pad
    return torch.cat(pieces), offsets


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 4, generator=g), torch.randn(3, 5, generator=g), torch.randn(6, generator=g),
            torch.randn(2, 7, generator=g)]


def test_the_row_major_view_of_a_zenflow_buffer_scrambles_matrices_and_transposes_square_ones():
    tensors = _tensors()
    flat, offsets = _zenflow_flat(tensors)
    for t, off in zip(tensors, offsets):
        row_major = flat.narrow(0, off, t.numel()).view(t.shape)  # DeepSpeed 0.19.8's _update_model_bit16_weights
        assert torch.equal(row_major, zenflow_layout.zenflow_view(t))
        if t.dim() == 2:
            assert not torch.equal(row_major, t)
        if t.dim() == 2 and t.shape[0] == t.shape[1]:
            assert torch.equal(row_major, t.t())
        if t.dim() == 1:
            assert torch.equal(row_major, t)


def test_transposed_views_give_back_every_tensor_and_share_the_buffer():
    tensors = _tensors()
    flat, offsets = _zenflow_flat(tensors)
    metas = [torch.empty_like(t, device="meta") for t in tensors]
    views = zenflow_layout.transposed_views(flat, metas, offsets)
    for v, t in zip(views, tensors):
        assert v.shape == t.shape and torch.equal(v, t)
    flat.add_(1.0)  # an optimizer step writes the flat buffer: the model's weights must see it
    for v, t in zip(views, tensors):
        assert torch.equal(v, t + 1.0)


class _ZeroOptimizer:
    """Stands in for DeepSpeedZeroOptimizer: its `_update_model_bit16_weights` is 0.19.8's composition."""

    def __init__(self, tensors, zenflow: bool):
        self.zenflow = zenflow
        self.params = [torch.nn.Parameter(t.clone()) for t in tensors]
        flat, offsets = _zenflow_flat(tensors) if zenflow else (torch.cat([t.view(-1) for t in tensors]), None)
        if offsets is None:
            offsets = [sum(t.numel() for t in tensors[:i]) for i in range(len(tensors))]
        self.bit16_groups_flat = [flat]
        self.round_robin_bit16_groups = [self.params]
        self.round_robin_bit16_meta = [[torch.empty_like(t, device="meta") for t in tensors]]
        self.round_robin_bit16_offsets = [offsets]
        self.bit16_groups = [list(reversed(self.params))]  # the round-robin order differs from the groups'
        self.round_robin_bit16_indices = [list(reversed(range(len(tensors))))]

    def _update_model_bit16_weights(self, group_index):
        flat_group = self.bit16_groups_flat[group_index]
        for p, meta, offset in zip(self.round_robin_bit16_groups[group_index],
                                   self.round_robin_bit16_meta[group_index],
                                   self.round_robin_bit16_offsets[group_index]):
            p.data = flat_group.narrow(0, offset, meta.numel()).view(meta.shape).data
        for param_index, param in enumerate(self.bit16_groups[group_index]):
            new_index = self.round_robin_bit16_indices[group_index][param_index]
            param.data = self.round_robin_bit16_groups[group_index][new_index].data


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """A `deepspeed.runtime.zero.stage_1_and_2` module holding a fresh copy of the stand-in class."""
    cls = type("DeepSpeedZeroOptimizer", (_ZeroOptimizer,), {})
    names = ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero", "deepspeed.runtime.zero.stage_1_and_2"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].DeepSpeedZeroOptimizer = cls
    return cls


def test_the_fix_repairs_zenflow_optimizers_only_and_installs_once(fake_deepspeed):
    tensors = _tensors()
    broken = fake_deepspeed(tensors, zenflow=True)
    broken._update_model_bit16_weights(0)
    assert not torch.equal(broken.params[1], tensors[1])  # as shipped: scrambled

    note = zenflow_layout.install_layout_fix()
    assert "layout fix" in note
    assert "already installed" in zenflow_layout.install_layout_fix()
    fixed = fake_deepspeed(tensors, zenflow=True)
    fixed._update_model_bit16_weights(0)
    assert all(torch.equal(p, t) for p, t in zip(fixed.params, tensors))
    plain = fake_deepspeed(tensors, zenflow=False)
    plain._update_model_bit16_weights(0)
    assert all(torch.equal(p, t) and p.is_contiguous() for p, t in zip(plain.params, tensors))


def test_run_peer_refuses_the_fix_for_a_peer_without_zenflow():
    proc = subprocess.run([sys.executable, "scripts/peers/run_peer.py", "zero2-offload", "--zenflow-layout-fix",
                           "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert "--zenflow-layout-fix" in proc.stderr and "no zenflow section" in proc.stderr
