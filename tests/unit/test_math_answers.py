"""Competition-math answers: the last box of a solution, and two answers that write one value
in different LaTeX count as the same; different values, or orders, do not."""

import pytest

from rlctl.math_answers import last_boxed, normalized, same_answer
from rlctl.rewards import BUILTINS


@pytest.mark.parametrize("text,boxed", [
    ("so \\boxed{\\frac{\\sqrt{3}}{2}} and at last \\boxed{7}.", "7"),  # the last box
    ("$\\boxed{\\frac{\\sqrt{3}}{2}}$", "\\frac{\\sqrt{3}}{2}"),  # nested braces
    ("the answer is $\\boxed 5$", "5"),
    ("\\fbox{3}", "3"),
    ("\\boxed{never closed", None),
    ("no box: 1/2", None),
])
def test_the_answer_is_the_content_of_the_last_box(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize("given,expected", [
    ("\\frac12", "\\frac{1}{2}"), ("\\dfrac{3}{4}", "3/4"), ("\\frac1{2}", "1/2"), ("-\\frac{1}{3}", "-1/3"),
    ("0.5", "\\frac{1}{2}"), (".5", "0.5"), ("3.0", "3"), ("42.", "42"), ("1,000", "1000"),
    ("10\\%", "10"), ("90^\\circ", "90"), ("\\$18", "18"), ("5 \\text{ cm}", "5"),
    ("x = 3", "3"), ("k=-2", "-2"), ("\\left( 1, 2 \\right)", "(1,2)"),
    ("\\sqrt2", "\\sqrt{2}"), ("\\frac{\\sqrt{3}}{2}", "\\tfrac{\\sqrt3}{2}"), ("\\text{(A)}", "(A)"),
])
def test_one_value_written_two_ways_is_the_same_answer(given, expected):
    assert same_answer(given, expected), (normalized(given), normalized(expected))


@pytest.mark.parametrize("given,expected", [
    ("2", "3"), ("(1,2)", "(2,1)"), ("\\frac{1}{2}", "\\frac{1}{3}"), ("x^2=4", "4"), ("1,2", "12"), ("", "0"), ("\\frac{1}{0}", "0"),
])
def test_different_values_are_different_answers(given, expected):
    assert not same_answer(given, expected)


def test_the_math_reward_compares_the_last_box_with_the_ground_truth_or_its_box():
    math = BUILTINS.get("math")
    responses = ["so \\boxed{\\dfrac12}", "1/2 without a box", "\\boxed{3}", "\\boxed{0.5}", "\\boxed{2}"]
    truths = ["The answer is \\boxed{\\frac{1}{2}}.", "1/2", "4", "\\frac{1}{2}", None]  # a MATH solution gives its box
    assert math(responses=responses, ground_truths=truths) == [1.0, 0.0, 0.0, 1.0, 0.0]
