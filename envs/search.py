"""search: answer questions about a generated corpus with a BM25 `search(query, k)` tool.

The corpus describes made-up towns (names, regions, rivers, founding years are drawn by seed), so
a model cannot answer from memory: it has to search. Retrieval is BM25 from `bm25s`. Reward:
exact match of the normalised answer (SQuAD's normalisation); token F1 is recorded as a metric
(`reward_kind: f1` trains on it instead). Questions are split by a hash of their text; the
corpus is shared by both splits (it is the knowledge base, not the test).
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
import string
from collections import Counter
from typing import Annotated, Any, Literal

import bm25s
import msgspec

from slime_async.env import Env, EnvArgs, HermesParser, Limits, Split, metric, reward, tool
from slime_async.types import Task, ToolCall

_SYLLABLES = ("var", "hol", "ken", "dra", "mir", "os", "tal", "ber", "lun", "sa", "vik", "ro", "gan", "el", "dor")
_ANSWER = re.compile(r"answer is[:\s]*(.+)", re.IGNORECASE | re.DOTALL)


class SearchArgs(EnvArgs):
    num_docs: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 200
    num_train: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """None: every training question."""
    num_eval: Annotated[int, msgspec.Meta(ge=0)] | None = 100
    reward_kind: Literal["exact", "f1"] = "exact"
    limits: Limits = msgspec.field(default_factory=lambda: Limits(max_turns=4, max_total_tokens=4096))


class SearchEnv(Env):
    Args = SearchArgs
    args: SearchArgs
    system_prompt = "Use the search tool. End with: The answer is X."

    @classmethod
    def tasks(cls, args: SearchArgs, split: Split) -> list[Task]:  # type: ignore[override]
        out = [t for t in _questions(args.seed, args.num_docs) if t.metadata["split"] == split]
        count = args.num_train if split == "train" else args.num_eval
        return out if count is None else out[:count]

    @tool
    def search(
        self, query: Annotated[str, "words to look for"], k: Annotated[int, msgspec.Meta(ge=1, le=10)] = 3
    ) -> str:
        """Search the documents; returns the k best matches."""
        titles, texts, index = _corpus(self.args.seed, self.args.num_docs)
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.vocab:
            return "no results"
        ids, scores = index.retrieve(tokens, k=min(k, len(texts)), show_progress=False)
        hits = [
            f"{n + 1}. {titles[i]}: {texts[i]}" for n, (i, s) in enumerate(zip(ids[0], scores[0], strict=True)) if s > 0
        ]
        return "\n".join(hits) or "no results"

    @reward
    def answer_match(self, completion: str, answer: Any) -> float:
        return exact_match(completion, answer) if self.args.reward_kind == "exact" else f1(completion, answer)

    @metric
    def exact(self, completion: str, answer: Any) -> float:
        return exact_match(completion, answer)

    @metric
    def token_f1(self, completion: str, answer: Any) -> float:
        return f1(completion, answer)


def final_answer(text: str) -> str:
    """What follows "the answer is" in a reply, else the whole reply."""
    m = _ANSWER.search(text)
    return m.group(1) if m else text


def normalize(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def exact_match(completion: str, answer: Any) -> float:
    return float(normalize(final_answer(completion)) == normalize(str(answer)))


def f1(completion: str, answer: Any) -> float:
    pred, gold = normalize(final_answer(completion)).split(), normalize(str(answer)).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def demo_replies(task: Task) -> list[str]:
    """A search for the question's subject, then the answer."""
    call = ToolCall(name="search", arguments={"query": task.metadata["town"]})
    return [HermesParser().format("", [call]), f"The answer is {task.answer}."]


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


@functools.lru_cache(maxsize=4)
def _facts(seed: int, num_docs: int) -> tuple[tuple[str, str, str, int], ...]:
    """(town, region, river, founded) per document; towns are distinct."""
    rng = random.Random(f"search:{seed}")
    regions = [_name(rng) for _ in range(max(3, num_docs // 20))]
    rivers = [_name(rng) for _ in range(max(3, num_docs // 10))]
    towns: dict[str, tuple[str, str, str, int]] = {}
    while len(towns) < num_docs:
        town = _name(rng)
        if town not in towns and town not in regions and town not in rivers:
            towns[town] = (town, rng.choice(regions), rng.choice(rivers), rng.randint(1100, 1950))
    return tuple(towns.values())


@functools.lru_cache(maxsize=4)
def _corpus(seed: int, num_docs: int) -> tuple[list[str], list[str], bm25s.BM25]:
    """Titles, texts and their BM25 index; pure in (seed, num_docs), so memoised (read-only)."""
    facts = _facts(seed, num_docs)
    titles = [town for town, *_ in facts]
    texts = [
        f"{town} is a town in the {region} region. It lies on the river {river}. It was founded in {founded}."
        for town, region, river, founded in facts
    ]
    index = bm25s.BM25()
    index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
    return titles, texts, index


def _questions(seed: int, num_docs: int) -> list[Task]:
    out = []
    for town, region, river, founded in _facts(seed, num_docs):
        for question, answer in (
            (f"In which region is {town}?", region),
            (f"Which river does {town} lie on?", river),
            (f"In which year was {town} founded?", str(founded)),
        ):
            digest = hashlib.sha256(question.encode()).hexdigest()
            split = "eval" if int(digest, 16) % 10 == 0 else "train"
            out.append(Task(id=digest[:16], prompt=question, answer=answer, metadata={"split": split, "town": town}))
    return out
