"""The notebooks run top to bottom on the CPU and show what their prose talks about."""
import json

from notebook_runner import run_notebook


def test_notebook_01_explores_schedules(tmp_path):
    # The simulator is fast enough to run the notebook at its real settings (bench-3b, h200): a few seconds.
    nb = run_notebook("01_explore_schedules.ipynb", tmp_path)
    assert len(nb.images) == 3  # one step, buffers 1 vs 2, three optimizer placements
    assert len(nb.tables) == 5
    assert "buffers=1, optimizer=after" in nb.tables[0] and "split 0.25" in nb.tables[2]
    # Section 7 edits the DAG by hand: the edited schedule is predicted slower than the one it came from.
    import re

    def step_s(label):  # the first column of the table (pandas wraps wide tables into blocks)
        return float(re.search(rf"^{re.escape(label)}\s+([\d.]+)", nb.tables[4], flags=re.M).group(1))

    assert step_s("overlap, U(l) after F(l-1)") > step_s("overlap")
    assert "overlap (predicted): step" in nb.text


def test_notebook_02_profiles_runs_compares_and_plots(tmp_path):
    nb = run_notebook("02_predicted_vs_measured.ipynb", tmp_path)
    assert "on cpu" in nb.text and "measurements, about" in nb.text and "compute tables" in nb.text
    assert "step time (ms)" in nb.text and "per-task error" in nb.text and "Kendall tau" in nb.text
    assert len(nb.images) == 2  # the two timelines side by side; per-group bars + per-task scatter
    assert len(nb.tables) == 1 and "overlap, 4 micro-batches" in nb.tables[0] and "meas_rank" in nb.tables[0]


def test_notebook_03_chooses_a_schedule_trains_and_plots(tmp_path):
    nb = run_notebook("03_train.ipynb", tmp_path)
    best = nb.text.split("fastest predicted: ")[1].split(" ")[0]
    # The run used the schedule the comparison chose, and left its run directory in the notebook's folder.
    run = tmp_path / "runs" / "notebook03"
    assert json.loads((run / "config.json").read_text())["schedule"]["name"] == best
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 31))
    assert f"schedule {best};" in nb.text and "step 30/30" in nb.text and "measured (median)" in nb.text
    assert len(nb.images) == 2  # loss curve, predicted vs measured timeline
    assert len(nb.tables) == 3  # schedule comparison, last metrics, predicted vs measured
    # The resume hint names this run's own config and directory, with paths that work from anywhere.
    hint = next(line for line in nb.text.splitlines() if line.startswith("megatrain train --config "))
    assert f"--config {run.resolve() / 'config.toml'} --set run.out_dir={run.resolve().parent} " in hint
    assert hint.endswith("--set run.steps=60 --resume")
