"""The grade table: one line per exercise, from the outcomes of its tests.

Both graders print it: the pytest plugin in conftest.py at the end of an in-process run,
and grade.py, which runs every exercise in a process of its own and adds the exercises
that crashed or hung (a kernel's out-of-bounds read can kill the process that runs it).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field


def exercise_of(nodeid: str) -> str | None:
    """'tests/exercises/test_ex06_paged_attention_v1.py::test_case[...]' -> 'ex06_paged_attention_v1'."""
    match = re.search(r"test_(ex\d\d_\w+?)\.py::", nodeid)
    return match.group(1) if match else None


@dataclass
class Grade:
    """What is known about one exercise's tests."""
    # "passed" | "failed" | "skipped" | "needs_gpu" (a `gpu` test on a machine without CUDA) -> tests
    counts: Counter = field(default_factory=Counter)
    not_written: bool = False       # a test hit the exercise's NotImplementedError
    crashed: str | None = None      # why its process died (grade.py only)
    first_hint: str | None = None   # what to check next: the first failure's message, or what to write

    def hint(self, text: str | None) -> None:
        if text and self.first_hint is None:
            self.first_hint = text

    def next_step(self, exercise: str) -> str:
        """What to check next, in one line (below the exercise's status in the table)."""
        if self.crashed:
            return f"run it alone to see where: pytest tests/exercises/test_{exercise}.py --impl=exercises -x"
        if self.counts["failed"] or (self.not_written and not self.counts["passed"]) or self.counts["skipped"]:
            line = " ".join((self.first_hint or "").split())
            return line[:117] + "..." if len(line) > 120 else line
        return ""

    def add(self, when: str, outcome: str) -> None:
        if when == "call" or outcome != "passed":   # setup errors and skips count too
            self.counts[outcome] += 1

    def status(self) -> str:
        counts = self.counts
        if self.crashed:
            done = f"; {counts['passed']} passed, {counts['failed']} failed before it" if sum(counts.values()) else ""
            label = {"hung": "HUNG", "could": "ERROR"}.get(self.crashed.split()[0].rstrip(":"), "CRASHED")
            return f"{label:8s} {self.crashed}{done}"
        if counts["failed"]:
            return f"FAILING  {counts['failed']} failed, {counts['passed']} passed"
        if self.not_written and not counts["passed"]:
            return "to do    not written yet"
        gpu = ""
        if counts["needs_gpu"]:   # not failures, nor the student's to do: a GPU grades them
            gpu = f"; {counts['needs_gpu']} skipped: need a CUDA device (graded on a GPU only)"
        if counts["skipped"]:
            return f"partial  {counts['passed']} passed, {counts['skipped']} not written yet{gpu}"
        return f"done     {counts['passed']} passed{gpu}"


def failure_hint(report) -> str | None:
    """The first line of a failed test's message (the graders' messages name the mistake
    there), after the test's short name."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    message = getattr(crash, "message", None) or str(getattr(report, "longrepr", "") or "")
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    first = first.removeprefix("AssertionError: ").removeprefix("assert ")
    name = report.nodeid.split("::")[-1]
    return f"{name}: {first}" if first else name


def table(grades: dict[str, Grade], impl: str) -> list[str]:
    lines = []
    for exercise in sorted(grades):
        lines.append(f"  {exercise:26s} {grades[exercise].status()}")
        step = grades[exercise].next_step(exercise)
        if step:
            lines.append(f"  {'':26s}   next: {step}")
    if impl == "exercises" and any(g.not_written for g in grades.values()):
        lines.append("  (a skipped test's exercise still raises NotImplementedError: see exercises/README.md)")
    if any(g.crashed for g in grades.values()):
        lines.append("  (a crashed exercise killed the process that ran it; the others were graded on their "
                     "own: see exercises/README.md, 'When the grader crashes')")
    return lines
