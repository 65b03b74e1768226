"""guess_number: find a hidden number in 1..1024 from "higher"/"lower" feedback.

A multi-turn env without tools (it answers in `on_reply`). Reward on success: 2 - guesses/10
(binary search needs at most 11 guesses); 0 otherwise.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Annotated

import msgspec

from slime_async.env import Env, EnvArgs, Limits, Split, metric, reward
from slime_async.types import Message, Task

_INT = re.compile(r"-?\d+")


class GuessArgs(EnvArgs):
    high: Annotated[int, msgspec.Meta(ge=2)] = 1024
    """Targets are 1..high."""
    num_train: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    num_eval: Annotated[int, msgspec.Meta(ge=0)] = 100
    say_bounds: bool = False
    """Each reply also names the range still open ("Higher. From 33 to 64."): the player needs no
    memory of earlier replies, only to choose well within two numbers (a tiny model cannot yet
    track the bounds over many turns; it can learn to pick near the middle)."""
    limits: Limits = msgspec.field(default_factory=lambda: Limits(max_turns=14, max_total_tokens=2048))


class GuessNumberEnv(Env):
    Args = GuessArgs
    args: GuessArgs

    def __init__(self, args: GuessArgs | None = None) -> None:
        super().__init__(args)
        self.guesses = 0
        self.invalid = 0
        self.solved = False
        self.lo, self.hi = 1, self.args.high

    @classmethod
    def tasks(cls, args: GuessArgs, split: Split) -> list[Task]:  # type: ignore[override]
        # A target belongs to one split for good (a hash of it), so eval targets are never trained on.
        targets = [n for n in range(1, args.high + 1) if _split_of(n) == split]
        rng = random.Random(f"guess_number:{args.high}:{args.seed}:{split}")
        count = args.num_train if split == "train" else args.num_eval
        return [
            Task(id=f"guess-{split}-{args.seed}-{i}", prompt=cls.question(args.high), answer=rng.choice(targets))
            for i in range(count)
        ]

    @staticmethod
    def question(high: int) -> str:
        return f"Guess my number from 1 to {high}. Reply with one number."

    @classmethod
    def demonstration(cls, args: EnvArgs, task: Task) -> list[str]:
        # Random guesses within the bounds the feedback leaves, not binary search: the warm-start
        # teaches the game's form and leaves RL a better search to find (fewer guesses, more reward).
        assert isinstance(args, GuessArgs)
        return random_search_replies(int(task.answer), args.high, random.Random(task.id), args.limits.max_turns)

    async def on_reply(self, message: Message) -> list[Message] | None:
        found = _INT.findall(message.content)
        if not found:
            self.invalid += 1
            return [Message(role="user", content=f"Reply with one number from 1 to {self.args.high}.")]
        self.guesses += 1
        guess, target = int(found[-1]), self.task.answer if self.task else None
        if guess == target:
            self.solved = True
            return None
        higher = guess < target  # type: ignore[operator]
        # a guess outside the open range leaves it as it was (and has cost a guess)
        self.lo, self.hi = (max(self.lo, guess + 1), self.hi) if higher else (self.lo, min(self.hi, guess - 1))
        said = "Higher." if higher else "Lower."
        return [Message(role="user", content=f"{said} From {self.lo} to {self.hi}." if self.args.say_bounds else said)]

    @reward
    def win(self) -> float:
        return 2.0 - self.guesses / 10 if self.solved else 0.0

    @metric
    def num_guesses(self) -> float:
        return float(self.guesses)

    @metric
    def found(self) -> float:
        return float(self.solved)

    @metric
    def invalid_replies(self) -> float:
        return float(self.invalid)


def binary_search_replies(target: int, high: int = 1024) -> list[str]:
    """The replies of a binary search for `target` (the last one is `target`)."""
    lo, hi, out = 1, high, []
    while True:
        mid = (lo + hi) // 2
        out.append(str(mid))
        if mid == target:
            return out
        lo, hi = (mid + 1, hi) if mid < target else (lo, mid - 1)


def random_search_replies(target: int, high: int, rng: random.Random, max_guesses: int | None = None) -> list[str]:
    """Uniform guesses within the bounds that "higher"/"lower" leave, until `target` (about 2 ln(high) guesses).

    With `max_guesses`, the search bisects once the guesses left are just enough for bisection, so
    that it always wins in time (random search over 1..1024 needs about 12 guesses, often more than 14).
    """
    lo, hi, out = 1, high, []
    while True:
        must_bisect = max_guesses is not None and max_guesses - len(out) <= (hi - lo + 1).bit_length()
        guess = (lo + hi) // 2 if must_bisect else rng.randint(lo, hi)
        out.append(str(guess))
        if guess == target:
            return out
        lo, hi = (guess + 1, hi) if guess < target else (lo, guess - 1)


def _split_of(n: int) -> Split:
    return "eval" if int(hashlib.sha256(f"guess:{n}".encode()).hexdigest(), 16) % 10 == 0 else "train"
