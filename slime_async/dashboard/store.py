"""The run's trajectory store: every trained trajectory, indexed, in `<run dir>/trajectories.sqlite`.

The trainer appends each step's batch (`TrajectoryWriter`); the dashboard reads it while the run
goes and long after (`TrajectoryStore`). SQLite in WAL mode: one writer and any number of readers at
once, pages and indexes for free, one file that a finished run keeps. A row holds what a filter or a
list needs (step, reward, advantage, stop reason, env, task, versions, sizes, the conversation as
text for search) and the trajectory itself as its wire frame (`types.codec`), decoded only when one
is opened. Token texts are kept once per token id (`pieces`), so a run opens without its tokenizer.

A trainer that goes back to a checkpoint re-trains the steps after it: `roll_back` drops their rows,
as `metrics.jsonl` drops their lines.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from slime_async.types import Trajectory, from_msgpack, to_msgpack

STORE_FILE = "trajectories.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS trajectories (
    id TEXT PRIMARY KEY,
    step INTEGER NOT NULL,          -- the trainer's version after the step that trained it
    time REAL NOT NULL,             -- when that step ended (unix seconds)
    group_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    sample_index INTEGER NOT NULL,
    env TEXT NOT NULL,
    reward REAL NOT NULL,
    advantage REAL NOT NULL,
    stop_reason TEXT NOT NULL,
    min_version INTEGER,
    max_version INTEGER,
    tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    turns INTEGER NOT NULL,
    text TEXT NOT NULL,             -- every turn's text, for search
    texts BLOB NOT NULL,            -- msgpack [[prompt text, completion text], ...] per turn
    frame BLOB NOT NULL             -- the Trajectory's msgpack frame (slime_async.types.codec)
);
CREATE INDEX IF NOT EXISTS by_step ON trajectories (step);
CREATE INDEX IF NOT EXISTS by_reward ON trajectories (reward);
CREATE INDEX IF NOT EXISTS by_stop ON trajectories (stop_reason, step);
CREATE INDEX IF NOT EXISTS by_env ON trajectories (env, step);
CREATE INDEX IF NOT EXISTS by_task ON trajectories (task_id);
CREATE INDEX IF NOT EXISTS by_group ON trajectories (group_id);
CREATE TABLE IF NOT EXISTS pieces (token INTEGER PRIMARY KEY, text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS staleness (
    step INTEGER NOT NULL, staleness INTEGER NOT NULL, tokens INTEGER NOT NULL,
    PRIMARY KEY (step, staleness)
);  -- trained completion tokens of each step by (trainer version before the step - token version)
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

SORTS = {"step": "step DESC, rowid DESC", "-step": "step ASC, rowid ASC", "reward": "reward DESC, rowid DESC",
         "-reward": "reward ASC, rowid ASC", "advantage": "advantage DESC, rowid DESC",
         "-advantage": "advantage ASC, rowid ASC"}
"""What a list can be sorted by: a name, or a leading `-` for ascending."""

_LIST_COLUMNS = ("id, step, time, group_id, task_id, sample_index, env, reward, advantage, stop_reason, "
                 "min_version, max_version, tokens, completion_tokens, turns")


def _without_routes(traj: Trajectory) -> Trajectory:
    """The trajectory without its MoE routing records: they are the trainer's (layers x top_k ids per
    token: a real MoE's dwarf its tokens), and nothing here shows them."""
    if all(t.routed_experts is None for t in traj.turns):
        return traj
    return msgspec.structs.replace(traj, turns=[msgspec.structs.replace(t, routed_experts=None) for t in traj.turns])


class StoreError(ValueError):
    """A store that cannot be read, or a query it cannot answer; the message names the place."""


@dataclass(frozen=True)
class Filters:
    """Which trajectories a list shows. None: no condition."""

    step_min: int | None = None
    step_max: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    stop_reason: str | None = None
    env: str | None = None
    task_id: str | None = None
    group_id: str | None = None
    text: str | None = None
    """A substring of the conversation (case-insensitive for ASCII)."""

    def where(self) -> tuple[str, list[Any]]:
        """The SQL condition and its parameters."""
        terms: list[str] = []
        args: list[Any] = []
        for column, op, value in (("step", ">=", self.step_min), ("step", "<=", self.step_max),
                                  ("reward", ">=", self.reward_min), ("reward", "<=", self.reward_max),
                                  ("stop_reason", "=", self.stop_reason), ("env", "=", self.env),
                                  ("task_id", "=", self.task_id), ("group_id", "=", self.group_id)):
            if value is not None and value != "":
                terms.append(f"{column} {op} ?")
                args.append(value)
        if self.text:
            terms.append("instr(lower(text), lower(?)) > 0")
            args.append(self.text)
        return (" AND ".join(terms) or "1"), args


