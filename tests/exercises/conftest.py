"""One test suite grades either implementation (the --impl option of tests/conftest.py):

    pytest tests/exercises                      grades solutions/ and checks that every
                                                exercise in exercises/ is still unsolved
    pytest tests/exercises --impl=exercises     grades your files (`make grade`)

A test whose exercise still raises NotImplementedError is skipped under --impl=exercises
("not written yet"), so an untouched exercise never shows as a failure; under
--impl=solutions it is a failure like any other. A table at the end sums up each exercise.
`make grade` runs tests/exercises/grade.py instead, which runs each exercise's tests in a
process of its own so that a crash of one is reported and the others still grade.
"""
from __future__ import annotations

import json
import os
import pathlib
import warnings
from collections import defaultdict

import pytest

from grading import DEVICE, SMOKE_CALLS, TRITON_EXERCISES, load
from report import Grade, exercise_of, failure_hint, table

_grades: dict[str, Grade] = defaultdict(Grade)   # exercise -> what its tests did
# grade.py runs each exercise in a process of its own and sets this: every test's start and
# outcome go to that file as they happen (so a crash still leaves a record), and grade.py
# prints the table.
_EVENTS = os.environ.get("LLMLAB_GRADE_EVENTS")


def _event(**event) -> None:
    with open(_EVENTS, "a") as f:
        f.write(json.dumps(event) + "\n")


@pytest.fixture(scope="session")
def impl(request) -> str:
    """"solutions" or "exercises": which folder is graded."""
    return request.config.getoption("--impl")


@pytest.fixture(scope="module")
def ex(request, impl):
    """The module under grade: <impl>/<EXERCISE>.py, EXERCISE set by the test module."""
    return load(impl, request.module.EXERCISE)


@pytest.fixture(scope="session")
def engine_llm(request):
    """The embedded model with llmlab's torch kernels, on an engine of its own whose KV cache
    the end-to-end tests fill with garbage (grading.poison_kv_cache). It shares the weights of
    tests/conftest.py's `llm` on a CPU; on a GPU it loads them there (compiled Triton kernels
    need GPU tensors)."""
    from grading import grading_engine

    if DEVICE == "cpu":
        return grading_engine(request.getfixturevalue("llm"))
    import llmlab

    return grading_engine(llmlab.LLM(device="cuda", dtype="float32", backend="torch", num_gpu_blocks=64))


@pytest.fixture(scope="session")
def reference_token_ids(engine_llm):
    """Greedy token ids of grading.PROMPTS with llmlab's own kernels, the cache poisoned as in
    every end-to-end test; the same as with a clean cache, or the comparison would be unfair."""
    from grading import generate_token_ids, poison_kv_cache

    clean = generate_token_ids(engine_llm, poison=False)   # a new engine: its cache is all zeros
    if not poison_kv_cache(engine_llm):
        warnings.warn("engine.kv_cache.device is not a float tensor any more: the end-to-end tests run on "
                      "a clean cache and will miss a missing length mask (update grading.poison_kv_cache)")
    poisoned = generate_token_ids(engine_llm)
    assert poisoned == clean, "llmlab's own kernels read KV slots no sequence owns: report this bug"
    return poisoned


def pytest_ignore_collect(collection_path, config):
    # test_pristine_exercises.py checks that exercises/ is unsolved, test_grader_messages.py grades
    # the graders on planted mistakes: neither is about a student's own files
    if collection_path.name in ("test_pristine_exercises.py", "test_grader_messages.py") \
            and config.getoption("--impl") == "exercises":
        return True
    return None


# The exercises written in Triton. On a machine without CUDA their graders run them in Triton's
# interpreter, so their tests (and their smoke calls in test_pristine_exercises.py) are `slow`:
# `make test-fast` leaves them out, `make test` and `make grade` run them.
WRITTEN_IN_TRITON = {*TRITON_EXERCISES, "ex12_quantized_store_kv"}


def pytest_collection_modifyitems(config, items):
    for item in items:     # every item of the session comes here: only this folder's are ours
        if item.path.parent != pathlib.Path(__file__).parent:
            continue
        exercise = exercise_of(item.nodeid)
        if item.originalname == "test_solution_runs_the_smoke_calls":
            exercise = item.callspec.params["name"]
        if exercise in WRITTEN_IN_TRITON:
            item.add_marker(pytest.mark.slow)


# Fixtures that load the 30-layer model: built only for an exercise that is written.
MODEL_FIXTURES = {"llm", "engine_llm", "reference_token_ids"}


def pytest_runtest_setup(item):
    """Skip a model-driven test of an unwritten exercise before its fixtures load the model
    (grade.py runs every exercise in a new process, so that would cost a load each). Skip
    the end-to-end run of an exercise whose cases already failed: a kernel that stores out
    of bounds corrupts memory inside the model's run too, and a crash there would lose the
    failures' messages (pytest prints them at the end)."""
    exercise = exercise_of(item.nodeid)
    if exercise is not None and item.name == "test_end_to_end" and _grades[exercise].counts["failed"]:
        pytest.skip(f"{exercise}: runs once the cases above pass")
    if (item.config.getoption("--impl") != "exercises" or exercise is None
            or not MODEL_FIXTURES & set(item.fixturenames) or exercise not in SMOKE_CALLS):
        return
    module = load("exercises", exercise)
    for call in SMOKE_CALLS[exercise]:
        try:
            call(module)
        except NotImplementedError as error:
            _not_written(item.nodeid, exercise, error)
            pytest.skip(f"exercises/{exercise}.py: not written yet ({error})")
        except Exception:   # noqa: BLE001 -- written but wrong: the test itself will say how
            return


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except NotImplementedError as error:
        exercise = exercise_of(item.nodeid)
        if item.config.getoption("--impl") != "exercises" or exercise is None:
            raise
        _not_written(item.nodeid, exercise, error)
        pytest.skip(f"exercises/{exercise}.py: not written yet ({error})")


def _not_written(nodeid: str, exercise: str, error: NotImplementedError) -> None:
    """An exercise's skeleton raised: note it, and its message (what to write first)."""
    grade = _grades[exercise]
    grade.not_written = True
    grade.hint(str(error))
    if _EVENTS:
        _event(nodeid=nodeid, not_written=True, hint=str(error))


def pytest_runtest_logstart(nodeid, location):
    if _EVENTS and exercise_of(nodeid):
        _event(nodeid=nodeid, start=True)


def pytest_runtest_logreport(report):
    exercise = exercise_of(report.nodeid)
    if exercise is None:
        return
    outcome = report.outcome
    if outcome == "skipped" and "gpu" in report.keywords and DEVICE == "cpu":
        outcome = "needs_gpu"   # graded where CUDA exists: neither a failure nor the student's to do
    _grades[exercise].add(report.when, outcome)
    hint = failure_hint(report) if outcome == "failed" else None
    _grades[exercise].hint(hint)
    if _EVENTS:
        _event(nodeid=report.nodeid, when=report.when, outcome=outcome, hint=hint)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _grades or _EVENTS:   # grade.py prints the table of all exercises itself
        return
    impl = config.getoption("--impl")
    terminalreporter.section(f"llmlab exercises: grading {impl}/")
    for line in table(_grades, impl):
        terminalreporter.write_line(line)
