"""Building envs from the config's `env.name`/`env.args`; group rewards; the verifier process pool."""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import pytest

from slime_async.env import (
    Env,
    EnvArgs,
    EnvFactory,
    EnvLoadError,
    ScriptedPolicy,
    VerifierPool,
    apply_group_rewards,
    group_reward,
    load_env_class,
    reward,
    run_episode,
)
from slime_async.types import StopReason, Task, Trajectory


class CountArgs(EnvArgs):
    n: int = 3


class CountEnv(Env):
    Args = CountArgs

    @classmethod
    def tasks(cls, args: CountArgs, split: str) -> list[Task]:  # type: ignore[override]
        return [Task(id=f"{split}-{args.seed}-{i}", prompt=str(i)) for i in range(args.n)]

    @group_reward(weight=0.5)
    def rank(trajectories: list[Trajectory]) -> list[float]:
        return [float(i) for i in range(len(trajectories))]

    @group_reward(on_error=-1.0)
    def broken(task_id: str) -> list[float]:
        return [1.0]  # wrong length for any group but one


def test_factory_from_config() -> None:
    factory = EnvFactory.from_config(f"{__name__}:CountEnv", {"n": 2, "seed": 7, "limits": {"max_turns": 3}})
    assert factory.args == CountArgs(n=2, seed=7, limits=factory.args.limits)
    assert factory.args.limits.max_turns == 3
    a, b = factory.new(), factory.new()
    assert a is not b and isinstance(a, CountEnv) and a.limits.max_turns == 3
    assert [t.id for t in factory.tasks("eval")] == ["eval-7-0", "eval-7-1"]


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("envs.calculator", {}, "is not 'module:Class'"),
        ("no_such_module_xyz:Env", {}, "cannot import module 'no_such_module_xyz'"),
        (f"{__name__}:Missing", {}, "has no 'Missing'"),
        (f"{__name__}:CountArgs", {}, "is not a subclass of slime_async.env.Env"),
        (f"{__name__}:CountEnv", {"m": 1}, r"env.args: Object contains unknown field `m` .*it takes: n, seed, limits"),
        (f"{__name__}:CountEnv", {"n": "x"}, r"env.args: Expected `int`, got `str` - at `\$.n`"),
        (f"{__name__}:CountEnv", {"limits": {"max_turns": 0}}, r"Expected `int` >= 1 - at `\$.limits.max_turns`"),
    ],
)
def test_bad_config_names_the_place(name: str, args: dict[str, Any], message: str) -> None:
    with pytest.raises(EnvLoadError, match=message):
        EnvFactory.from_config(name, args)


def test_load_env_class() -> None:
    assert load_env_class(f"{__name__}:CountEnv") is CountEnv


def _traj(i: int) -> Trajectory:
    return Trajectory(task_id="t", group_id="g", sample_index=i, turns=[], stop_reason=StopReason.DONE, reward=1.0)


async def test_group_rewards_add_weighted_and_count_failures() -> None:
    group = [_traj(i) for i in range(3)]
    await apply_group_rewards(CountEnv, group)
    assert [t.rewards for t in group] == [{"rank": float(i), "broken": -1.0} for i in range(3)]
    assert [t.reward for t in group] == [1.0 + 0.5 * i - 1.0 for i in range(3)]
    assert all(t.metrics["reward_errors/broken"] == 1 for t in group)
    assert "returned 1 values for 3 trajectories" in group[0].error


# Module-level so that a spawned worker can import them.
def square(x: int) -> int:
    return x * x


def spin() -> None:
    while True:
        time.sleep(0.01)


def crash() -> None:
    raise ValueError("bad verifier")


def pid() -> int:
    return os.getpid()


@pytest.mark.slow
async def test_verifier_pool_runs_off_process_and_kills_on_timeout() -> None:
    with VerifierPool(workers=1) as pool:
        assert await pool.run(square, 7, timeout_s=60) == 49
        assert await pool.run(pid, timeout_s=60) != os.getpid()
        with pytest.raises(TimeoutError, match="ran past"):
            await pool.run(spin, timeout_s=0.2)
        with pytest.raises(ValueError, match="bad verifier"):
            await pool.run(crash, timeout_s=60)
        assert await pool.run(square, 3, timeout_s=60) == 9  # the killed worker was replaced


def test_limits_are_values() -> None:
    from slime_async.env import Limits

    lim = msgspec.convert({"max_turns": 2, "parse_errors": {"penalty": -1}}, Limits)
    assert lim.max_turns == 2 and lim.parse_errors.penalty == -1.0
    with pytest.raises(AttributeError):
        lim.max_turns = 3  # type: ignore[misc]


class VerifiedEnv(Env):
    @reward
    async def heavy(self, answer: Any) -> float:
        return float(await self.verify(square, answer) == 49)

    @reward(on_error=-1.0)
    async def stuck(self) -> float:
        return await self.verify(spin, timeout_s=0.2)

    @reward(on_error=-2.0)
    async def raises(self) -> float:
        return await self.verify(crash)


@pytest.mark.slow
async def test_process_verifiers_in_an_episode_are_counted_not_fatal(tiny_model_dir: Any) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = Task(id="v", prompt="7?", answer=7)
    with VerifierPool(workers=1) as pool:
        traj = await run_episode(VerifiedEnv(), task, ScriptedPolicy(["49"], tokenizer), tokenizer, verifiers=pool)
    assert traj.stop_reason is StopReason.DONE
    assert traj.rewards == {"heavy": 1.0, "stuck": -1.0, "raises": -2.0}
    assert traj.metrics["reward_errors"] == 2
