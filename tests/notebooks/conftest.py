"""Each notebook executed once per check, not once per tool: a notebook that
test_notebook_reruns.py reruns is already run as nbval runs it (a fresh kernel started in
notebooks/, every code cell in order, any error fails) by that test's first pass, so nbval's
own run of the same notebook is left out when both are collected (`make test`: ten notebooks,
a third of the suite's notebook time). `pytest --nbval-lax notebooks/00_tour.ipynb` alone, or
with the rerun test deselected (`-m "not slow"`, `-k`), still runs it through nbval."""
from __future__ import annotations

from pathlib import Path

import pytest

RERUN_TEST = "test_every_cell_runs_again_after_a_full_run"


@pytest.hookimpl(trylast=True)      # after -m / -k / --deselect have chosen the tests
def pytest_collection_modifyitems(config, items):
    rerun = {item.callspec.params["name"] for item in items
             if getattr(item, "originalname", None) == RERUN_TEST and hasattr(item, "callspec")}
    nbval_runs = [item for item in items if type(item).__name__ == "IPyNbCell" and Path(item.path).stem in rerun]
    if nbval_runs:
        left = set(map(id, nbval_runs))
        items[:] = [item for item in items if id(item) not in left]
        config.hook.pytest_deselected(items=nbval_runs)