def _connect(path: Path, readonly: bool) -> sqlite3.Connection:
    if readonly:
        # read-only, but still through the WAL: a reader sees each step the moment it is committed
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False, timeout=10)
    else:
        conn = sqlite3.connect(path, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")  # readers never block the trainer, nor it them
        conn.execute("PRAGMA synchronous=NORMAL")  # a power cut may lose the last step's rows, never the file
    conn.row_factory = sqlite3.Row
    return conn


class TrajectoryWriter:
    """Appends trained batches to the store (the trainer's side). Use from one thread at a time."""

    def __init__(self, run_dir: Path, tokenizer: Any, advantage: str = "grpo") -> None:
        self.path = Path(run_dir) / STORE_FILE
        self.tokenizer = tokenizer
        self.conn = _connect(self.path, readonly=False)
        self.conn.executescript(_SCHEMA)
        self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('advantage', ?)", (advantage,))
        self.conn.commit()
        self.advantage = advantage
        self._known = {int(r[0]) for r in self.conn.execute("SELECT token FROM pieces")}

    def append(self, step: int, trajectories: Sequence[Trajectory], advantages: Sequence[float],
               trained_from: int | None = None) -> None:
        """The trajectories that the step ending at version `step` trained, with the advantage of each.
        `trained_from`: the weights' version the step started from (default `step - 1`), for staleness."""
        now = time.time()
        before = step - 1 if trained_from is None else trained_from
        rows = []
        stale: dict[int, int] = {}
        new_ids: set[int] = set()
        for traj, adv in zip(trajectories, advantages, strict=True):
            texts = [[self._decode(t.prompt_ids), self._decode(t.completion_ids)] for t in traj.turns]
            for t in traj.turns:
                new_ids.update(int(i) for i in t.prompt_ids)
                new_ids.update(int(i) for i in t.completion_ids)
                for v, m in zip(t.versions.tolist(), t.loss_mask.tolist(), strict=True):
                    if m:
                        stale[before - v] = stale.get(before - v, 0) + 1
            versions = [v for t in traj.turns for v in t.versions.tolist()]
            rows.append((traj.id, step, now, traj.group_id, traj.task_id, traj.sample_index, traj.env,
                         float(traj.reward), float(adv), traj.stop_reason.value,
                         min(versions) if versions else None, max(versions) if versions else None,
                         traj.num_tokens, traj.num_completion_tokens, len(traj.turns),
                         "\n".join(p + c for p, c in texts), msgspec.msgpack.encode(texts),
                         to_msgpack(_without_routes(traj))))
        new_ids -= self._known
        with self.conn:  # one transaction per step: a reader sees a step whole or not at all
            self.conn.executemany(f"INSERT OR REPLACE INTO trajectories VALUES ({','.join('?' * 18)})", rows)
            self.conn.executemany("INSERT OR REPLACE INTO pieces VALUES (?, ?)",
                                  [(i, self._decode([i])) for i in sorted(new_ids)])
            self.conn.executemany(
                "INSERT INTO staleness VALUES (?, ?, ?) ON CONFLICT (step, staleness) "
                "DO UPDATE SET tokens = tokens + excluded.tokens", [(step, s, n) for s, n in stale.items()])
        self._known |= new_ids

    def roll_back(self, version: int) -> int:
        """Drop what steps after `version` trained (they are trained again); returns the rows dropped."""
        with self.conn:
            n = self.conn.execute("DELETE FROM trajectories WHERE step > ?", (version,)).rowcount
            self.conn.execute("DELETE FROM staleness WHERE step > ?", (version,))
        return n

    def _decode(self, ids: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def close(self) -> None:
        self.conn.close()


class TrajectoryStore:
    """Reads a run's store (the dashboard's side); safe while the trainer writes. One per thread."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / STORE_FILE
        self._conn: sqlite3.Connection | None = None

    @property
    def exists(self) -> bool:
        return self.path.exists()

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            if not self.path.exists():
                raise StoreError(f"{self.path}: no trajectory store (a run from before the dashboard, or no step "
                                 "trained yet)")
            try:
                self._conn = _connect(self.path, readonly=True)
                self._conn.execute("SELECT 1 FROM trajectories LIMIT 1")
            except sqlite3.DatabaseError as exc:
                self._conn = None
                raise StoreError(f"{self.path}: not a trajectory store ({exc}); move it aside") from None
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def count(self, filters: Filters = Filters()) -> int:
        where, args = filters.where()
        return int(self._db().execute(f"SELECT count(*) FROM trajectories WHERE {where}", args).fetchone()[0])

    def page(self, filters: Filters = Filters(), *, sort: str = "step", offset: int = 0,
             limit: int = 50) -> list[dict[str, Any]]:
        """One page of summaries (no tokens), in `sort` order."""
        if sort not in SORTS:
            raise StoreError(f"sort: {sort!r} is not one of {', '.join(SORTS)}")
        if not 0 < limit <= 1000 or offset < 0:
            raise StoreError(f"limit must be 1..1000 and offset >= 0 (got limit {limit}, offset {offset})")
        where, args = filters.where()
        rows = self._db().execute(f"SELECT {_LIST_COLUMNS}, substr(text, -160) AS tail FROM trajectories "
                                  f"WHERE {where} ORDER BY {SORTS[sort]} LIMIT ? OFFSET ?", [*args, limit, offset])
        return [dict(r) for r in rows]

    def facets(self) -> dict[str, Any]:
        """What the filters can choose from: stop reasons and envs (with counts), the step range."""
        db = self._db()
        lo, hi, n = db.execute("SELECT min(step), max(step), count(*) FROM trajectories").fetchone()
        return {"count": n, "step_min": lo, "step_max": hi,
                "stop_reasons": {r[0]: r[1] for r in db.execute(
                    "SELECT stop_reason, count(*) FROM trajectories GROUP BY stop_reason")},
                "envs": {r[0]: r[1] for r in db.execute("SELECT env, count(*) FROM trajectories GROUP BY env")},
                "advantage": (db.execute("SELECT value FROM meta WHERE key = 'advantage'").fetchone() or ["grpo"])[0]}

    def get(self, traj_id: str) -> tuple[dict[str, Any], Trajectory, list[list[str]]]:
        """A trajectory's summary row, the trajectory itself and each turn's [prompt, completion] text."""
        row = self._db().execute(f"SELECT {_LIST_COLUMNS}, texts, frame FROM trajectories WHERE id = ?",
                                 (traj_id,)).fetchone()
        if row is None:
            raise KeyError(traj_id)
        summary = dict(row)
        del summary["texts"], summary["frame"]
        return summary, from_msgpack(bytes(row["frame"]), Trajectory), msgspec.msgpack.decode(row["texts"])

    def group(self, group_id: str) -> list[dict[str, Any]]:
        """Every trajectory of one group (summaries and each one's last reply), by sample index."""
        rows = self._db().execute(f"SELECT {_LIST_COLUMNS}, texts FROM trajectories WHERE group_id = ? "
                                  "ORDER BY sample_index", (group_id,))
        out = []
        for r in rows:
            d = dict(r)
            d["turn_texts"] = msgspec.msgpack.decode(d.pop("texts"))
            out.append(d)
        return out

    def pieces(self, ids: set[int]) -> dict[int, str]:
        """The text of each token id (as the writer's tokenizer decoded it alone)."""
        out: dict[int, str] = {}
        ordered = sorted(ids)
        for start in range(0, len(ordered), 900):  # SQLite's limit on parameters per statement
            chunk = ordered[start:start + 900]
            out.update((int(r[0]), r[1]) for r in self._db().execute(
                f"SELECT token, text FROM pieces WHERE token IN ({','.join('?' * len(chunk))})", chunk))
        return out

    def staleness(self) -> dict[int, int]:
        """Trained completion tokens by staleness, over the whole run."""
        return {int(r[0]): int(r[1]) for r in self._db().execute(
            "SELECT staleness, sum(tokens) FROM staleness GROUP BY staleness ORDER BY staleness")}

    def per_step(self) -> list[dict[str, Any]]:
        """Per trained step: trajectories, mean reward, and the mean staleness of its trained tokens."""
        db = self._db()
        stale = {int(r[0]): float(r[1]) for r in db.execute(
            "SELECT step, sum(staleness * tokens) * 1.0 / sum(tokens) FROM staleness GROUP BY step")}
        return [{"step": r[0], "trajectories": r[1], "reward_mean": r[2], "staleness_mean": stale.get(r[0])}
                for r in db.execute("SELECT step, count(*), avg(reward) FROM trajectories GROUP BY step ORDER BY step")]


@contextlib.contextmanager
def open_store(run_dir: Path) -> Iterator[TrajectoryStore]:
    store = TrajectoryStore(run_dir)
    try:
        yield store
    finally:
        store.close()
