"""notebooks/02_predicted_vs_measured.ipynb runs top to bottom on the CPU backend: it profiles the machine, runs real
steps of three schedules, compares them with the simulator and draws the plots its prose talks about."""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "02_predicted_vs_measured.ipynb"


def test_notebook_02_profiles_runs_compares_and_plots(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # committed without outputs
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "on cpu" in text and "measurements, about" in text and "compute tables" in text
    assert "step time (ms)" in text and "per-task error" in text and "Kendall tau" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the two timelines side by side; per-group bars + per-task scatter
    tables = [o["data"]["text/plain"] for o in outputs if "text/html" in o.get("data", {})]
    assert len(tables) == 1 and "overlap, 4 micro-batches" in tables[0] and "meas_rank" in tables[0]
