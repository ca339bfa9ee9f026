"""Exercises: write the pieces of llmlab yourself. Start with exercises/README.md.

Each exNN_*.py file states its task, shapes and hints in its docstring; solutions/ holds
the same files, solved. Grade yours with `make grade`."""
