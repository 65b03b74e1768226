"""The verifiers of data-only tasks, as pure functions."""

from __future__ import annotations

import pytest

from envs.verifiers import extract_answer, f1, last_boxed, math_equal, score


@pytest.mark.parametrize(("reply", "label", "expected"), [
    ("so the result is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The answer is $\\frac{2}{4}$", "\\frac{1}{2}", 1.0),
    ("x = \\boxed{3}", "4", 0.0),
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),
    ("no number here", "7", 0.0),
])  # fmt: skip
def test_math_equivalence(reply: str, label: str, expected: float) -> None:
    assert math_equal(reply, label) == expected


def test_extraction_prefers_boxed_then_answer_is_then_pattern() -> None:
    assert last_boxed("a \\boxed{1} b \\boxed{x^{2}}") == "x^{2}"
    assert extract_answer("I think. The answer is Paris.") == "Paris"
    assert extract_answer("final: 42; final: 43", r"final: (\d+)") == "43"
    assert extract_answer("nothing", r"final: (\d+)") == ""


def test_exact_regex_f1_and_lists_of_labels() -> None:
    assert score("exact", "The answer is the Eiffel Tower!", "eiffel tower") == 1.0
    assert score("exact", "The answer is Paris", ["London", "paris"]) == 1.0
    assert score("exact", "The answer is Rome", "Paris") == 0.0
    assert score("regex", "The answer is 2024-01-05.", r"\d{4}-\d{2}-\d{2}") == 1.0
    assert score("regex", "The answer is soon", r"\d+") == 0.0
    assert f1("new york city", "new york") == pytest.approx(0.8)
    assert score("math", "The answer is \\boxed{10}", 10) == 1.0


def test_bad_labels_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="no label"):
        score("exact", "x", None)
    with pytest.raises(ValueError, match="not a regular expression"):
        score("regex", "x", "(")
