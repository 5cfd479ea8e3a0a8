"""The notebooks run end to end (small settings) in a fresh kernel, without an error in any cell."""

from __future__ import annotations

from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_the_walkthroughs_are_there():
    assert {p.name for p in NOTEBOOKS} >= {"capacity_planning.ipynb", "scheduler_comparison.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    # the kernel inherits this environment: small settings, output under tmp_path
    monkeypatch.setenv("SERVESIM_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("SERVESIM_NOTEBOOK_OUT", str(tmp_path))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    assert any(tmp_path.rglob("*.png")), "the notebook should have drawn its plots"
