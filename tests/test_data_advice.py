"""The too-little-data error's advice is accepted by the next run (issue 23, item 2).

Data that cannot fill one training batch and one held-out window is a DataError that lists every setting that would
fit (megatrain/data/sizing.py). Here each `--set` it suggests is applied and the next run's pre-run checks (the
config's rules, then train/preflight.py: schedule, memory, data) must accept it; "more data (at least N tokens)"
must be exact. It used to advise `data.eval_fraction=0` for data whose whole could not fill a batch either.
"""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from megatrain.cli import main
from megatrain.data.batches import DataError
from megatrain.train.config import load_config
from megatrain.train.preflight import preflight

from test_examples import REPO, tiny_hf_dir

SETS = re.compile(r"--set (\S+)")
MORE = re.compile(r"more data \(at least ([\d,]+) tokens")


def _pre_run(sets: list[str]):
    """`train`'s checks before anything is allocated: the config (every rule), then preflight on the CPU backend."""
    cfg = load_config(None, ["model.name=debug", "run.simulate=false", *sets]).validate()
    return preflight(cfg, cfg.model.spec(), *cfg.step_shape(), cfg.step_knobs(), "cpu", log=lambda line: None)


def _advice(sets: list[str]) -> str | None:
    """The DataError's message for `sets`, None when the data is accepted."""
    try:
        _pre_run(sets)
    except DataError as e:
        return str(e)
    return None


def _tokens(path, n):
    (np.arange(n) % 256).astype(np.uint16).tofile(path)  # ids the debug model's vocabulary (256) holds
    return str(path)


def _follow(base: list[str], message: str) -> int:
    """Apply each `--set` the message suggests to `base`: the next run must accept it. Returns how many."""
    assert "\n" not in message and "any one of these fits: " in message, message
    suggested = SETS.findall(message)
    for setting in suggested:
        key = setting.split("=")[0]
        again = _advice([s for s in base if not s.startswith(key + "=")] + [setting])
        assert again is None, f"advice --set {setting} of\n  {message}\nis refused by the next run:\n  {again}"
    return len(suggested)


SIZES = [30, 150, 700, 1700, 6000]
SHAPES = [(16, 4, 1), (64, 4, 2), (128, 6, 3), (512, 4, 1), (512, 8, 4)]  # seq_len, batch_size, micro_batches
FRACTIONS = [0.0, 0.05, 0.1, 0.5]


def test_every_suggestion_for_too_little_data_is_accepted(tmp_path):
    failing = followed = 0
    for n, (seq, batch, mb), fraction in itertools.product(SIZES, SHAPES, FRACTIONS):
        path = _tokens(tmp_path / f"{n}.bin", n)
        base = [f"data.path={path}", f"data.seq_len={seq}", f"data.batch_size={batch}",
                f"data.eval_fraction={fraction}", f"schedule.micro_batches={mb}"]
        message = _advice(base)
        if message is None:
            continue
        failing += 1
        followed += _follow(base, message)
        m = MORE.search(message)
        if m:  # the exact least: that many tokens are accepted as they are, one fewer is not
            need = int(m[1].replace(",", ""))
            assert _advice([f"data.path={_tokens(tmp_path / 'need.bin', need)}", *base[1:]]) is None, message
            assert _advice([f"data.path={_tokens(tmp_path / 'less.bin', need - 1)}", *base[1:]]) is not None
        else:
            assert SETS.search(message), message  # something to do, always
    assert failing > 30 and followed > failing  # the walk saw the error and its advice


def test_a_short_held_out_file_suggests_what_it_holds(tmp_path):
    train, held = _tokens(tmp_path / "train.bin", 5000), _tokens(tmp_path / "val.bin", 100)
    base = [f"data.path={train}", f"data.eval_path={held}", "data.seq_len=128", "data.batch_size=4"]
    message = _advice(base)
    assert message and "the held-out file has 100 tokens, less than one window of 129" in message
    assert "--set data.seq_len=99 " in message and "a held-out file of at least 129 tokens" in message
    assert "eval_fraction" not in message  # the fraction does not apply to a held-out file of its own
    assert _follow(base, message) == 1


def test_a_batch_size_suggestion_splits_into_the_micro_batches(tmp_path):
    base = [f"data.path={_tokens(tmp_path / 't.bin', 7 * 16 + 1)}", "data.seq_len=16", "data.batch_size=8",
            "data.eval_fraction=0", "schedule.micro_batches=4"]
    message = _advice(base)  # 7 windows: 7 is the largest batch, 4 the largest that micro_batches=4 splits
    assert "--set data.batch_size=4 " in message, message
    _follow(base, message)


def test_the_finetune_example_at_seq_len_512_advises_what_then_trains(tmp_path, monkeypatch, capsys):
    """The real case: examples/finetune-hf-jsonl.toml on its own 20-document sample at seq_len 512 (the example's
    former setting). Its advice used to be `data.eval_fraction=0`, which then failed ("cannot fill one batch")."""
    monkeypatch.chdir(REPO)
    model = tiny_hf_dir(tmp_path / "hf-model", REPO / "examples" / "data" / "sample.jsonl")
    capsys.readouterr()  # transformers' progress bar of the save
    argv = ["train", "--config", "examples/finetune-hf-jsonl.toml", "--set", f"model.name={model}",
            "--set", "run.steps=1"]
    for tried in (["data.seq_len=512"], ["data.seq_len=512", "data.eval_fraction=0"]):
        extra = [a for s in tried for a in ("--set", s)]
        assert main(argv + extra + ["--set", f"run.out_dir={tmp_path / 'refused'}",
                                    "--set", f"run.export_hf={tmp_path / 'refused-export'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("megatrain train: error: examples/data/sample.jsonl: ") and "\n" not in err, err
        suggested = SETS.findall(err)
        assert suggested and "data.eval_fraction=0" not in suggested, err
        for i, setting in enumerate(suggested):  # each one trains: the whole `train`, one step
            rest = [a for s in tried if not s.startswith(setting.split("=")[0] + "=") for a in ("--set", s)]
            out_dir = tmp_path / f"runs-{len(tried)}-{i}"
            assert main(argv + rest + ["--set", setting, "--set", f"run.out_dir={out_dir}",
                                       "--set", f"run.export_hf={out_dir / 'export'}"]) == 0, \
                (setting, err, capsys.readouterr().err)
            capsys.readouterr()
    assert not (tmp_path / "refused").exists()  # a refused run wrote nothing


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.3])
def test_tokens_needed_is_the_least_that_fits(fraction):
    from megatrain.data.sizing import DataShape, tokens_needed

    for seq, batch in itertools.product([1, 7, 128, 513], [1, 3, 8]):
        shape = DataShape(0, None, fraction, seq, batch)
        need = tokens_needed(shape)
        assert DataShape(need, None, fraction, seq, batch).fits()
        assert not any(DataShape(k, None, fraction, seq, batch).fits() for k in range(max(1, need - 50), need))
