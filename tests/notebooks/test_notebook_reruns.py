"""Notebooks as a student uses them, beyond one clean Run All (which `make test` runs through
nbval): every cell run a second time, in order, after a full run, in the same kernel (a cell that
reuses a name another cell changed, or a server started twice, breaks here); and a notebook
copied on its own to a folder of the student's, which must still find its data.

The first pass is the clean Run All nbval would make (a fresh kernel in notebooks/, every code
cell once, any error fails), so conftest.py leaves nbval's own run of a RERUN notebook out
when this test runs: each notebook executes twice in `make test`, not three times."""
from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
# every notebook (issues #38 and #33): each runs again, cell by cell, after a full run
RERUN = ["00_tour", "01_tokens_to_logits", "02_rmsnorm_rope_swiglu", "03_flash_attention_prefill",
         "04_paged_kv_cache", "05_paged_attention_v1_v2", "06_iteration_level_scheduling", "07_chunked_prefill",
         "08_preemption", "09_prefix_caching", "10_sampling", "11_serving_and_benchmarking",
         "12_research_a_scheduling_policy", "13_kv_cache_quantization", "14_multi_gpu_on_cpu"]
CELL_TIMEOUT_S = 600      # the slowest cell (11's benchmark) on a loaded 2-core machine

pytestmark = pytest.mark.slow     # a notebook twice: minutes


def execute(path: Path, working_folder: Path, passes: int) -> None:
    """Run every code cell of the notebook `passes` times over, in one kernel started in
    `working_folder` (Jupyter starts a notebook's kernel in the notebook's folder)."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(working_folder)}})
    with client.setup_kernel():
        for run in range(passes):
            for index, cell in enumerate(notebook.cells):
                if cell.cell_type == "code":
                    try:
                        client.execute_cell(cell, index)
                    except Exception as error:
                        raise AssertionError(f"pass {run + 1}, cell {index}:\n{cell.source}\n{error}") from None


@pytest.mark.parametrize("name", RERUN)
def test_every_cell_runs_again_after_a_full_run(name):
    execute(NOTEBOOKS / f"{name}.ipynb", NOTEBOOKS, passes=2)


def test_a_notebook_copied_alone_to_another_folder_finds_its_data(tmp_path):
    """05 loads the H200 benchmark rows from notebooks/data; its copy has no data/ beside it."""
    copy = tmp_path / "my_notes" / "05_paged_attention_v1_v2.ipynb"
    copy.parent.mkdir()
    shutil.copy(NOTEBOOKS / copy.name, copy)
    execute(copy, copy.parent, passes=1)


def test_no_notebook_reads_its_data_by_a_path_relative_to_the_working_folder():
    """What the copy test checks for 05, for every notebook and without running them: data is
    found through teach.data_file (beside the notebook, else the kit's notebooks/data), never
    as "data/..." (12 loaded its cost model that way, and a copy of it failed)."""
    import re

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                assert not re.search(r"""["']data/""", cell.source), f"{path.name}: {cell.source[:300]}"
