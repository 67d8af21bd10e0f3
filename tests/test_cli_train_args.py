"""`megatrain train`'s argument and config mistakes are reported before torch is imported (issue 23 item 6: a typo
took 5-13 s to be reported on a CPU machine because the training loop, and torch with it, loaded first)."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv, message", [
    (["train", "--bogus"], "megatrain: error: unrecognized arguments: --bogus (see `megatrain --help`)"),
    (["train", "--set", "optimizer.lrr=1"], "megatrain train: error: --set 'optimizer.lrr=1': unknown key"),
    (["train", "--model", "debugg"], "megatrain train: error: model.name='debugg' is neither a preset"),
    (["train", "--config", "no-such.toml"], "megatrain train: error: config file no-such.toml does not exist"),
], ids=["unknown-argument", "unknown-key", "unknown-model", "missing-config"])
def test_train_argument_error_is_one_line_without_torch(argv, message, tmp_path):
    code = ("import sys\nfrom megatrain.cli import main\ntry:\n    rc = main(%r)\nexcept SystemExit as e:\n"
            "    rc = e.code\nprint('RC', rc, 'torch' in sys.modules)" % argv)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.stdout.strip() == "RC 2 False", proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), proc.stderr
