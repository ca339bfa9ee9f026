"""Each notebook executed once per check, not once per tool. A notebook runs in one of three
ways, each a clean Run All (a fresh kernel, every code cell in order, any error fails):

- in JupyterLab through chromium (test_notebooks_in_browser.py), twice in one kernel for a
  notebook of test_notebook_reruns.RERUN, from a copy in a folder without data/;
- the rerun test (test_notebook_reruns.py, nbclient), whose first pass is nbval's run;
- nbval's own run of the notebook (`--nbval-lax notebooks`).

When more than one of them is collected for a notebook, the first in that order stands in for
the others, which are left out: in `make test` with chromium, the browser test runs every
notebook, and nbval and the rerun test none (the copy test of 05 neither: every copy here
finds its data as that copy must); without chromium (the browser tests would skip) the rerun
test runs the RERUN notebooks and nbval the rest, as before #33. `pytest --nbval-lax
notebooks/00_tour.ipynb` alone, or with the others deselected (`-m "not slow"`, `-k`), still
runs it through nbval.

Under pytest-xdist (`make test`: `-n 2`) nbval's cells of one notebook are one unit, kept on
one worker and in order; the browser and rerun tests go one by one."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.browser import can_run_jupyterlab

BROWSER_TEST = "test_every_notebook_runs_in_jupyterlab"
RERUN_TEST = "test_every_cell_runs_again_after_a_full_run"
COPY_TEST = "test_a_notebook_copied_alone_to_another_folder_finds_its_data"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on CI's two cores: the kernels nbval and nbclient start here run torch on one
    # thread each, not two each (JupyterLab's kernels get one from helpers.jupyterlab)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def notebooks_of(items, test: str) -> set[str]:
    return {item.callspec.params["name"] for item in items
            if getattr(item, "originalname", None) == test and hasattr(item, "callspec")}


def is_nbval(item) -> bool:
    return type(item).__name__ == "IPyNbCell"


@pytest.hookimpl(optionalhook=True)     # a hook of pytest-xdist, which may be missing
def pytest_xdist_make_scheduler(config, log):
    """`-n 2` (pytest-xdist's --dist load) with nbval on: tests handed out one by one, but
    nbval's cells of one notebook as one unit, in order, to one worker (they share the
    notebook's kernel); without nbval, xdist's own scheduler (`make test-fast`). Not
    --dist loadgroup with xdist_group marks: pytest-xdist 3.8 writes the group into a node id
    field pytest 9.2 no longer reads (pytest-xdist issue #1386), and a notebook's cells then
    ran in two kernels, failing on names their first cell defines."""
    if config.getvalue("dist") != "load" or not (config.getoption("nbval", False)
                                                 or config.getoption("nbval_lax", False)):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class NotebookScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(".ipynb") else nodeid

    return NotebookScheduling(config, log)


@pytest.hookimpl(trylast=True)      # after -m / -k / --deselect have chosen the tests
def pytest_collection_modifyitems(config, items):
    in_browser = notebooks_of(items, BROWSER_TEST) if can_run_jupyterlab() else set()
    rerun = notebooks_of(items, RERUN_TEST)
    left_out = [item for item in items
                if (is_nbval(item) and Path(item.path).stem in in_browser | rerun)
                or (getattr(item, "originalname", None) == RERUN_TEST and item.callspec.params["name"] in in_browser)
                or (getattr(item, "originalname", None) == COPY_TEST and in_browser)]
    if left_out:
        left = set(map(id, left_out))
        items[:] = [item for item in items if id(item) not in left]
        config.hook.pytest_deselected(items=left_out)
