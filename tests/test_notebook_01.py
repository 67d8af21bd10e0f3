"""notebooks/01_explore_schedules.ipynb runs top to bottom and shows what its prose talks about."""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "01_explore_schedules.ipynb"


def test_notebook_01_executes_and_draws_its_charts(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Committed without outputs, so that diffs stay readable and nothing stale is shown.
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    # The simulator is fast enough to run the notebook at its real settings (bench-3b, h200): a few seconds.
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3  # one step, buffers 1 vs 2, three optimizer placements
    tables = [o["data"]["text/plain"] for o in outputs if "text/html" in o.get("data", {})]
    assert len(tables) == 4
    assert "buffers=1, optimizer=after" in tables[0] and "split 0.25" in tables[2]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "overlap (predicted): step" in text
