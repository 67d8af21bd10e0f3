"""`megatrain profile --quick` on the GPU machine: under 60 s for bench-3b at 8 x 2048, the host measured on CUDA
(pinned copies on side streams beside the host update) and the machine recorded."""
import subprocess
import sys
import time

import pytest
import torch

from megatrain.sim import load_profile

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_quick_profile_on_the_gpu_takes_under_a_minute(tmp_path):
    out = tmp_path / "quick.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megatrain", "profile", "--model", "bench-3b", "--batch", "8",
                           "--seq", "2048", "--quick", "--out", str(out)], capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert wall < 60.0, f"--quick took {wall:.1f} s"
    p = load_profile(out)
    assert p.copy_host_bytes_per_byte == 1.0 and "pinned DMA on side streams" in p.notes["host_memory_Bps"]
    assert 0 < p.host_memory_Bps < float("inf") and p.cpu_update_bytes_per_param > 0
    assert p.machine["gpu"] == torch.cuda.get_device_name(0) and p.machine["gpu_count"] == torch.cuda.device_count()
