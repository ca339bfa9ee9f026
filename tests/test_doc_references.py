"""The documents name files that exist: every repository path that README.md, ARCHITECTURE.md,
BENCHMARKS.md, kernels_explained/*.md, exercises/*.md and the notebooks' markdown cells point
at, as a relative link, an inline code span or a plain path from the root, is there (files
move: #29's restructure left docs naming tests/test_kernels.py after it was split in three).

What counts as a reference is decided conservatively (a false alarm teaches people to ignore
the test); each rule says why. Fenced code blocks (commands) are not read. The checker is
tested on planted missing paths too, so it can fail."""
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "llmlab"


def documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "BENCHMARKS.md",
            *sorted((ROOT / "kernels_explained").glob("*.md")),
            *sorted((ROOT / "exercises").glob("*.md")),
            *sorted((ROOT / "notebooks").glob("*.ipynb"))]


def markdown_of(path: pathlib.Path) -> str:
    """A notebook's markdown cells (code cells are code, checked by running them), else the file."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(cell["source"]) for cell in cells
                           if cell["cell_type"] == "markdown")
    return path.read_text()


# Fenced code blocks hold commands and output, not prose references: left out whole.
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1", re.S | re.M)
# A code span as CommonMark pairs them: a run of backticks closed by a run of the same length.
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
# [text](target) and ![alt](target); an optional "title" after the target.
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")

# Suffixes that make a span without a slash a file name.
FILE_SUFFIXES = (".py", ".md", ".ipynb", ".toml", ".json", ".sh", ".yml", ".yaml", ".txt")
# A bare name (no slash, not a top-level entry) is checked only for these suffixes: .json,
# .toml, .yml, ... bare names in the prose are files the code writes or reads elsewhere
# (kernels.json from `bench kernels`, a checkpoint's config.json, a run's report.json).
BARE_CHECKED = (".py", ".md", ".ipynb")
# Only these characters in a path: quotes, brackets, =, (, <, {, * and the like make the
# span code, a URL argument or a placeholder (`triton/<name>.py`, `CostModel.load("...")`).
PATH_CHARS = re.compile(r"[A-Za-z0-9_.\-/]+")
# A component in capitals alone is a placeholder (`DIR/report.json`, `PATH`, `URL`).
PLACEHOLDER = re.compile(r"(^|/)[A-Z][A-Z_]+(/|$)")

# In plain prose only a path from one of these top-level folders that ends in a known file
# suffix is taken for one; not after a letter, /, : or . (a URL's path, a longer name).
PROSE_PATH = re.compile(r"(?<![\w/:.-])((?:llmlab|tests|notebooks|exercises|solutions|kernels_explained)"
                        r"/[\w./-]*\w\.(?:py|md|ipynb|toml|json|sh|yml|yaml|txt))(?![\w/])")

# References that look like ours but name another project's file: each with its reason.
ALLOWED = {
    ("ARCHITECTURE.md", "tp.py"),  # gpt-fast's tp.py, the design the text compares with
}


def names_in(folder: pathlib.Path) -> set[str]:
    return {entry.name for entry in folder.iterdir()} if folder.is_dir() else set()


def tree_file_names() -> set[str]:
    """File names anywhere in the repository's own folders (hidden folders, the virtual
    environment, caches and build output left out)."""
    skip = {"__pycache__", "build", "dist"}
    found = set()
    for top in ROOT.iterdir():
        if top.name.startswith(".") or top.name in skip or top.name.endswith(".egg-info"):
            continue
        if top.is_file():
            found.add(top.name)
            continue
        for path in top.rglob("*"):
            if path.is_file() and not skip & set(path.relative_to(ROOT).parts):
                found.add(path.name)
    return found


def span_reference(span: str, document: pathlib.Path, starts: set[str]) -> str | None:
    """The repository path a code span names, or None when it names none (as far as rules
    that make no false alarms can tell)."""
    span = span.strip()
    # A space makes it a command line or prose (`make test`, `pytest tests/kernels -k rope`).
    if not span or re.search(r"\s", span):
        return None
    # `file.py::test_name` (a pytest node) and `file.py:Name` / `file.py:123`: the file.
    span = re.split(r"::?", span, maxsplit=1)[0]
    if not PATH_CHARS.fullmatch(span) or "..." in span or PLACEHOLDER.search(span):
        return None
    # Absolute (/v1/completions, /metrics: URL routes), home (~/.cache), options (--out) and
    # ./ ../ spans (relative to wherever a command runs) are not paths the checker can place.
    if span.startswith(("/", "~", ".", "-")):
        # .ci/ is the one hidden top-level folder a document may name.
        if not span.startswith(".ci"):
            return None
    if "/" not in span:
        # A dotted module name (llmlab.kernels.knobs) is not a path: only a known suffix makes
        # a bare word a file name.
        if not span.endswith(FILE_SUFFIXES):
            return None
        if span in starts or span.endswith(BARE_CHECKED):
            return span
        return None
    # With a slash, the first component says whether it is ours: a top-level entry
    # (llmlab/, tests/, Makefile...), a folder of llmlab/ or llmlab/kernels/ (engine/,
    # cuda_graphs/, triton/, dense/: the docs write those relative to the package), or an
    # entry beside the document (a notebook's data/). Anything else (application/json,
    # 1/sqrt(D) left out above, calib/cost_model.json a user's folder) is not a path of ours.
    if span.split("/", 1)[0] not in starts | names_in(document.parent):
        return None
    last = span.rstrip("/").rsplit("/", 1)[-1]
    if "." in last and not last.endswith(FILE_SUFFIXES):
        # `triton/rope.rope`, `dense/skinny_gemm.swiglu_gemm`: a function in a module; the
        # module is the file it names.
        return span.rstrip("/").rsplit("/", 1)[0] + "/" + last.split(".", 1)[0] + ".py"
    return span


def link_reference(target: str) -> str | None:
    """The path a link target names, relative to its document, or None for a URL or anchor."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
        return None  # http(s):, mailto:, and anchors within the page
    return target.split("#", 1)[0] or None


