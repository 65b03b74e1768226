"""Verifiers for data-only tasks: pure functions `(reply, label) -> score in [0, 1]`, chosen by name in config.

- `math`: answer equivalence with `math-verify` (LaTeX, fractions, sets, intervals; it finds the
  answer in the reply itself, `\\boxed{}` first);
- `exact`: SQuAD-normalised exact match (case, punctuation, articles, spaces ignored);
- `regex`: the label is a regular expression that the extracted answer must match in full;
- `f1`: SQuAD token F1.
A label may be a list of acceptable answers: the best score counts. They are module-level functions
so that `Env.verify` can run them in its process pool (math parsing can take long on odd input).
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

VerifierName = Literal["math", "exact", "regex", "f1"]
_ANSWER_IS = re.compile(r"answer is[:\s]*(.+?)\s*\.?\s*$", re.IGNORECASE | re.DOTALL)
_PUNCT = set(string.punctuation)


def extract_answer(reply: str, pattern: str | None = None) -> str:
    """The answer part of a reply: the last match of `pattern` (its first group, if it has one);
    without a pattern, the last `\\boxed{...}`, else what follows "the answer is", else the whole reply."""
    if pattern is not None:
        matches = list(re.finditer(pattern, reply, re.DOTALL))
        if not matches:
            return ""
        last = matches[-1]
        return (last.group(1) if last.groups() else last.group(0)).strip()
    boxed = last_boxed(reply)
    if boxed is not None:
        return boxed
    m = _ANSWER_IS.search(reply)
    return (m.group(1) if m else reply).strip()


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def normalize(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in _PUNCT)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def exact(answer: str, label: str) -> float:
    return float(normalize(answer) == normalize(label))


def f1(answer: str, label: str) -> float:
    pred, gold = normalize(answer).split(), normalize(label).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def regex(answer: str, label: str) -> float:
    try:
        return float(re.fullmatch(label, answer.strip(), re.DOTALL | re.IGNORECASE) is not None)
    except re.error as exc:
        raise ValueError(f"label {label!r} is not a regular expression: {exc}") from None


def _not_timeout_notice(record: logging.LogRecord) -> bool:
    return "Timeout is disabled" not in record.getMessage()


def math_equal(reply: str, label: str) -> float:
    """`math-verify`: the label is parsed as LaTeX or a plain expression, the reply searched for its
    answer. Its own signal-based timeouts are off (they need the main thread): `Env.verify` bounds it."""
    from math_verify import parse, verify

    # math-verify warns on every call that its timeouts are off; here that is on purpose (see above).
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _not_timeout_notice not in logger.filters:
            logger.addFilter(_not_timeout_notice)

    gold_text = label if ("$" in label or "\\boxed" in label) else f"${label}$"
    gold = parse(gold_text, parsing_timeout=None)  # type: ignore[arg-type]
    pred = parse(reply, parsing_timeout=None)  # type: ignore[arg-type]
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))  # type: ignore[arg-type]


def score(verifier: VerifierName, reply: str, label: Any, pattern: str | None = None) -> float:
    """The score of `reply` against `label` (or the best over a list of labels)."""
    labels = label if isinstance(label, list) else [label]
    if not labels or any(x is None for x in labels):
        raise ValueError("the task has no label to verify against (label_key)")
    if verifier == "math":
        # math-verify finds the answer in the reply itself; a pattern narrows where it looks.
        text = extract_answer(reply, pattern) if pattern is not None else reply
        return max(math_equal(text, str(x)) for x in labels)
    fn: Callable[[str, str], float] = {"exact": exact, "regex": regex, "f1": f1}[verifier]
    answer = extract_answer(reply, pattern)
    return max(fn(answer, str(x)) for x in labels)
