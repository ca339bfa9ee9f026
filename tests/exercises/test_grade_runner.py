"""grade.py, the runner behind `make grade`: an exercise whose process dies (a segfault,
as an out-of-bounds read under Triton's interpreter causes) or hangs is reported as such
in the table, and the grading goes on."""
import sys
import textwrap

import pytest

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
    assert lines[0].split()[:2] == ["ex98_crash", "CRASHED"] and "SIGSEGV" in lines[0]
    assert "out-of-bounds read" in lines[0]
    assert lines[1].split()[:2] == ["ex99_hang", "HUNG"] and "no result after 5 s" in lines[1]
