"""Where a machine's hardware profile lives, and which profile a command uses (no torch: `simulate` reads it).

A profile is a measurement of one machine on one day (shared/DESIGN.md section 4). Every command that simulates
(`simulate`, `compare`, `train`, `--schedule auto`) asks `resolve_profile` for the one to use, and prints
`ProfileChoice.line()`: `profile: <path or name> (<why>)`. The first of these that applies wins:

1. the command's own setting: `--profile NAME|FILE` (`simulate`, `compare`) or `run.profile` (`train`);
2. the environment variable `MEGATRAIN_PROFILE` (a shipped name or a file), for every command at once;
3. a resumed run (`train --resume`): its own `profile_calibrated.json` (live calibration fitted it to the run's
   steps), when it records this machine;
4. this machine's profile in the per-user cache, `<cache>/profiles/<machine key>.json`, when the machine it
   records is this one (`machine.differences`); `<cache>` is `$MEGATRAIN_CACHE`, else `$XDG_CACHE_HOME/megatrain`,
   else `~/.cache/megatrain`, and the key is `machine.key(this_machine())`. `megatrain profile` writes it, and so
   does `--schedule auto` when it has to profile quickly first;
5. the profile shipped for the backend (`cpu` on the CPU backend, `h200-measured` on CUDA), which is NOT this
   machine's: the reason says so and names the command that measures this one.

A profile that records another machine is never taken from the cache or a run silently: it is skipped, and the
reason of the profile used says why. One given explicitly (1, 2) is used as given (the user asked for it); the
command adds a note when it records another machine (`machine.mismatch_line`).

Writing (`save_measured`): a new measurement of this machine is merged into the cached one, so compute tables of
other model shapes and sequence lengths measured before are kept (a table with the same key and seq is replaced by
the new one, as scripts/merge_profile_tables.py does). Profiles written under `runs/profiles/` by earlier versions
of `--schedule auto` are not read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from megatrain.profiling.machine import differences, key, this_machine
from megatrain.sim.profile import HardwareProfile, ProfileError, load_profile

ENV_PROFILE = "MEGATRAIN_PROFILE"  # a shipped name or a profile JSON, for every command (rule 2)
ENV_CACHE = "MEGATRAIN_CACHE"  # the per-user cache directory (rule 4)
CALIBRATED = "profile_calibrated.json"  # what live calibration writes into a run directory (profiling/live.py)
SHIPPED_DEFAULT = {"cpu": "cpu", "cuda": "h200-measured"}  # rule 5, by backend


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a command uses: a shipped name or a path, why it was chosen, and which rule chose it."""

    profile: str
    reason: str
    source: str  # "flag", "env", "run", "cache" or "shipped" (the rules of the module docstring, in order)

    def line(self) -> str:
        """The one line every command prints: `profile: <path or name> (<why>)`."""
        return f"profile: {self.profile} ({self.reason})"

    @property
    def explicit(self) -> bool:
        """Given by the user (flag or environment), so used as given even when it records another machine."""
        return self.source in ("flag", "env")


