"""The answer's grounding in its request: numbers are read by value, never from inside a word, and
the three columns say which of the request's numbers the answer uses and which it brings."""

from __future__ import annotations

import numpy as np
import pytest

from reward_models.literals import grounding, literals


def test_numbers_are_read_by_value_and_never_from_a_word() -> None:
    assert literals("return x times 3, then plus 8.") == {"3", "8"}
    assert literals("max((x for x in xs if x % 5 == 0), default=-1)") == {"5", "0", "1"}
    assert literals("007 and 2.50 and 3.14 and range(10)") == {"7", "2.5", "3.14", "10"}
    # Identifiers, versions, exponents and hex are not numbers the request states.
    assert literals("x2 = v1.2.3 + 1e5 + 0x1F + name_12") == set()
    assert literals("") == set()


def test_the_columns_say_which_numbers_the_answer_uses_and_which_it_brings() -> None:
    prompts = ["# return x plus 5 plus 6", "# return x plus 5 plus 6", "# sort xs", "# sort xs"]
    answers = ["return x + 5 + 6", "return x + 5 - 1", "return sorted(xs)", "return sorted(xs)[:3]"]
    got = grounding(prompts, answers)
    assert got.tolist() == [
        [1.0, 0.0, 0.0],  # both numbers, nothing else
        [0.5, 0.5, 0.0],  # one of two; 1 is its own
        [1.0, 0.0, 1.0],  # nothing asked, nothing brought
        [1.0, 1.0, 1.0],  # nothing asked; 3 is its own
    ]
    with pytest.raises(ValueError, match="pair up"):
        grounding(prompts, answers[:2])
    assert grounding([], []).shape == (0, 3)


def test_a_huge_hostile_text_is_read_in_linear_time() -> None:
    text = "1." * 50_000 + "x" * 50_000 + "9" * 50_000
    got = grounding([text], [text])
    assert np.isfinite(got).all() and got[0, 0] == 1.0
