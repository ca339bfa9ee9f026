"""exercises/ and solutions/ hold the same files with the same public API, so one test
suite grades either, and every kernel launcher can stand in for llmlab's own kernel.

These run under both --impl values: under --impl=exercises they catch a changed
signature in your files before the grading tests do.
"""
from __future__ import annotations

import inspect

import pytest

from grading import EXERCISES, KERNEL_EXERCISES, REPO, TRITON_EXERCISES, load
from llmlab.kernels import reference


def parameters(fn) -> list[tuple]:
    """A signature as the engine and the grader call it: each parameter's name, kind and
    default. Annotations are left out: a solution without them is no mistake."""
    return [(p.name, p.kind.name, repr(p.default)) for p in inspect.signature(fn).parameters.values()]


def public_api(module) -> dict:
    """name -> parameters of every public function and class the module defines (for a
    class: its __init__, public methods and properties)."""
    api = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue  # private, or imported (torch, triton, ...)
        if inspect.isclass(obj):
            api[name] = {
                attr: "property" if isinstance(value, property) else parameters(value)
                for attr, value in vars(obj).items()
                if (attr == "__init__" or not attr.startswith("_")) and (callable(value) or isinstance(value, property))
            }
        elif inspect.isfunction(obj):
            api[name] = parameters(obj)
    return api


def test_same_files():
    exercise_files = sorted(path.name for path in (REPO / "exercises").glob("*.py"))
    solution_files = sorted(path.name for path in (REPO / "solutions").glob("*.py"))
    assert exercise_files == solution_files
    assert len(EXERCISES) >= 10


@pytest.mark.parametrize("name", EXERCISES)
def test_same_public_api(name):
    exercise_api, solution_api = public_api(load("exercises", name)), public_api(load("solutions", name))
    assert exercise_api, f"{name} defines no public function or class"
    assert exercise_api == solution_api


@pytest.mark.parametrize("name", sorted(KERNEL_EXERCISES))
def test_kernel_launcher_has_the_reference_signature(name):
    """What lets `llmlab.kernels.override(<kernel>=module.<kernel>)` plug it into the engine."""
    kernel = KERNEL_EXERCISES[name]
    expected = parameters(getattr(reference, kernel))
    for impl in ("exercises", "solutions"):
        assert parameters(getattr(load(impl, name), kernel)) == expected, f"{impl}/{name}.py"


@pytest.mark.parametrize("name", EXERCISES)
def test_docstring_states_the_task(name):
    """The exercise's docstring is the whole brief: task, shapes or state, hints, what to read."""
    doc = load("exercises", name).__doc__
    assert doc == load("solutions", name).__doc__, "exercise and solution docstrings differ"
    for needed in ("Difficulty:", "Read first:", "notebooks/", "Task", "Hints", "Grade:"):
        assert needed in doc, f"{name}'s docstring lacks {needed!r}"
    if name in TRITON_EXERCISES:
        assert "kernels_explained/" in doc and "Shapes" in doc
