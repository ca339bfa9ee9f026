"""Grade every exercise, each in a process of its own, so that one that crashes or hangs is
reported in the table and the others are still graded (`make grade` runs this).

    .venv/bin/python tests/exercises/grade.py                  grades exercises/
    .venv/bin/python tests/exercises/grade.py ex06 ex07        only those
    .venv/bin/python tests/exercises/grade.py capstone         only the capstone (or ex17 capstone)
    .venv/bin/python tests/exercises/grade.py --impl=solutions --timeout=900
    .venv/bin/python tests/exercises/grade.py --only-written   unwritten exercises do not fail it

It exits 0 only when every graded exercise passes (a course's CI can rely on it): an
exercise not written yet counts as not passing, unless --only-written. A case marked `gpu`
(exercise 20's capture and replay) is skipped on a machine without CUDA and counts as
neither: its exercise's line says how many need a CUDA device.

Under Triton's interpreter a kernel's load outside a tensor reads whatever memory is there:
NaN or garbage when it is mapped, a segmentation fault when it is not, and the fault kills
the process (no table, only "Fatal Python error"). Here that process is one exercise's
pytest run; its tests report their start and outcome to a file as they go (conftest.py),
so the table can say which test was running when it died.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from report import Grade, exercise_of, table

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

WHY = {
    signal.SIGSEGV: "likely an out-of-bounds read or write: a tl.load / tl.store whose mask lets a lane "
                    "past the end of a tensor (or a block-table entry past a sequence's blocks)",
    signal.SIGBUS: "likely an out-of-bounds read or write: check the masks of every tl.load / tl.store",
    signal.SIGABRT: "the process aborted: a failed check inside Triton or torch, or the C heap corrupted by an "
                    "out-of-bounds tl.store (check each store's mask: padding slots, rows past a sequence's end)",
    signal.SIGKILL: "killed (out of memory?)",
}


def crash_message(returncode: int | None, timeout: float, running: str | None) -> str | None:
    """Why an exercise's process did not finish normally, or None when it did (pytest exits
    0 when all passed, 1 when some failed)."""
    where = f" in {running.split('::', 1)[1]}" if running else ""
    if returncode is None:
        return f"hung{where}: no result after {timeout:.0f} s (a loop that never ends? a huge grid?)"
    if returncode in (0, 1):
        return None
    if returncode < 0:
        sig = signal.Signals(-returncode)
        return f"crashed{where} ({WHY.get(sig, 'killed by a signal')}; {sig.name})"
    return f"could not run (pytest exit code {returncode}: an import or syntax error? see above)"


def grade_one(test_file: Path, impl: str, timeout: float, extra: list[str]) -> dict[str, Grade]:
    """Run one exercise's tests in a child pytest; returns its grades, crashes included."""
    grades: dict[str, Grade] = defaultdict(Grade)
    exercise = test_file.stem.removeprefix("test_")
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as events:
        env = dict(os.environ, LLMLAB_GRADE_EVENTS=events.name)
        command = [sys.executable, "-m", "pytest", str(test_file), f"--impl={impl}",
                   "-q", "-p", "no:cacheprovider", *extra]
        # its own process group: a timeout kills its children (e.g. compile workers) too
        child = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True)
        try:
            returncode = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            returncode = None
        except KeyboardInterrupt:
            os.killpg(child.pid, signal.SIGKILL)
            raise
        running = None
        for line in events:
            event = json.loads(line)
            if event.get("start"):
                running = event["nodeid"]
            elif event.get("not_written"):
                grades[exercise_of(event["nodeid"])].not_written = True
                grades[exercise_of(event["nodeid"])].hint(event.get("hint"))
            else:
                grades[exercise_of(event["nodeid"])].add(event["when"], event["outcome"])
                grades[exercise_of(event["nodeid"])].hint(event.get("hint"))
                if event["when"] == "teardown":
                    running = None
    crash = crash_message(returncode, timeout, running)
    if crash:
        grades[exercise].crashed = crash
    return grades


