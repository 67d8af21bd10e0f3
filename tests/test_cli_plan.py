"""`megatrain plan` prints the table and the verdict; user mistakes are one clear line."""
from megatrain.cli import main


def test_plan_prints_table_and_fit(capsys):
    rc = main(["plan", "--model", "llama3-8b", "--batch", "8", "--seq", "2048", "--host-gib", "128", "--gpu-gib", "139"])
    out = capsys.readouterr().out
    assert rc == 1  # does not fit 128 GiB with fp32 gradients and a bf16 copy
    assert "fp32 master" in out and "B/param" in out and "short by" in out and "grad_wire=bf16" in out
    rc = main(["plan", "--model", "llama3-8b", "--set", "grad_wire=bf16", "--set", "weight_wire=fp32",
               "--host-gib", "128", "--gpu-gib", "139"])
    assert rc == 0 and "host: fits" in capsys.readouterr().out


def test_plan_user_errors_are_one_line(capsys):
    assert main(["plan", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatrain plan: error: unknown model 'nope'") and err.count("\n") == 1
    assert main(["plan", "--set", "buffers=zero"]) == 2
    assert "expects an integer" in capsys.readouterr().err
