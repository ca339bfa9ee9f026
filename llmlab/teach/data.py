"""The data files the notebooks load (recorded on a GPU: notebooks/data/README.md says how),
found wherever the notebook runs from.

A notebook reads `data_file("h200_trace_random_llama3_8b.json")`, never a path relative to the
working folder: a student's copy of a notebook in a folder of their own still finds the kit's data.
"""
from __future__ import annotations

from pathlib import Path

import llmlab

KIT_DATA = Path(llmlab.__file__).resolve().parent.parent / "notebooks" / "data"   # the repository's own


def data_file(name: str) -> Path:
    """The path of notebooks/data/`name`: a `data/` folder beside the running notebook (the
    working folder Jupyter gives it) first, so a copy that brought its own data uses it, else
    the kit's own `notebooks/data/`."""
    for folder in (Path.cwd() / "data", KIT_DATA):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{name} is neither in {Path.cwd() / 'data'} (beside this notebook) nor in the kit's "
                            f"{KIT_DATA}; copy notebooks/data/{name} from the llmlab repository into a data/ "
                            f"folder beside the notebook")
