# One-command setup: every target builds .venv on first use and reinstalls only when a
# dependency list changes. `make test` is what CI (.ci/run) runs.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

# nbval collects *.ipynb files; pass notebooks/ only when it has some, so an empty or
# missing folder is not an error.
NOTEBOOKS := $(if $(wildcard notebooks/*.ipynb),notebooks)

.PHONY: demo test test-fast grade lab clients bench-guidellm clean

demo: $(STAMP)
	$(VENV)/bin/llmlab demo

# Three pytest processes, not one: a single process that held every test's engines and then
# ran the notebooks' kernels beside them outgrew a 24 GiB machine (killed by the OOM killer).
# All three run on two pytest-xdist workers (-n 2: CI's two cores; one torch thread each,
# tests/conftest.py): 28 -> 12 minutes on a 2-core AMD EPYC for the first, 3.6 -> 2.2 for the
# exercises (the latter with other work beside it); the whole of make test took 22 minutes from
# a clean clone with only the first on two workers (CI took 41). The notebooks go with
# tests/notebooks, whose conftest runs each one once (twice in one kernel for a RERUN one): in
# JupyterLab through chromium, Run All from the menu, checked for tracebacks, blank plots,
# overlapping labels and cells silent for 60 s (test_notebooks_in_browser.py; the widgets of
# 04, 06 and 08 clicked there too), or, where chromium is missing, through nbval and the rerun
# test (a notebook's nbval cells stay on one worker). From a clean clone on a 2-core AMD EPYC
# (2026-12-04, three runs): 7.3 + 1.6 + 5.7, 8.4 + 1.7 + 6.3 and 7.2 + 1.7 + 5.9 minutes for the
# three; .ci/run with the install and `make clients` 18.6-20.7. A third worker gains nothing: the first is CPU-bound
# (8.5 minutes with -n 3), the notebooks nearly (5.8 against 6.1).
test: $(STAMP)
	$(VENV)/bin/python -m pytest tests --ignore=tests/exercises --ignore=tests/notebooks -n 2 --durations=25
	$(VENV)/bin/python -m pytest tests/exercises -n 2 --durations=10
	$(VENV)/bin/python -m pytest tests/notebooks --nbval-lax $(NOTEBOOKS) -n 2 --durations=10

# The inner loop: every test not marked `slow` (no Triton interpreter, no processes, none over
# ~5 s on a CPU), every folder of tests/ still has some; no notebooks. `make test` runs them all.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest tests -m "not slow" -n 2

# Grades exercises/ with the same tests that pass on solutions/, each exercise in a process
# of its own: one that crashes (an out-of-bounds read) or hangs shows in the table, the rest
# still grade. `make grade EX="ex06 ex07"` grades only those; it exits 1 until every graded
# exercise passes (`make grade EX=--only-written`: unwritten ones do not count). The capstone
# runs after a full grade, or alone with `make grade EX=capstone`.
grade: $(STAMP)
	$(VENV)/bin/python tests/exercises/grade.py $(EX)

# The clients vLLM's users run, for real, against a live `llmlab serve` on the embedded model
# (tests/server/test_real_clients.py): lm-evaluation-harness and GuideLLM from PyPI, in a venv
# of their own (their own transformers and datasets; the project's dependencies stay free of
# both), offline once installed. CI runs it after `make test` (.ci/run). The venv's torch is the
# project's own pin (the CPU build): unpinned, lm-eval[hf] pulled PyPI's CUDA build, 3.2 GB of
# wheels and a 6.3 GB venv; pinned in the same pip call, a 1.9 GB venv installed in ~1.2 minutes, and the three
# tests take ~1.2 minutes on 2 cores.
CLIENTS_VENV := .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed
TORCH_PIN := $(shell grep -o 'torch==[0-9.]*' pyproject.toml | head -1)

clients: $(STAMP) $(CLIENTS_STAMP)
	LLMLAB_CLIENTS_VENV=$(abspath $(CLIENTS_VENV)) $(VENV)/bin/python -m pytest tests/server/test_real_clients.py -v -s

# GuideLLM and `llmlab bench serving` on one `llmlab serve`, the same workload, side by side
# (BENCHMARKS.md, "Online serving"); `make bench-guidellm ARGS="--max-concurrency 8"` passes flags on.
bench-guidellm: $(STAMP) $(CLIENTS_STAMP)
	$(VENV)/bin/llmlab bench guidellm --clients-venv $(CLIENTS_VENV) $(ARGS)

$(CLIENTS_STAMP): pyproject.toml
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install '$(TORCH_PIN)' 'lm-eval[api,hf]==0.4.13' 'guidellm==0.8.1'
	touch $@

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

# No `pip install --upgrade`: the venv's own pip is enough, and upgrading would fetch more.
# The playwright package comes with [dev]; `playwright install` is never run (it downloads
# browsers, which cannot work offline): tests use Debian's chromium (see .ci/run).
$(STAMP): pyproject.toml requirements-nodeps.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -e '.[dev]'
	$(VENV)/bin/pip install --no-deps -r requirements-nodeps.txt
	@# An editable install made while llmlab/__init__.py is missing keeps llmlab a namespace
	@# package (no llmlab.LLM) for good: leave the stamp off so the next make reinstalls.
	@if [ -f llmlab/__init__.py ]; then touch $@; \
	else echo "note: llmlab/__init__.py missing; will reinstall on the next make"; fi

clean:
	rm -rf $(VENV) $(CLIENTS_VENV)
