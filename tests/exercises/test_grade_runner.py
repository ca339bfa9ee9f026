"""grade.py, the runner behind `make grade`: an exercise whose process dies (a segfault,
as an out-of-bounds read under Triton's interpreter causes) or hangs is reported as such
in the table, and the grading goes on."""
import sys
import textwrap

import pytest
import torch

from grade import grade_one
from report import table

CRASHING = """
import ctypes

def test_reads_address_zero():
    ctypes.string_at(0)     # what an unmasked tl.load far past a tensor does to the interpreter
"""
HANGING = """
import time

def test_never_ends():
    while True:
        time.sleep(0.1)
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_segfault_is_reported_and_a_hang_times_out(tmp_path):
    # grade.py passes --impl; here nothing else of the grader's plugin is needed
    (tmp_path / "conftest.py").write_text("def pytest_addoption(parser):\n    parser.addoption('--impl')\n")
    (tmp_path / "test_ex98_crash.py").write_text(textwrap.dedent(CRASHING))
    (tmp_path / "test_ex99_hang.py").write_text(textwrap.dedent(HANGING))
    grades = {**grade_one(tmp_path / "test_ex98_crash.py", "solutions", timeout=120, extra=[]),
              **grade_one(tmp_path / "test_ex99_hang.py", "solutions", timeout=5, extra=[])}
    lines = table(grades, "solutions")
    status = [line for line in lines if "next:" not in line]
    assert status[0].split()[:2] == ["ex98_crash", "CRASHED"] and "SIGSEGV" in status[0]
    assert "out-of-bounds read" in status[0]
    assert status[1].split()[:2] == ["ex99_hang", "HUNG"] and "no result after 5 s" in status[1]
    # what to check next: the test file to run alone
    assert "next: run it alone to see where: pytest tests/exercises/test_ex98_crash.py" in lines[1]


def test_exit_status_is_1_while_an_exercise_is_unwritten_or_failing():
    """`make grade` is what a course's CI reads: only all-passing is 0; --only-written lets
    unwritten exercises through, never failing ones."""
    from grade import exit_status
    from report import Grade

    done, todo, failing = Grade(), Grade(not_written=True), Grade()
    done.add("call", "passed")
    failing.add("call", "failed")
    partial = Grade(not_written=True)
    partial.add("call", "passed")
    partial.add("call", "skipped")
    assert exit_status({"ex01": done}, api_ok=True, only_written=False) == 0
    assert exit_status({"ex01": done, "ex02": todo}, api_ok=True, only_written=False) == 1
    assert exit_status({"ex01": done, "ex09": partial}, api_ok=True, only_written=False) == 1
    assert exit_status({"ex01": done, "ex02": todo, "ex09": partial}, api_ok=True, only_written=True) == 0
    assert exit_status({"ex01": done, "ex02": failing}, api_ok=True, only_written=True) == 1
    assert exit_status({"ex01": done}, api_ok=False, only_written=True) == 1


def test_names_select_exercises_and_the_capstone():
    """`grade.py capstone` runs the capstone alone; a name that matches no exercise is refused
    (it used to grade nothing and print an empty table)."""
    from grade import main, select

    files, capstone, unknown = select([])
    assert len(files) >= 20 and capstone and not unknown
    files, capstone, unknown = select(["capstone"])
    assert files == [] and capstone and not unknown
    files, capstone, unknown = select(["ex17", "capstone"])
    assert [f.stem for f in files] == ["test_ex17_scheduler_step"] and capstone and not unknown
    files, capstone, unknown = select(["ex06"])
    assert [f.stem for f in files] == ["test_ex06_paged_attention_v1"] and not capstone
    assert select(["ex31", "ex13"])[2] == ["ex31"]
    assert main(["ex31"]) == 2


def test_a_signature_without_annotations_is_the_same_api():
    from test_same_api import parameters

    def annotated(x: int, y: float = 1.0, *, backend: str | None = None) -> int: ...
    def bare(x, y=1.0, *, backend=None): ...
    def renamed(x, z=1.0, *, backend=None): ...
    assert parameters(annotated) == parameters(bare)
    assert parameters(renamed) != parameters(bare)


@pytest.mark.slow
def test_grading_the_unwritten_exercises_exits_1():
    """A real run on a pristine exercise (09 is plain Python: quick): not written -> 1."""
    import subprocess
    from pathlib import Path

    grader = Path(__file__).parent / "grade.py"
    result = subprocess.run([sys.executable, str(grader), "ex09"], capture_output=True, text=True, timeout=300)
    assert "to do" in result.stdout and result.returncode == 1, result.stdout[-2000:]
    # the table says what to write first: the skeleton's own message
    table_part = result.stdout[result.stdout.index("llmlab exercises: grading"):]
    assert "next: ex09: write BlockAllocator." in table_part, table_part
    result = subprocess.run([sys.executable, str(grader), "ex09", "--only-written"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:]


def test_a_gpu_case_skipped_without_cuda_is_not_a_failure():
    """On a machine without CUDA an exercise's `gpu` cases are skipped: its line says that they
    need a CUDA device, and they do not make `make grade` exit 1 (nor count as not written)."""
    from grade import exit_status
    from report import Grade

    grade = Grade()
    grade.add("call", "passed")
    grade.add("setup", "needs_gpu")
    assert grade.status() == "done     1 passed; 1 skipped: need a CUDA device (graded on a GPU only)"
    assert exit_status({"ex20": grade}, api_ok=True, only_written=False) == 0


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the gpu cases run")
def test_exercise_20_on_a_cpu_grades_its_pure_part_and_says_the_rest_needs_cuda(tmp_path):
    """The real conftest.py marks the skipped `gpu` cases (grade.py's events), on the solutions."""
    from pathlib import Path

    grades = grade_one(Path(__file__).parent / "test_ex20_cuda_graphs.py", "solutions", timeout=300, extra=[])
    [line] = table(grades, "solutions")
    assert line.split()[:3] == ["ex20_cuda_graphs", "done", "3"] and "need a CUDA device" in line, line


def test_the_table_says_what_to_check_next():
    """The grade table's "next:" line under an exercise not done: the first failure's message
    (the graders name the mistake in its first line), after its test's name; nothing under a
    passing exercise."""
    from types import SimpleNamespace

    from report import Grade, failure_hint

    crash = SimpleNamespace(message="AssertionError: ex11: the token that crosses top_p was dropped\nassert 3 == 4")
    report = SimpleNamespace(nodeid="tests/exercises/test_ex11_top_p.py::test_explaining_case",
                             longrepr=SimpleNamespace(reprcrash=crash))
    assert failure_hint(report) == "test_explaining_case: ex11: the token that crosses top_p was dropped"
    failing, done = Grade(), Grade()
    failing.add("call", "failed")
    failing.hint(failure_hint(report))
    failing.hint("a later failure")              # the first one stays
    done.add("call", "passed")
    lines = table({"ex11_top_p": failing, "ex01_rms_norm": done}, "exercises")
    assert lines[0].split()[:2] == ["ex01_rms_norm", "done"] and lines[1].split()[:2] == ["ex11_top_p", "FAILING"]
    assert lines[2].strip() == "next: test_explaining_case: ex11: the token that crosses top_p was dropped"
    assert len(lines) == 3


def test_your_files_can_live_in_a_folder_of_your_own(tmp_path):
    """LLMLAB_EXERCISES_DIR: `exercises.exNN_...` is that folder's file where it has one, else
    the repo's (a student who may not edit the checkout grades a folder of their own)."""
    import os
    import subprocess

    (tmp_path / "ex09_block_allocator.py").write_text("SOLVED_HERE = True\n")
    code = ("import exercises.ex09_block_allocator as mine, exercises.ex10_chunked_prefill as theirs; "
            "print(mine.__file__); print(theirs.__file__); print(mine.SOLVED_HERE)")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=60,
                            env={**os.environ, "LLMLAB_EXERCISES_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    mine, theirs, solved = result.stdout.split()
    assert mine == str(tmp_path / "ex09_block_allocator.py") and solved == "True"
    assert theirs == os.path.join(repo, "exercises", "ex10_chunked_prefill.py")