def cache_dir() -> Path:
    """The per-user cache: $MEGATRAIN_CACHE, else $XDG_CACHE_HOME/megatrain, else ~/.cache/megatrain."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "megatrain"


def cache_path(machine: dict | None = None) -> Path:
    """Where the profile of `machine` (default: this one) is cached: <cache>/profiles/<machine key>.json."""
    return cache_dir() / "profiles" / f"{key(machine or this_machine())}.json"


def shipped_default(backend: str) -> str:
    """The shipped profile for a backend ("cpu", "cuda", "cuda:1"): cpu or h200-measured."""
    return SHIPPED_DEFAULT["cuda" if str(backend).startswith("cuda") else "cpu"]


def reprofile_command(backend: str, model: str | None = None, batch: int | None = None, seq: int | None = None) -> str:
    """The command that measures this machine into the cache (every later command then uses it)."""
    shape = "".join(f" --{k} {v}" for k, v in (("model", model), ("batch", batch), ("seq", seq)) if v is not None)
    device = "cuda" if str(backend).startswith("cuda") else "cpu"
    return f"megatrain profile --quick{shape} --device {device}"


def _of_this_machine(path: Path, here: dict, what: str) -> tuple[HardwareProfile | None, str]:
    """(the profile at `path`, "") when it loads and records this machine, else (None, why it is skipped)."""
    try:
        profile = load_profile(path)
    except (ProfileError, OSError, ValueError) as e:
        return None, f"{what} {path} does not load ({str(e).splitlines()[0]}), skipped"
    if not profile.machine:
        return None, f"{what} {path} records no machine, so it cannot be checked against this one, skipped"
    diff = differences(profile.machine, here)
    if diff:
        return None, f"{what} {path} was measured on another machine ({', '.join(diff)}), skipped"
    return profile, ""


def resolve_profile(backend: str, flag: str | None = None, flag_name: str = "--profile", run_dir=None,
                    resumed: bool = False, here: dict | None = None) -> ProfileChoice:
    """The profile to use on `backend` and why, by the precedence of the module docstring.

    flag: the command's own setting (named `flag_name` in the reason); run_dir + resumed: a resumed run whose
    calibrated profile comes before the cache; here: this machine (`machine.this_machine()`, given by tests)."""
    if flag:
        return ProfileChoice(str(flag), f"{flag_name}{_kind_of(str(flag))}", "flag")
    if os.environ.get(ENV_PROFILE):
        value = os.environ[ENV_PROFILE]
        return ProfileChoice(value, f"${ENV_PROFILE}{_kind_of(value)}", "env")
    here = here or this_machine(backend)
    skipped = []
    if resumed and run_dir is not None:
        path = Path(run_dir) / CALIBRATED
        if path.is_file():
            profile, why = _of_this_machine(path, here, "the run's calibrated profile")
            if profile is not None:
                return ProfileChoice(str(path), "this resumed run's own calibrated profile, fitted to its steps on "
                                                "this machine", "run")
            skipped.append(why)
    path = cache_path(here)
    if path.is_file():
        profile, why = _of_this_machine(path, here, "the cached profile")
        if profile is not None:
            return ProfileChoice(str(path), "this machine's profile in the cache", "cache")
        skipped.append(why)
    else:
        others = sorted(p.stem for p in path.parent.glob("*.json") if not p.name.endswith(".measurements.json"))
        if others:
            skipped.append(f"the cache {path.parent} holds profiles of other machines only ({', '.join(others)}), "
                           "not used")
    name = shipped_default(backend)
    cuda = str(backend).startswith("cuda")
    if cuda and not here.get("gpu_count"):  # a GPU step predicted on a machine without one: the advice must run here
        how = (f"this machine has no GPU: `{reprofile_command('cpu')}` measures its CPU backend into it, and "
               f"`{reprofile_command('cuda')}` on the GPU machine measures that one")
    else:
        how = f"`{reprofile_command(backend)}` measures one there"
    why = (f"shipped default for {'cuda' if cuda else 'cpu'}, NOT this machine's: no profile of this machine at "
           f"{path}; {how}")
    return ProfileChoice(name, "; ".join([why, *skipped]), "shipped")


def _kind_of(value: str) -> str:
    """", the cached profile of this machine" etc.: what an explicitly given profile is, when that is known."""
    p = Path(value)
    if p.name == CALIBRATED:
        return f", the calibrated profile of run {p.parent.name}"
    try:
        if p.resolve() == cache_path().resolve():
            return ", this machine's profile in the cache"
    except OSError:
        pass
    return ""


def merge_tables(old: HardwareProfile, new: HardwareProfile) -> tuple[HardwareProfile, int]:
    """`new` with the compute tables of `old` that it does not measure again (same key and seq: the new one
    wins); returns the merged profile and how many old tables were kept."""
    replaced = {(t.key, t.seq) for t in new.compute_tables}
    kept = [t for t in old.compute_tables if (t.key, t.seq) not in replaced]
    if not kept:
        return new, 0
    notes = dict(new.notes)
    notes["compute_tables"] = (notes.get("compute_tables", "") + f" Plus {len(kept)} table(s) of earlier "
                               f"measurements of this machine ({old.name}).").strip()
    return replace(new, compute_tables=tuple(new.compute_tables) + tuple(kept), notes=notes), len(kept)


def save_measured(cal, out=None, log=print, here: dict | None = None) -> tuple[Path, Path]:
    """Write a `profiling.calibrate.Calibration` (its `.profile`, `.measurements`, `.save`) to `out`, default this
    machine's cache file; when that file already holds a profile of the same machine, its compute tables of other
    shapes are kept (`merge_tables`). Returns (profile path, measurements path). The cache file is named by this
    machine as `resolve_profile` sees it (`here`), so the next command finds it."""
    path = Path(out) if out else cache_path(here)
    if path.is_file() and cal.profile.machine:
        try:
            old = load_profile(path)
        except (ProfileError, OSError, ValueError) as e:
            log(f"note: {path} did not load ({str(e).splitlines()[0]}); it is replaced")
        else:
            if old.machine and not differences(old.machine, cal.profile.machine):
                merged, kept = merge_tables(old, cal.profile)
                if kept:
                    log(f"{path} already held a profile of this machine: its {kept} compute table(s) of other "
                        "shapes are kept")
                cal = replace(cal, profile=merged)
            else:
                log(f"note: {path} held a profile of another machine; it is replaced")
    return cal.save(path)
