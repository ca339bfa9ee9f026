"""Check yourself: the questions that end every notebook, and a checker that says why an answer
is wrong without giving the right one away.

    from llmlab import teach
    answers = {"q1": 32, "q2": None}
    teach.check("09", answers)          # prints one line per question: right, wrong (and why), not answered yet

The questions are asked in the notebook; the right answers live here, one module per notebook
(`tour.py` for 00, ..., `multi_gpu.py` for 14), and most are computed when checked, from the
library itself: the embedded model's config and tokenizer, a notebook's workload replayed on
the simulator (`ground_truth.py`), a kernel's split or tile schedule, a notebook's own experiment
run again (12's H200-scale simulations; 13's measurements on the embedded model, which the
checker loads when one of them is answered). A task ("write a policy key function") is checked
by running what the student wrote. `grade` returns the verdicts
instead of printing them (the tests use it). `data_file` finds the data files the notebooks load.
"""
from llmlab.teach.check import NOTEBOOKS, Verdict, check, grade, questions
from llmlab.teach.data import data_file

__all__ = ["NOTEBOOKS", "Verdict", "check", "data_file", "grade", "questions"]
