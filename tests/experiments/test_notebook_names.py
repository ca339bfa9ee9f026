"""What a notebook's text tells a student to type names things that exist: a workload it
calls a method of is one the notebook built, a policy named in `policy="..."` is one
`resolve_policy` knows, a `Workload.<name>` is a constructor Workload has. (Notebook 12's
"Try this" once sent students to `busy.with_priorities(...)`; the workload was `bursty`.)"""
import ast
import json
import pathlib
import re

import pytest

from llmlab.experiments import Workload
from llmlab.policies import resolve_policy

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
WORKLOAD_ATTRIBUTES = {name for name in dir(Workload) if not name.startswith("_")}


def cells(path):
    notebook = json.loads(path.read_text())
    for cell in notebook["cells"]:
        yield cell["cell_type"], "".join(cell["source"])


def parsed(source):
    """The AST of a code cell or a markdown code span, or None when it is not Python."""
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def workloads_built(path) -> set[str]:
    """Names the notebook's code assigns a Workload to: `x = Workload.gamma(...)`, or
    `y = x.with_priorities(...)` of one of those."""
    names = set()
    for kind, source in cells(path):
        tree = parsed(source) if kind == "code" else None
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and isinstance(node.value.func, ast.Attribute) \
                    and isinstance(node.value.func.value, ast.Name) \
                    and node.value.func.value.id in names | {"Workload"}:
                names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return names


def markdown_code(path):
    """(the span, its AST) of every inline code span of the notebook's markdown that is Python."""
    for kind, source in cells(path):
        if kind != "markdown":
            continue
        for span in re.findall(r"`([^`\n]+)`", source):
            tree = parsed(span)
            if tree is not None:
                yield span, tree


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_workloads_and_policies_named_in_the_text_exist(path):
    workloads = workloads_built(path)
    for span, tree in markdown_code(path):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.attr in WORKLOAD_ATTRIBUTES:
                receiver = node.value.id
                assert receiver == "Workload" or receiver in workloads, \
                    f"{path.name}: `{span}` calls {node.attr} of {receiver!r}, which the notebook never builds " \
                    f"(its workloads: {', '.join(sorted(workloads)) or 'none'})"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Workload":
                assert node.attr in WORKLOAD_ATTRIBUTES, f"{path.name}: `{span}`: Workload has no {node.attr!r}"
            if isinstance(node, ast.keyword) and node.arg == "policy" and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str):
                resolve_policy(node.value.value)     # raises "unknown policy ..." for a name that is not one


def test_the_check_finds_a_misnamed_workload(tmp_path):
    notebook = {"cells": [{"cell_type": "code", "source": ["bursty = Workload.gamma(10, rate=1.0)"]},
                          {"cell_type": "markdown", "source": ["Try `busy.with_priorities([0] * len(busy))`"]}]}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(notebook))
    with pytest.raises(AssertionError, match="calls with_priorities of 'busy'.*its workloads: bursty"):
        test_workloads_and_policies_named_in_the_text_exist(path)
    notebook["cells"][1]["source"] = ["Try `simulate(bursty, config, cost, policy=\"shortest_first\")`"]
    path.write_text(json.dumps(notebook))
    with pytest.raises(ValueError, match="unknown policy 'shortest_first'"):
        test_workloads_and_policies_named_in_the_text_exist(path)