def missing_references(document: pathlib.Path, text: str | None = None) -> list[str]:
    """`document: reference` for each reference in the document to a path that does not
    exist. A code span resolves against the root, llmlab/, llmlab/kernels/ or the document's
    folder (the docs say `engine/scheduler.py` and `triton/rope.py` in a sentence about the
    package); a bare file name (`warm_up.py` in a list under "engine/") may live anywhere in
    the tree. A link resolves against its document's folder, as a browser does."""
    text = markdown_of(document) if text is None else text
    text = FENCE.sub("", text)
    name = document.relative_to(ROOT).as_posix() if document.is_relative_to(ROOT) else document.name
    starts = {entry for entry in names_in(ROOT) if not entry.startswith(".")} | {".ci"}
    starts |= {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_")}
    starts |= {p.name for p in (PACKAGE / "kernels").iterdir()
               if p.is_dir() and not p.name.startswith("_")}
    bases = [ROOT, PACKAGE, PACKAGE / "kernels", document.parent]
    everywhere = None
    missing = []

    # A code span never crosses a paragraph (a blank line), so an unpaired backtick in one
    # paragraph cannot swap code and prose in the next.
    spans = [m for paragraph in re.split(r"\n[ \t]*\n", text) for m in CODE_SPAN.finditer(paragraph)]
    for match in spans:
        reference = span_reference(match.group(2), document, starts)
        if reference is None or (name, reference) in ALLOWED:
            continue
        if "/" not in reference and reference not in starts:
            everywhere = tree_file_names() if everywhere is None else everywhere
            found = reference in everywhere
        else:
            # `triton/silu_mul` names the module: the path or the path + .py
            candidates = [reference]
            if "." not in reference.rsplit("/", 1)[-1]:
                candidates.append(reference + ".py")
            found = any((base / path).exists() for base in bases for path in candidates)
        if not found:
            missing.append(f"{name}: {match.group(2).strip()}")

    # Links: code spans are out of the text first (a `](` in code is not a link).
    prose = "\n\n".join(CODE_SPAN.sub(" ", p) for p in re.split(r"\n[ \t]*\n", text))
    for match in LINK.finditer(prose):
        reference = link_reference(match.group(1))
        if reference is not None and not (document.parent / reference).exists():
            missing.append(f"{name}: {match.group(1)}")

    # A path in plain prose, outside code and links ("tests/engine/test_overlap.py checks..."):
    # only the unmistakable form, from the root and naming a file by its suffix.
    for match in PROSE_PATH.finditer(LINK.sub("]", prose)):
        if not (ROOT / match.group(1)).exists():
            missing.append(f"{name}: {match.group(1)}")
    return missing


def test_documents_name_files_that_exist():
    assert [path for path in documents() if not path.exists()] == []
    missing = [line for document in documents() for line in missing_references(document)]
    assert missing == [], "missing references:\n" + "\n".join(missing)


@pytest.mark.parametrize("text, expected", [
    ("See [the tests](../tests/kernels/test_nothing_here.py#top).",
     ["kernels_explained/planted.md: ../tests/kernels/test_nothing_here.py#top"]),
    ("Moved: `engine/cuda_graphs.py`, `tests/test_kernels.py::test_rope` and `gone_for_good.py`.",
     ["kernels_explained/planted.md: engine/cuda_graphs.py",
      "kernels_explained/planted.md: tests/test_kernels.py::test_rope",
      "kernels_explained/planted.md: gone_for_good.py"]),
    ("Plain prose: tests/test_overlap.py checks it; https://github.com/x/llmlab/tests/y.py is a URL.",
     ["kernels_explained/planted.md: tests/test_overlap.py"]),
    # What is not a reference stays quiet; what exists passes.
    ("`llmlab.kernels.knobs`, `/v1/completions`, `triton/<name>.py`, `pytest tests/x.py`, "
     "`application/json`, `kernels.json`, `~/.cache/llmlab`, [web](https://example.com), "
     "[here](#anchor), `triton/rope.rope`, `cuda_graphs/prompt.py`, [t](../tests/kernels/test_attention.py)\n"
     "```\nllmlab/not_there.py\n```\n", []),
])
def test_the_checker_reports_a_planted_missing_path(text, expected, tmp_path):
    """A markdown file planted in a temporary folder, read as the checker reads a document and
    checked as if it sat in kernels_explained/ (so its links resolve as a real one's do): the
    checker must be able to fail, and stay quiet on what is no reference."""
    planted = tmp_path / "planted.md"
    planted.write_text(text)
    document = ROOT / "kernels_explained" / "planted.md"
    assert missing_references(document, markdown_of(planted)) == expected


def test_the_checker_reads_a_notebooks_markdown_cells_only(tmp_path):
    """A planted notebook: its markdown cell's missing path is reported, its code cell's is not
    (code names files the way code does: paths built at run time, outputs not yet written)."""
    planted = tmp_path / "planted.ipynb"
    planted.write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "metadata": {}, "source": ["See `llmlab/engine/prompt_graphs.py`.\n"]},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": ["# `llmlab/not_written_yet.py`\n"]},
    ], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    document = ROOT / "notebooks" / "planted.ipynb"
    assert missing_references(document, markdown_of(planted)) == [
        "notebooks/planted.ipynb: llmlab/engine/prompt_graphs.py"]
