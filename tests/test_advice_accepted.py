"""Advice is only ever something the next command accepts (issue 23, item 2).

For the preset models and several host / GPU sizes, the memory error `train` prints (train/fit.py check_memory, the
check of its pre-run path) is read back, and every `--set` it suggests is applied the way `train` would apply it: the
config is loaded and validated with the suggestion (the knob rules, before anything is allocated) and the same memory
check is run again with the suggested knobs. A suggestion labelled "(fits)" must then fit there. `plan` may list the
planned-only layouts, but only labelled as such.
"""
import re

import pytest

from megatrain.cli import main
from megatrain.compile.advice import fit_report, plan_memory
from megatrain.model.presets import PRESETS
from megatrain.units import GiB
from megatrain.train.config import ConfigError, load_config
from megatrain.train.fit import MemoryFitError, check_memory

MODELS = ["debug", "bench-3b", "llama3-8b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "dense-120b"]
HOSTS_GIB = [2, 32, 256, 1000]
GPUS_GIB = [0.5, 24, 80]
SHAPE = (8, 2048)
# "  - <k=v k=v> (what): 12.3 GiB (fits)" and "  => fits ... with --set <k=v k=v>: ..."
ITEM = re.compile(r"^\s*- (?P<label>.*?): [\d.]+ GiB \((?P<verdict>fits|still short)\)")
FIX = re.compile(r"=> fits .*?with --set (?P<sets>.*?): ")


def _suggestions(text: str) -> list[tuple[list[str], str, str]]:
    """(the `--set` items, "fits" / "still short" / "fix", "host" / "GPU": the memory it lowers) of every knob
    suggestion in a fit report."""
    out, what = [], ""
    for line in text.splitlines():
        if line.strip().startswith(("host:", "GPU:")):
            what = line.strip().split(":")[0]
        if m := FIX.search(line):
            out.append((m["sets"].split(), "fix", what))
        elif m := ITEM.match(line):
            sets = []
            for token in m["label"].split():
                if "=" not in token or token.startswith("("):
                    break
                sets.append(token)
            if sets:  # "- or a smaller batch / shorter sequence" and "- fewer ranks" name no knob
                out.append((sets, m["verdict"], what))
    return out


def _base(model: str) -> list[str]:
    return [f"model.name={model}", f"data.batch_size={SHAPE[0]}", f"data.seq_len={SHAPE[1]}"]


def _check(model: str, sets: list[str], backend: str, host: int, gpu: int | None) -> str:
    """`train`'s pre-run checks with `sets` applied: the config (every knob rule) and the memory check; the report."""
    cfg = load_config(None, _base(model) + [f"schedule.{s}" for s in sets]).validate()
    try:
        _, lines = check_memory(cfg.model.spec(), *cfg.step_shape(), cfg.step_knobs(), backend, host, gpu, ranks=1)
        return "\n".join(lines)
    except MemoryFitError as e:  # still short somewhere: the message, which is still accepted advice
        return str(e)


@pytest.mark.parametrize("model", MODELS)
def test_every_knob_train_suggests_is_accepted_by_train(model):
    seen = 0
    for backend, gpus in (("cuda", GPUS_GIB), ("cpu", [None])):
        for host_gib in HOSTS_GIB:
            for gpu_gib in gpus:
                host, gpu = int(host_gib * GiB), None if gpu_gib is None else int(gpu_gib * GiB)
                text = _check(model, [], backend, host, gpu)
                if "DOES NOT FIT" not in text:
                    continue  # fits as it is: no advice
                assert "planned only" not in text and "nvme" not in text, text
                for sets, verdict, what in _suggestions(text):
                    seen += 1
                    try:
                        report = _check(model, sets, backend, host, gpu)
                    except ConfigError as e:  # anything but "does not fit" is a refusal of the advice
                        pytest.fail(f"{model} {backend} host {host_gib} GiB GPU {gpu_gib} GiB: advice --set "
                                    f"{' '.join(sets)} is refused by train: {e}")
                    if verdict in ("fits", "fix"):  # said to fit: that memory fits
                        assert f"{what}: DOES NOT FIT" not in report, (sets, report)
    assert seen or model == "debug"  # the walk saw advice (the debug model fits everywhere)


def test_plan_labels_the_planned_only_layouts(capsys):
    """`plan` may show the NVMe tier, but says that `train` refuses it, and never gives it as the fix."""
    assert main(["plan", "--model", "dense-120b", "--schedule", "lean", "--host-gib", "500", "--gpu-gib", "139"]) == 1
    out = capsys.readouterr().out
    nvme = [line for line in out.splitlines() if "state_tier=nvme" in line]
    assert nvme and all("planned only" in line and "`train` refuses it" in line for line in nvme), nvme
    assert not any("=> fits" in line and "nvme" in line for line in out.splitlines())


def test_train_refuses_a_planned_only_layout_before_anything_is_allocated():
    cfg = load_config(None, _base("debug") + ["schedule.state_tier=nvme-moments"])
    with pytest.raises(ConfigError, match="planned only"):
        check_memory(cfg.model.spec(), *cfg.step_shape(), cfg.step_knobs(), "cpu", 1000 * GiB, None, ranks=1)


def test_train_advice_never_names_a_planned_only_layout():
    plan = plan_memory(PRESETS["dense-120b"], *SHAPE, load_config(None, []).step_knobs())
    ok, lines = fit_report(plan, 600 * GiB, None)
    assert not ok and not any("nvme" in line for line in lines), lines
