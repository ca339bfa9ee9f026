"""llmlab.teach's checker: answers read in every form a student types them, unanswered questions
reported as such, and no answer, however malformed, makes it raise."""
import pytest
import torch

from llmlab import teach
from llmlab.teach.check import AnswerError, choice, fraction, integer, integers, number


def test_readers_take_what_a_student_types():
    assert number("0.5") == number(0.5) == number(torch.tensor(0.5)) == number(torch.tensor([0.5])) == 0.5
    assert integer(3.0) == integer("3") == integer(torch.tensor(3)) == 3
    assert fraction(0.11) == fraction("11%") == pytest.approx(fraction(11)) == pytest.approx(0.11)
    assert choice("B", "abc") == choice("(b)", "abc") == "b"
    assert integers((4, 7)) == integers([4, 7.0]) == (4, 7)


@pytest.mark.parametrize("reader, answer", [(number, "two"), (number, True), (number, [1, 2]),
                                            (number, torch.ones(3)), (integer, 2.5), (choice, "e"),
                                            (integers, "4, 7")])
def test_readers_refuse_with_a_sentence(reader, answer):
    with pytest.raises(AnswerError, match="expected|answer with"):
        reader(answer, "abcd") if reader is choice else reader(answer)


def test_unanswered_questions_are_reported_and_nothing_raises(capsys):
    for notebook in teach.NOTEBOOKS:
        questions = teach.questions(notebook)
        assert 2 <= len(questions) <= 6 and all(q.__doc__ for q in questions.values()), notebook
        teach.check(notebook, {key: None for key in questions})
        printed = capsys.readouterr().out
        assert printed.count("not answered yet") == len(questions) + 1, printed   # each, and the summary
        assert teach.grade(notebook, {}) == {key: None for key in questions}


def test_a_key_that_names_no_question_says_which_there_are():
    verdicts = teach.grade("09", {"Q1": 32})
    assert verdicts["q1"] is None and not verdicts["Q1"].correct
    assert "q1, q2, q3" in verdicts["Q1"].feedback


def test_notebook_ids_in_any_spelling_and_an_unknown_one_refused():
    assert teach.questions(9) is teach.questions("09") is teach.questions("9")
    with pytest.raises(ValueError, match="no notebook"):
        teach.questions("15")


JUNK = ["abc", [1, 2], {}, object(), -1, 10**9, 0.5, lambda: 0]


@pytest.mark.parametrize("notebook", [pytest.param(n, marks=pytest.mark.slow) if n == "13" else n   # 13 runs the model
                                      for n in teach.NOTEBOOKS])
def test_no_answer_makes_the_checker_raise(notebook):
    """A student's answer of the wrong form, or a wrong number, is a wrong Verdict with feedback."""
    for key in teach.questions(notebook):
        for answer in JUNK:
            verdict = teach.grade(notebook, {key: answer})[key]
            assert verdict is not None and verdict.feedback, (notebook, key, answer)
            assert not verdict.correct, (notebook, key, answer)


def test_check_prints_right_wrong_and_a_summary(capsys):
    teach.check("10", {"q1": 2, "q2": 2})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "Check yourself, notebook 10:"
    lines = [line for line in printed if line.startswith("  q")]      # feedback wraps onto indented lines
    assert lines[0].startswith("  q1: right - ") and lines[1].startswith("  q2: not yet - ")
    assert lines[2] == "  q3: not answered yet"
    assert printed[-1] == "1 of 4 right, 2 not answered yet."


def test_answers_that_are_not_a_dict_are_refused_in_words(capsys):
    teach.check("03", [1, 2, 3])
    assert "answers should be a dict" in capsys.readouterr().out
