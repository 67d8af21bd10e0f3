"""One summary, one measured step time per set of steps (issue 23, item 4): the end-of-run table and the live
calibration's line measure different steps in different ways, so each names the steps it covers."""
import re

from megatrain.train.config import load_config
from megatrain.train.loop import run_training


def test_every_measured_median_of_the_summary_names_its_steps(tmp_path):
    cfg = load_config(None, [f"run.out_dir={tmp_path / 'runs'}", "run.steps=6", "run.eval_every=0",
                             "run.checkpoint_every=0", "run.progress=false", "data.batch_size=2",
                             "data.seq_len=32", "schedule.compute_dtype=fp32"])
    lines = []
    run_training(cfg, log=lines.append)
    text = "\n".join(lines)
    assert "live calibration on steps 3-6" in text, text  # steps 1-2 warm up the calibration
    medians = [line for line in lines if re.search(r"\bmedian\b", line) and not line.startswith("config:")]
    assert len(medians) >= 2, text
    for line in medians:
        if line.strip().startswith("time/step") or line.lstrip().startswith("predicted"):
            continue
        assert re.search(r"steps \d+-\d+", line), line  # each measured median says which steps it covers
    assert "measured: the median over steps 2-6 of a step's wall time" in text, text
