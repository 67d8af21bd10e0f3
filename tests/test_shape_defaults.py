"""Batch / sequence defaults differ by command (a debug run, a 3B benchmark), so each command that takes --batch and
--seq says its default in --help and prints the shape it used in its first line (issue 23, item 4)."""
import pytest

from megatrain.cli import build_parser, main


def _defaults(command: str) -> tuple[str, str]:
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    found = {a.dest: a for a in sub._actions}
    for dest in ("batch", "seq"):
        assert f"default {found[dest].default}" in (found[dest].help or ""), (command, dest, found[dest].help)
    return str(found["batch"].default), str(found["seq"].default)


@pytest.mark.parametrize("command, argv", [
    ("plan", []),
    ("simulate", ["--model", "debug", "--no-plots"]),
    ("compare", ["--steps", "2", "--device", "cpu", "--no-plots"]),
])
def test_the_first_line_says_the_shape_the_defaults_gave(command, argv, tmp_path, capsys):
    batch, seq = _defaults(command)
    out = ["--out", str(tmp_path / "out")] if command != "plan" else []
    main([command, *argv, *out])
    first = capsys.readouterr().out.splitlines()[0]
    assert f"batch {batch} x seq {seq}" in first, first


def test_profile_documents_its_default_shape():
    assert _defaults("profile") == ("8", "2048")
