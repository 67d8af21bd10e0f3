"""Test-session hooks: MEGATRAIN_TEST_MUTANT=<name> breaks one implementation on purpose for the whole session;
every test gets its own empty profile cache (the fixture at the end).

tests/test_mutations.py runs the equality tests that guard each of these in a subprocess with the mutant applied and
expects them to fail: a test that still passes with AdamW, the undo or the loss normaliser broken proves nothing.
Without the variable the mutant hook does nothing.
"""
from __future__ import annotations

import os
import sys

import pytest


def _rebind(module_prefix: str, name: str, original, broken) -> None:
    """Replace `original` by `broken` wherever a loaded megatrain module bound it under `name` (its defining module
    and every `from ... import name`), so the mutant reaches each call site, present and future imports alike."""
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith(module_prefix) and getattr(mod, name, None) is original:
            setattr(mod, name, broken)


def _wrong_adamw() -> None:
    """AdamW whose bias corrections use the step count one too high (an off-by-one in the step bookkeeping)."""
    import megatrain.engine.trainer  # noqa: F401 (loads every module that binds the update before rebinding it)
    import megatrain.profiling.rates  # noqa: F401 (binds adamw_update too)
    from megatrain.exec import optim

    original = optim.adamw_update

    def adamw_update(param, grad, exp_avg, exp_avg_sq, step, *args, **kwargs):
        return original(param, grad, exp_avg, exp_avg_sq, step + 1, *args, **kwargs)

    _rebind("megatrain", "adamw_update", original, adamw_update)


def _skipped_undo() -> None:
    """An undo that does nothing: a speculated update is kept, and the redo applies a second one on top."""
    import megatrain.engine.trainer  # noqa: F401 (loads megatrain.exec.updates, which binds adamw_undo)
    from megatrain.exec import optim

    _rebind("megatrain", "adamw_undo", optim.adamw_undo, lambda *args, **kwargs: None)


def _wrong_loss_normaliser() -> None:
    """Gradients of the summed token losses divided by every target position, the ignored (-100) ones included,
    instead of by the valid targets the loss is the mean over."""
    from megatrain.exec.compute import StepBatch

    StepBatch.loss_scale = property(lambda self: 1.0 / sum(t.numel() for t in self.targets))


MUTANTS = {"adamw": _wrong_adamw, "undo": _skipped_undo, "loss-normaliser": _wrong_loss_normaliser}


def pytest_configure(config):
    name = os.environ.get("MEGATRAIN_TEST_MUTANT")
    if not name:
        return
    if name not in MUTANTS:
        raise pytest.UsageError(f"MEGATRAIN_TEST_MUTANT={name!r} is not a mutant; use one of {sorted(MUTANTS)}")
    MUTANTS[name]()


@pytest.fixture(autouse=True)
def _profile_cache(tmp_path_factory, monkeypatch):
    """No test reads or writes the real per-user profile cache (~/.cache/megatrain, profiling/store.py), and none
    picks up a MEGATRAIN_PROFILE of the shell: every test (and every subprocess it spawns) gets an empty cache."""
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path_factory.mktemp("megatrain-cache")))
    monkeypatch.delenv("MEGATRAIN_PROFILE", raising=False)
