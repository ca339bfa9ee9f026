"""With --impl=solutions (`make test`): every exercise in exercises/ is still unsolved,
and each kernel skeleton is its solution with the kernel bodies taken out -- so deleting
the launcher's `raise NotImplementedError(...)` line is all a student does outside them.

Not collected with --impl=exercises, where exercises/ holds a student's work (conftest.py).
"""
from __future__ import annotations

import inspect

import pytest
import triton

from grading import EXERCISES, SMOKE_CALLS, TRITON_EXERCISES, load


def test_every_exercise_has_smoke_calls():
    assert sorted(SMOKE_CALLS) == EXERCISES


@pytest.mark.parametrize("name", EXERCISES)
def test_exercise_is_unsolved(name):
    exercise = load("exercises", name)
    for call in SMOKE_CALLS[name]:
        with pytest.raises(NotImplementedError):
            call(exercise)


@pytest.mark.parametrize("name", EXERCISES)
def test_solution_runs_the_smoke_calls(name):
    solution = load("solutions", name)
    for call in SMOKE_CALLS[name]:
        call(solution)


def _jit_kernels(module) -> dict:
    """name -> parameter names of each @triton.jit function (compiled or interpreted)."""
    return {name: obj.arg_names for name, obj in vars(module).items()
            if isinstance(obj, triton.runtime.KernelInterface)}


@pytest.mark.parametrize("name", sorted(TRITON_EXERCISES))
def test_skeleton_is_the_solution_without_kernel_bodies(name):
    exercise, solution = load("exercises", name), load("solutions", name)
    assert _jit_kernels(exercise) == _jit_kernels(solution), "kernel names or parameters differ"
    launcher = TRITON_EXERCISES[name]
    skeleton = inspect.getsource(getattr(exercise, launcher)).splitlines()
    raise_lines = [line for line in skeleton if "raise NotImplementedError" in line]
    assert len(raise_lines) == 1, "the launcher should raise NotImplementedError exactly once"
    skeleton.remove(raise_lines[0])
    assert skeleton == inspect.getsource(getattr(solution, launcher)).splitlines()
