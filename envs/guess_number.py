"""guess_number: find a hidden number in 1..1024 from "higher"/"lower" feedback.

A multi-turn env without tools (it answers in `on_reply`). Reward on success: 2 - guesses/10
(binary search needs at most 11 guesses); 0 otherwise.
"""

from __future__ import annotations

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
    demo_bisection: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    """The share of demonstrations that bisect; the others search at random within the open range.
    A warm-start on a mix shows both searches and leaves RL to learn which one earns more, as the
    calculator's warm-start shows answers with and without the tool."""
    limits: Limits = msgspec.field(default_factory=lambda: Limits(max_turns=14, max_total_tokens=2048))


class GuessNumberEnv(Env):
    Args = GuessArgs
    args: GuessArgs

    def __init__(self, args: GuessArgs | None = None) -> None:
        super().__init__(args)
        self.guesses = 0
        self.midpoints = 0
        self.invalid = 0
        self.solved = False
        self.lo, self.hi = 1, self.args.high

    @classmethod
    def tasks(cls, args: GuessArgs, split: Split) -> list[Task]:  # type: ignore[override]
        # The hidden target is the whole task, so both splits draw it from all of 1..high, each from
        # its own random stream. Split by target, held-out games would be another game: a policy
        # trained on the rest learns that the held-out numbers are never the answer.
        rng = random.Random(f"guess_number:{args.high}:{args.seed}:{split}")
        count = args.num_train if split == "train" else args.num_eval
        return [
            Task(id=f"guess-{split}-{args.seed}-{i}", prompt=cls.question(args.high), answer=rng.randint(1, args.high))
            for i in range(count)
        ]

    @staticmethod
    def question(high: int) -> str:
        return f"Guess my number from 1 to {high}. Reply with one number."

    @classmethod
    def demonstration(cls, args: EnvArgs, task: Task) -> list[str]:
        # Mostly random guesses within the bounds the feedback leaves: the warm-start teaches the
        # game's form and leaves RL a better search to find (fewer guesses, more reward).
        assert isinstance(args, GuessArgs)
        rng, target = random.Random(task.id), int(task.answer)
        if rng.random() < args.demo_bisection:
            return binary_search_replies(target, args.high)
        return random_search_replies(target, args.high, rng, args.limits.max_turns)

    async def on_reply(self, message: Message) -> list[Message] | None:
        found = _INT.findall(message.content)
        if not found:
            self.invalid += 1
            return [Message(role="user", content=f"Reply with one number from 1 to {self.args.high}.")]
        self.guesses += 1
        guess, target = int(found[-1]), self.task.answer if self.task else None
        self.midpoints += guess == (self.lo + self.hi) // 2
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
        return reward_for(self.guesses) if self.solved else 0.0

    @metric
    def num_guesses(self) -> float:
        return float(self.guesses)

    @metric
    def found(self) -> float:
        return float(self.solved)

    @metric
    def invalid_replies(self) -> float:
        return float(self.invalid)

    @metric
    def midpoint_share(self) -> float:
        """The share of guesses at the middle of the open range (1 for bisection): which search it plays."""
        return self.midpoints / self.guesses if self.guesses else 0.0


def reward_for(guesses: int) -> float:
    """The reward of a game won in `guesses` guesses (at least 1 up to 10 guesses)."""
    return 2.0 - guesses / 10


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
