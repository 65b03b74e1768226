"""The guard: a run that cannot learn is stopped (or warned about), with the reason and the first error.

Two rules, each a pure function of the finished groups in order (`rollout.guard` sets them):
- failures: more than `max_failed_fraction` of the latest `window` episodes failed (ended in
  `env_error`, or a reward raised and scored its `on_error`): the run trains on a broken reward;
- no signal: the groups of `no_signal_steps` steps in a row each had equal rewards, so every GRPO
  advantage is 0 and the loss and gradient are 0 (or, with `filter_equal_rewards`, every group is
  dropped and the trainer waits).
A verdict is given once per rule; the scheduler stops (`slime-async rollout`) or the launcher ends
the run (`slime-async train`) on a `stop` verdict.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass

from slime_async.config.schema import GuardConfig
from slime_async.types import StopReason, Trajectory


@dataclass(frozen=True)
class Verdict:
    rule: str
    """`failures` or `no_signal`."""
    action: str
    """`stop` or `warn`."""
    reason: str
    """What was seen, in words, with the setting that decides it."""
    first_error: str
    """The first error message of a failed episode ('' for no signal without errors)."""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def failed(t: Trajectory) -> bool:
    """An episode the env's own code failed: `env_error`, or a reward (or group reward) that raised."""
    return t.stop_reason is StopReason.ENV_ERROR or t.metrics.get("reward_errors", 0.0) > 0


class Guard:
    """Watches finished groups; `observe` returns a verdict the first time a rule trips."""

    def __init__(self, cfg: GuardConfig, groups_per_step: int) -> None:
        self.cfg = cfg
        self.recent: deque[bool] = deque(maxlen=cfg.window)
        self.no_signal_groups = max(1, cfg.no_signal_steps * groups_per_step)
        """Groups in a row without signal before the rule trips."""
        self.streak = 0
        self.first_error = ""
        self.verdicts: list[Verdict] = []

    @classmethod
    def for_rollout(cls, cfg: GuardConfig, batch_size: int, group_size: int) -> Guard:
        """`batch_size` trajectories per step (this worker's share), in groups of `group_size`."""
        return cls(cfg, math.ceil(batch_size / group_size))

    def observe(self, group: list[Trajectory], trainable: bool) -> Verdict | None:
        """One finished group; `trainable`: it was not dropped for a failure (a server or env error)."""
        for t in group:
            bad = failed(t)
            self.recent.append(bad)
            if bad and not self.first_error:
                self.first_error = t.error or next(iter(t.errors.values()), "")
        verdict = self._failures()
        if trainable and len(group) > 1:
            self.streak = self.streak + 1 if len({t.reward for t in group}) == 1 else 0
            verdict = verdict or self._no_signal(group)
        if verdict is not None:
            self.verdicts.append(verdict)
        return verdict

    def _given(self, rule: str) -> bool:
        return any(v.rule == rule for v in self.verdicts)

    def _failures(self) -> Verdict | None:
        c = self.cfg
        if c.on_failures == "off" or self._given("failures") or len(self.recent) < c.window:
            return None
        share = sum(self.recent) / len(self.recent)
        if share <= c.max_failed_fraction:
            return None
        reason = (
            f"{sum(self.recent)} of the latest {len(self.recent)} episodes failed (rewards that raise, or "
            f"env errors; over rollout.guard.max_failed_fraction={c.max_failed_fraction:g})"
        )
        return Verdict("failures", c.on_failures, reason, self.first_error)

    def _no_signal(self, group: list[Trajectory]) -> Verdict | None:
        c = self.cfg
        if c.on_no_signal == "off" or self._given("no_signal") or self.streak < self.no_signal_groups:
            return None
        reward = group[0].reward
        reason = (
            f"no learning signal: the latest {self.streak} groups ({c.no_signal_steps} steps' worth, "
            f"rollout.guard.no_signal_steps) each had equal rewards (now all {reward:g}), so every "
            "advantage is 0: a model that never (or always) succeeds; a warm-start, an easier task or a "
            "graded reward gives it something to learn"
        )
        return Verdict("no_signal", c.on_no_signal, reason, self.first_error)
