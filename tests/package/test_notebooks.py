"""The notebooks in notebooks/ run top to bottom, and are stored without outputs.

Each notebook is executed with nbclient in a kernel started from this interpreter (a kernel spec
written for the test, so a ``python3`` kernel installed elsewhere on the Jupyter path is never
picked up), with ``notebooks/`` as the working directory and matplotlib's non-interactive inline
backend. A cell that raises fails the test with the cell's traceback.

With ``TRIACCEL_EXECUTED_NOTEBOOKS=FOLDER`` each executed notebook is also written there, as
stored plus its outputs, for the documentation build to render instead of executing the notebooks
a second time (``.ci/run`` sets it for the tests and for ``tools/docs.sh``; docs/conf.py reads
it and checks that every cell's source is still the stored one).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(path.name for path in NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = ("01_quickstart.ipynb", "02_diagnostics.ipynb", "03_elastic_batch.ipynb")
CELL_TIMEOUT_S = 300
KERNEL_NAME = "python3"  # the name nbclient and jupyter_client treat as IPython's kernel
# Where the executed notebooks are written for the documentation build (unset: nowhere).
EXECUTED_DIR = os.environ.get("TRIACCEL_EXECUTED_NOTEBOOKS")


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory: pytest.TempPathFactory) -> KernelSpecManager:
    """A kernel spec running ipykernel under this interpreter, found before any other."""
    root = tmp_path_factory.mktemp("kernels")
    spec = root / KERNEL_NAME
    spec.mkdir()
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (the test's interpreter)",
                "language": "python",
                "env": {"MPLBACKEND": "module://matplotlib_inline.backend_inline"},
            }
        )
    )
    return KernelSpecManager(kernel_dirs=[str(root)])


def test_the_notebooks_are_there():
    assert set(EXPECTED) <= set(NOTEBOOKS), f"missing notebooks: {set(EXPECTED) - set(NOTEBOOKS)}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_without_outputs(name):
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    nbformat.validate(nb)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name}: cell {index} is stored with outputs"
            assert cell.execution_count is None, f"{name}: cell {index} has an execution count"


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, kernel_specs):
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    # A first cell (in memory only) that reports which interpreter the kernel runs.
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys\nprint(sys.prefix)"))
    client = NotebookClient(
        nb,
        km=AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=kernel_specs),
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    start = time.perf_counter()
    # Raises CellExecutionError, with the cell's traceback, if a cell fails; shuts the kernel
    # down afterwards (nbclient leaves a kernel it did not start running otherwise).
    client.execute(cleanup_kc=True)
    print(f"{name}: executed in {time.perf_counter() - start:.1f} s")

    kernel_prefix = "".join(o.get("text", "") for o in nb.cells[0].outputs).strip()
    assert kernel_prefix == sys.prefix, f"the kernel ran in {kernel_prefix}, not {sys.prefix}"
    for index, cell in enumerate(nb.cells[1:]):
        if cell.cell_type == "code" and "plt.show()" in cell.source:
            kinds = {key for output in cell.outputs for key in output.get("data", {})}
            assert "image/png" in kinds, f"{name}: cell {index} drew no figure"

    if EXECUTED_DIR:
        # Without the interpreter cell (its output is this machine's path), only once it passed.
        nb.cells.pop(0)
        folder = pathlib.Path(EXECUTED_DIR)
        folder.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, folder / name)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_plotting_cells_are_folded_in_the_documentation(name):
    # The documentation shows a plotting cell's figure and folds its code behind a toggle.
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and "plt.show()" in cell.source:
            assert "hide-input" in cell.metadata.get("tags", []), f"{name}: cell {index}"
