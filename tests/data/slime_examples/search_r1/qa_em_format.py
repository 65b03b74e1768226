"""Mirrors slime's examples/search-r1/qa_em_format.py (Search-R1's exact-match reward with a format
score), written anew: `compute_score_em(solution_str, ground_truth, format_score)`."""

from __future__ import annotations

import re
import string
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(s: str) -> str:
    s = "".join(c for c in s.lower() if c not in set(string.punctuation))
    return " ".join(w for w in s.split() if w not in ("a", "an", "the"))


def compute_score_em(
    solution_str: str,
    ground_truth: dict[str, Any],
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` when the last <answer> of the assistant's part matches a target exactly (normalised),
    `format_score` when there is an answer that does not, 0 without an assistant part or an answer."""
    marker = re.search(r"<\|im_start\|>assistant\s*", solution_str)
    if marker is None:
        return 0.0
    answers = _ANSWER.findall(solution_str[marker.end() :])
    if not answers:
        return 0.0
    targets = ground_truth["target"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    if normalize_answer(answers[-1]) in {normalize_answer(t) for t in targets}:
        return score
    return format_score
