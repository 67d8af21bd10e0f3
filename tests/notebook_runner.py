"""Execute a notebook of notebooks/ the way a user would, top to bottom, and collect what it showed."""
from dataclasses import dataclass
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@dataclass
class ExecutedNotebook:
    text: str  # everything printed to stdout/stderr
    images: list  # image/png outputs
    tables: list[str]  # text/plain of the outputs that have an HTML form (DataFrames)


def run_notebook(name: str, workdir: Path, timeout_s: int = 120) -> ExecutedNotebook:
    """Run notebooks/`name` in `workdir` and fail on any cell error. Notebooks are committed without outputs, so
    diffs stay readable and nothing stale is shown: that is checked first."""
    import nbformat  # a test dependency: missing, the suite fails (never skips)
    import nbclient  # a test dependency: missing, the suite fails (never skips)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{name} has committed outputs"
    nbclient.NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(workdir)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors
    return ExecutedNotebook(
        text="".join(o.get("text", "") for o in outputs if o.output_type == "stream"),
        images=[o for o in outputs if "image/png" in o.get("data", {})],
        tables=[o["data"]["text/plain"] for o in outputs if "text/html" in o.get("data", {})],
    )
