"""notebooks/03_train.ipynb runs top to bottom on the CPU: it picks the schedule the simulator predicts fastest,
trains with it, and draws the loss curve and the measured timeline."""
import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "03_train.ipynb"


def test_notebook_03_chooses_a_schedule_trains_and_plots(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # committed without outputs
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    best = text.split("fastest predicted: ")[1].split(" ")[0]
    # The run used the schedule the comparison chose, and left its run directory in the notebook's folder.
    run = tmp_path / "runs" / "notebook03"
    assert json.loads((run / "config.json").read_text())["schedule"]["name"] == best
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 31))
    assert f"schedule {best};" in text and "step 30/30" in text and "measured (median)" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2  # loss curve, predicted vs measured timeline
    tables = [o for o in outputs if "text/html" in o.get("data", {})]
    assert len(tables) == 3  # schedule comparison, last metrics, predicted vs measured
