"""Grounding of an answer in its request: which of the numbers the request states the answer uses.

A request for code states constants (``retry 3 times``, ``divisible by 7``, ``or -1 if there is
none``), and an answer that leaves one out or brings others of its own is wrong more often than
not, whatever its words look like. Bag-of-n-gram features cannot see this: they score the answer's
terms one by one, never against the request's. These three columns do, for any request and answer:

- **coverage**: the share of the request's distinct numeric literals that appear in the answer
  (1 when the request states none);
- **extra**: the share of the answer's distinct numeric literals that the request does not state
  (0 when the answer holds none);
- **none**: whether the request states no number (coverage then carries nothing).

A numeric literal is a run of digits, with an optional decimal part, that is not part of a word
(``x2`` and ``v1.2.3``-like version strings are not; ``-1`` counts as ``1``, so the sign is
ignored), compared by value (``007`` is ``7``). The reward model weighs the columns by its labels
(:mod:`reward_models.text_model`); they are features, not a verdict.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

NUMBER = re.compile(r"(?<![\w.])(\d+)(?:\.(\d+))?(?!\w)(?!\.\d)")
"""A number that is not part of a word or of a dotted string."""


def literals(text: str) -> frozenset[str]:
    """The distinct numeric literals of ``text``, by value (``"007"`` -> ``"7"``, ``"2.50"`` -> ``"2.5"``)."""
    out = set()
    for whole, fraction in NUMBER.findall(text):
        integer = whole.lstrip("0") or "0"
        decimals = fraction.rstrip("0")
        out.add(f"{integer}.{decimals}" if decimals else integer)
    return frozenset(out)


def grounding(prompts: Sequence[str] | np.ndarray, answers: Sequence[str] | np.ndarray) -> np.ndarray:
    """Per (request, answer) pair: coverage, extra and none (see the module docstring), shape (n, 3)."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} requests and {len(answers)} answers: they must pair up")
    seen: dict[str, frozenset[str]] = {}
    out = np.zeros((len(answers), 3), dtype=np.float64)
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        asked = seen.get(prompt)
        if asked is None:
            asked = seen[prompt] = literals(prompt)
        given = literals(answer)
        out[i, 0] = len(asked & given) / len(asked) if asked else 1.0
        out[i, 1] = len(given - asked) / len(given) if given else 0.0
        out[i, 2] = 0.0 if asked else 1.0
    return out