def select(names: list[str]) -> tuple[list[Path], bool, list[str]]:
    """The test files and whether the capstone runs, for the names given (none: everything);
    and the names that match nothing (a typo, or an exercise that does not exist)."""
    files = sorted(HERE.glob("test_ex[0-9][0-9]_*.py"))
    if not names:
        return files, True, []
    unknown = [name for name in names
               if name != "capstone" and not any(f.stem.startswith(f"test_{name}") for f in files)]
    chosen = [f for f in files if any(f.stem.startswith(f"test_{name}") for name in names if name != "capstone")]
    return chosen, "capstone" in names, unknown


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("exercises", nargs="*",
                        help="e.g. ex06, ex06_paged or capstone (default: every exercise, then the capstone)")
    parser.add_argument("--impl", default="exercises", choices=["exercises", "solutions"])
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per exercise before it counts as hung")
    parser.add_argument("--only-written", action="store_true",
                        help="grade only what you wrote: exercises not written yet do not make the exit status 1")
    args, extra = parser.parse_known_args(argv)
    files, run_capstone, unknown = select(args.exercises)
    if unknown:
        known = sorted(f.stem.removeprefix("test_")[:4] for f in HERE.glob("test_ex[0-9][0-9]_*.py"))
        print(f"grade.py: no exercise named {', '.join(unknown)}; the names are {', '.join(known)} and capstone",
              file=sys.stderr)
        return 2
    grades: dict[str, Grade] = {}
    for test_file in files:
        print(f"\n=== {test_file.stem.removeprefix('test_')}", flush=True)
        grades.update(grade_one(test_file, args.impl, args.timeout, extra))
    # the engine and the grader call your files by the names and signatures of solutions/
    print("\n=== public names and signatures", flush=True)
    # names and parameters only: a docstring you edited or annotations you left out are no mistake
    api = subprocess.run([sys.executable, "-m", "pytest", str((HERE / "test_same_api.py").relative_to(REPO)),
                          f"--impl={args.impl}", "-q", "-p", "no:cacheprovider", "-k", "not docstring"],
                         cwd=REPO).returncode
    # the capstone: every engine-component exercise plugged into one engine at once
    capstone = None
    if run_capstone:
        print("\n=== capstone", flush=True)
        capstone = subprocess.run([sys.executable, "-m", "pytest", str((HERE / "test_capstone.py").relative_to(REPO)),
                                   f"--impl={args.impl}", "-q", "-rs", "-p", "no:cacheprovider"],
                                  cwd=REPO, capture_output=True, text=True)
        print(capstone.stdout[-3000:], flush=True)
    mine = os.environ.get("LLMLAB_EXERCISES_DIR") if args.impl == "exercises" else None
    print(f"\nllmlab exercises: grading {args.impl}/" + (f" (your files first: {mine})" if mine else ""))
    for line in table(grades, args.impl):
        print(line)
    print(f"  {'public names and signatures':26s} {'same as solutions/' if api == 0 else 'DIFFERENT (see above)'}")
    if capstone is not None:
        print(f"  {'capstone':26s} {capstone_status(capstone.returncode, capstone.stdout)}")
    code = exit_status(grades, api == 0, args.only_written)
    if capstone is not None and capstone_status(capstone.returncode, capstone.stdout).startswith("FAILING"):
        code = 1
    if code and not args.only_written and any(g.not_written for g in grades.values()):
        print("  (exit status 1 while an exercise is not written yet; --only-written grades only your own work)")
    return code


def capstone_status(returncode: int, output: str) -> str:
    """The capstone's line: the engine on every engine-component exercise at once."""
    if returncode == 0 and " skipped" in output and " passed" not in output:
        return "to do    runs once every engine-component exercise (13 to 19) is written"
    if returncode == 0:
        return "done     the engine on all your components writes the default engine's texts"
    return "FAILING  the engine on all your components differs (see above)"


def exit_status(grades: dict[str, Grade], api_ok: bool, only_written: bool) -> int:
    """0 when every graded exercise passes and the public API matches; 1 otherwise. A test
    not written yet (skipped) is not a pass, unless only_written."""
    if not api_ok or any(g.crashed or g.counts["failed"] for g in grades.values()):
        return 1
    if not only_written and any(g.not_written or g.counts["skipped"] for g in grades.values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
