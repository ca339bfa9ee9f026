"""Exercises: write the pieces of llmlab yourself. Start with exercises/README.md.

Each exNN_*.py file states its task, shapes and hints in its docstring; solutions/ holds
the same files, solved. Grade yours with `make grade`.

Your files may live elsewhere (a checkout you must not edit, a course's shared copy): with
LLMLAB_EXERCISES_DIR=/your/folder set, `exercises.exNN_...` is that folder's exNN_*.py where
it has one, else this folder's, for `make grade`, pytest and `from exercises import ...` alike."""
import os as _os

if _os.environ.get("LLMLAB_EXERCISES_DIR"):   # searched first: your files before the unsolved ones here
    __path__.insert(0, _os.path.abspath(_os.path.expanduser(_os.environ["LLMLAB_EXERCISES_DIR"])))  # noqa: F821
