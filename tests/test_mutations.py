"""The equality tests can fail: each of the three most important equalities is broken on purpose and the tests
that claim it must fail.

A mutant (tests/conftest.py, MEGATRAIN_TEST_MUTANT) replaces one implementation for a whole pytest session in a
subprocess: AdamW with its bias corrections off by one step, an undo of a speculated update that does nothing, and a
loss normaliser that counts the ignored (-100) targets. The equality tests below run under it and each must FAIL on
an assertion (not on an error of the mutant itself). A test that survives its mutant compares nothing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAINING = "tests/test_exec_training.py"

KILLED_BY = {
    # vs torch.optim.AdamW: one tile against torch's optimizer, and 20 steps of a schedule against a plain loop
    "adamw": ["tests/test_exec_runtime.py::test_adamw_on_a_tile_equals_torch_adamw_with_decay_on_the_matrix_prefix_only",
              f"{TRAINING}::test_every_named_schedule_trains_like_a_plain_adamw_loop[double-buffer]"],
    # the undo alone, and a run whose every unit is undone and redone in every step
    "undo": ["tests/test_speculative_clip.py::test_adamw_undo_inverts_one_update_to_fp32_rounding[2]",
             f"{TRAINING}::test_updates_undone_and_redone_in_every_clipping_step_train_like_the_plain_loop"
             "[arrival-clip]"],
    # the gradient's scale: Adam is blind to it (clipping even rescales it back), the global norm is not
    "loss-normaliser": [f"{TRAINING}::test_every_named_schedule_trains_like_a_plain_adamw_loop[double-buffer]"],
}


def test_every_mutant_is_killed_by_the_tests_that_claim_its_equality(tmp_path):
    runs = {}
    for mutant, tests in KILLED_BY.items():  # the three sessions run side by side
        env = {**os.environ, "MEGATRAIN_TEST_MUTANT": mutant}
        report = tmp_path / f"{mutant}.xml"
        runs[mutant] = (report, subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *tests],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    survivors = []
    for mutant, (report, proc) in runs.items():
        out, _ = proc.communicate(timeout=300)
        # exit code 1: tests ran and some failed (2-4: interrupted, internal or usage error, 5: nothing collected)
        assert proc.returncode == 1, f"mutant {mutant}: pytest exited {proc.returncode}\n{out[-3000:]}"
        outcome = {}  # test id -> the message of its failure, or None when it passed
        for case in ET.parse(report).iter("testcase"):
            test = f"{case.get('file') or case.get('classname').replace('.', '/') + '.py'}::{case.get('name')}"
            failure = case.find("failure")
            outcome[test] = None if failure is None else failure.get("message", "")
        for test in KILLED_BY[mutant]:
            if test not in outcome:
                survivors.append(f"{test} did not run with the {mutant} mutant")
            elif outcome[test] is None:
                survivors.append(f"{test} passed with the {mutant} mutant")
            elif not outcome[test].startswith(("AssertionError", "assert")):
                survivors.append(f"{test} failed on something else than an assertion with the {mutant} mutant: "
                                 f"{outcome[test][:300]}")
    assert not survivors, "\n".join(survivors)


def test_an_unknown_mutant_is_refused():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
                           "tests/test_mutations.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEGATRAIN_TEST_MUTANT": "nope"})
    assert proc.returncode != 0 and "is not a mutant" in proc.stdout + proc.stderr


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "tests").glob("*.py")))
def test_no_test_dependency_is_skipped_when_missing(path):
    """A reference library missing from the machine must fail the suite, not skip the equality tests that need it:
    the packages of pyproject's dependencies and [test] extra are imported, never importorskip'ed."""
    import tomllib  # noqa: PLC0415 (stdlib, only this test reads pyproject)

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = meta["dependencies"] + meta["optional-dependencies"]["test"]
    names = {r.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower() for r in required}
    text = (ROOT / "tests" / path).read_text()
    skipped = [n for n in names if f'importorskip("{n}")' in text or f"importorskip('{n}')" in text]
    assert not skipped, f"tests/{path} skips when {skipped} is missing; import it (it is a dependency of the tests)"
