"""One test suite grades either implementation (the --impl option of tests/conftest.py):

    pytest tests/exercises                      grades solutions/ and checks that every
                                                exercise in exercises/ is still unsolved
    pytest tests/exercises --impl=exercises     grades your files (`make grade`)

A test whose exercise still raises NotImplementedError is skipped under --impl=exercises
("not written yet"), so an untouched exercise never shows as a failure; under
--impl=solutions it is a failure like any other. A table at the end sums up each exercise.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict

import pytest

from grading import DEVICE, load

_results: dict[str, Counter] = defaultdict(Counter)   # exercise -> outcome counts
_not_written: dict[str, str] = {}                     # exercise -> NotImplementedError message


def _exercise_of(nodeid: str) -> str | None:
    match = re.search(r"test_(ex\d\d_\w+?)\.py::", nodeid)
    return match.group(1) if match else None


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
    from grading import generate_token_ids

    clean = generate_token_ids(engine_llm, poison=False)   # a new engine: its cache is all zeros
    poisoned = generate_token_ids(engine_llm)
    assert poisoned == clean, "llmlab's own kernels read KV slots no sequence owns: report this bug"
    return poisoned


def pytest_ignore_collect(collection_path, config):
    # test_pristine_exercises.py checks that exercises/ is unsolved: not for a student's own files
    if collection_path.name == "test_pristine_exercises.py" and config.getoption("--impl") == "exercises":
        return True
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except NotImplementedError as error:
        exercise = _exercise_of(item.nodeid)
        if item.config.getoption("--impl") != "exercises" or exercise is None:
            raise
        _not_written[exercise] = str(error)
        pytest.skip(f"exercises/{exercise}.py: not written yet ({error})")


def pytest_runtest_logreport(report):
    exercise = _exercise_of(report.nodeid)
    if exercise is None:
        return
    if report.when == "call" or report.outcome != "passed":  # setup errors and skips count too
        _results[exercise][report.outcome] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _results:
        return
    impl = config.getoption("--impl")
    terminalreporter.section(f"llmlab exercises: grading {impl}/")
    for exercise in sorted(_results):
        counts = _results[exercise]
        if counts["failed"]:
            status = f"FAILING  {counts['failed']} failed, {counts['passed']} passed"
        elif exercise in _not_written and not counts["passed"]:
            status = "to do    not written yet"
        elif counts["skipped"]:
            status = f"partial  {counts['passed']} passed, {counts['skipped']} not written yet"
        else:
            status = f"done     {counts['passed']} passed"
        terminalreporter.write_line(f"  {exercise:26s} {status}")
    if impl == "exercises" and _not_written:
        terminalreporter.write_line("  (a skipped test's exercise still raises NotImplementedError: "
                                    "see exercises/README.md)")
