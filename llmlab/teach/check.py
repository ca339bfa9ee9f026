"""The checker: every notebook's questions, each a function from the student's answer to a
Verdict, and the readers that turn what a student typed (32, "32", 0.11, "11%", "b") into a
value a question can judge.

A question never puts its right answer in its feedback: a wrong answer gets what its mistake
probably was (tokens counted instead of blocks, steps counted from 1) or how to find the
answer, never the answer itself.
"""
from __future__ import annotations

import importlib
import math
import numbers
import textwrap
from dataclasses import dataclass
from typing import Callable

# notebook id -> the module of llmlab/teach/ that holds its questions (named like the notebook)
NOTEBOOKS = {"00": "tour", "01": "tokens_to_logits", "02": "rmsnorm_rope_swiglu", "03": "flash_attention_prefill",
             "04": "paged_kv_cache", "05": "paged_attention", "06": "iteration_level_scheduling",
             "07": "chunked_prefill", "08": "preemption", "09": "prefix_caching", "10": "sampling",
             "11": "serving", "12": "scheduling_policy", "13": "kv_cache_quantization", "14": "multi_gpu"}


@dataclass
class Verdict:
    correct: bool
    feedback: str       # why it is right, or what the mistake probably was: never the right answer


def right(why: str) -> Verdict:
    return Verdict(True, why)


def wrong(why: str) -> Verdict:
    return Verdict(False, why)


class AnswerError(ValueError):
    """The answer has the wrong form (text where a number was asked, a function that raised):
    the checker says so as the question's feedback instead of raising."""


# ---- the checker ---------------------------------------------------------------------------
def notebook_id(notebook) -> str:
    key = f"{int(notebook):02d}" if str(notebook).strip().isdigit() else str(notebook)
    if key not in NOTEBOOKS:
        raise ValueError(f"no notebook {notebook!r}: the notebooks are {', '.join(NOTEBOOKS)}")
    return key


def questions(notebook) -> dict[str, Callable]:
    """A notebook's questions, {"q1": function, ...}; each function's docstring is its question."""
    return importlib.import_module(f"llmlab.teach.{NOTEBOOKS[notebook_id(notebook)]}").QUESTIONS


def grade(notebook, answers: dict) -> dict[str, Verdict | None]:
    """A Verdict per question (None: not answered yet). A key that names no question gets a
    Verdict too, saying which questions there are."""
    asked = questions(notebook)
    verdicts: dict[str, Verdict | None] = {}
    for key, judge in asked.items():
        answer = answers.get(key)
        if answer is None:
            verdicts[key] = None
            continue
        try:
            verdicts[key] = judge(answer)
        except AnswerError as error:
            verdicts[key] = wrong(str(error))
    for key in answers:
        if key not in asked:
            verdicts[key] = wrong(f"notebook {notebook_id(notebook)} has no question {key!r}; "
                                  f"its questions are {', '.join(asked)}")
    return verdicts


def check(notebook, answers: dict) -> None:
    """Print one line per question: right (and why), not yet right (and what the mistake
    probably was), or not answered yet. Never raises for an answer, however wrong its form."""
    if not isinstance(answers, dict):
        print(f'answers should be a dict, {{"q1": ..., "q2": ...}}; got {type(answers).__name__}')
        return
    verdicts = grade(notebook, answers)
    print(f"Check yourself, notebook {notebook_id(notebook)}:")
    for key, verdict in verdicts.items():
        line = (f"{key}: not answered yet" if verdict is None else
                f"{key}: {'right' if verdict.correct else 'not yet'} - {verdict.feedback}")
        print(textwrap.fill(line, width=100, initial_indent="  ", subsequent_indent="      "))
    asked = [verdicts[key] for key in questions(notebook)]
    num_right = sum(v is not None and v.correct for v in asked)
    unanswered = sum(v is None for v in asked)
    print(f"{num_right} of {len(asked)} right" + (f", {unanswered} not answered yet" if unanswered else "")
          + (". Well done." if num_right == len(asked) else "."))


# ---- reading answers -------------------------------------------------------------------------
def number(answer, what: str = "a number") -> float:
    """A number from an int, a float, a one-element tensor or array, or a string ("0.5")."""
    if isinstance(answer, bool):
        raise AnswerError(f"expected {what}, got {answer!r}")
    if hasattr(answer, "item") and not isinstance(answer, str):   # a tensor or array of one element
        try:
            answer = answer.item()
        except (ValueError, RuntimeError):
            raise AnswerError(f"expected {what}, got several values") from None
    if isinstance(answer, str):
        try:
            answer = float(answer.strip().replace(",", "").removesuffix("%")) / (100 if "%" in answer else 1)
        except ValueError:
            raise AnswerError(f"expected {what}, got the text {answer!r}") from None
    if not isinstance(answer, numbers.Real) or math.isnan(answer):
        raise AnswerError(f"expected {what}, got {answer!r}")
    return float(answer)


def integer(answer, what: str = "a whole number") -> int:
    value = number(answer, what)
    if value != int(value):
        raise AnswerError(f"expected {what}, got {answer!r}")
    return int(value)


def fraction(answer) -> float:
    """A fraction from 0.11, "0.11", "11%" or 11 (read as a percentage when above 1)."""
    value = number(answer, "a fraction (0.25) or a percentage (25 or '25%')")
    return value / 100 if value > 1 else value


def choice(answer, options: str) -> str:
    """One letter of a multiple-choice question ("b", "B", "(b)")."""
    letter = str(answer).strip().strip("()").lower()
    if len(letter) != 1 or letter not in options:
        raise AnswerError(f"answer with one letter of {', '.join(options)}; got {answer!r}")
    return letter


def text(answer) -> str:
    if not isinstance(answer, str):
        raise AnswerError(f"expected text in quotes, got {answer!r}")
    return answer


def integers(answer, what: str = "a tuple of whole numbers, e.g. (3, 2)") -> tuple[int, ...]:
    if isinstance(answer, (str, bytes)) or not hasattr(answer, "__iter__"):
        raise AnswerError(f"expected {what}, got {answer!r}")
    return tuple(integer(value, what) for value in answer)


def close(value: float, expected: float, tolerance: float) -> bool:
    return abs(value - expected) <= tolerance


def run_student_code(function, *args):
    """Call what the student wrote; an error in it becomes feedback, not a traceback."""
    if not callable(function):
        raise AnswerError(f"expected a function, got {function!r}")
    try:
        return function(*args)
    except Exception as error:   # noqa: BLE001 -- any mistake in the student's code is reported
        raise AnswerError(f"your function raised {type(error).__name__}: {error}") from None
