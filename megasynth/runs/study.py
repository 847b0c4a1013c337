"""The study's storage as every process of a search shares it: opening it (connect timeouts, errors in one line), the
run's settings, and the claims that split the work between processes and machines.

A claim is a row of `megasynth_claims`, in the same database as the Optuna study (SQLite or PostgreSQL):

- `(study, slot)` is the primary key. Slots are 0 .. budget-1 and are the candidate ids (slot 7 is `c0007`; slot 0
  is the naive baseline), so a study never holds more candidates than the budget: a slot is taken by an INSERT that
  the database refuses when another process inserted the same slot first.
- `(study, proposal_key)` and `(study, schedule_key)` are unique: a process claims the proposal before it lowers it,
  then its schedule's key before it validates it; a key another process holds or has finished is refused, so no
  schedule is evaluated twice.
- `state` is `running` until the owner records the outcome (`done`, with the candidate's files as JSON in `result`),
  and `heartbeat` is refreshed by the owner on the database's clock. A running claim whose owner is gone (same host,
  pid dead, no heartbeat for `grace_s`) or silent for `lease_s` is deleted by `reap`, and its slot is free again.

Each step is one statement in its own transaction, and the database's unique constraints decide every race, so the
same code is atomic on SQLite (one writer at a time) and on PostgreSQL (a unique-index conflict aborts the loser).

This is storage bookkeeping only (no proposals, no Optuna): the search claims its candidates through it
(`megasynth.search.claims` adds the proposal keys and the Optuna study) and `synth runs merge` reads it back.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

CONNECT_TIMEOUT_S = 5  # per connection attempt (libpq's connect_timeout); an unreachable server fails in ~5 s
SQLITE_BUSY_S = 60  # how long a SQLite writer waits for another process's transaction
HEARTBEAT_S = 2.0  # how often a process refreshes its running claims
LEASE_S = 120.0  # a running claim not refreshed for this long is free again (its machine is gone or cut off)
RACES = 64  # attempts at taking a slot before giving up (each lost attempt means another process took one)

_META = sa.MetaData()
CLAIMS = sa.Table(
    "megasynth_claims", _META,
    sa.Column("study", sa.String(255), primary_key=True),
    sa.Column("slot", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("proposal_key", sa.String(128), nullable=False),
    sa.Column("schedule_key", sa.String(128), nullable=True),
    sa.Column("owner", sa.String(255), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("heartbeat", sa.Float, nullable=False),
    sa.Column("result", sa.Text, nullable=True),
    sa.Column("trial", sa.Integer, nullable=True),
    sa.UniqueConstraint("study", "proposal_key", name="megasynth_claims_proposal"),
    sa.UniqueConstraint("study", "schedule_key", name="megasynth_claims_schedule"),
)
RUNS = sa.Table(
    "megasynth_runs", _META,
    sa.Column("study", sa.String(255), primary_key=True),
    sa.Column("info", sa.Text, nullable=False),
)


class StorageError(ValueError):
    """The study's storage cannot be opened or used (a one-line reason, the password left out)."""


def study_name(run: str) -> str:
    """The study of a run (the run folder's name): the same name on every machine is the same study."""
    return f"megasynth-{run}"


def owner_id() -> str:
    """This process as a claim's owner: `host:pid`."""
    return f"{socket.gethostname()}:{os.getpid()}"


def normalize_url(url: str) -> str:
    """The storage URL as SQLAlchemy should open it: `postgresql://` means psycopg 3 (the `[distributed]` extra),
    whichever SQLAlchemy is installed; a URL that names its driver (`postgresql+psycopg2://`) is left alone."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def engine_kwargs(url: str) -> dict[str, Any]:
    """Connection arguments for a storage URL: a connect timeout for servers, a busy timeout for SQLite."""
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": SQLITE_BUSY_S}}
    if url.startswith("postgresql"):
        return {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}, "pool_pre_ping": True}
    return {}


def shown(url: str) -> str:
    """The URL for messages, without its password."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except sa_exc.ArgumentError:
        return url


def without_password(url: str) -> str:
    """The URL to record (run.json): its password left out (libpq then reads PGPASSWORD or ~/.pgpass)."""
    try:
        return sa.engine.make_url(url)._replace(password=None).render_as_string(hide_password=False)
    except sa_exc.ArgumentError:
        return url


def describe(url: str, exc: BaseException, failed: str = "cannot reach") -> StorageError:
    """One line that says why the storage at `url` failed (no traceback, no password)."""
    if isinstance(exc, ModuleNotFoundError | ImportError):
        hint = " (pip install 'megasynth[distributed]' for postgresql://)" if "postgres" in url else ""
        return StorageError(f"cannot open the study storage {shown(url)}: its database driver is not installed: "
                            f"{exc}{hint}")
    if isinstance(exc, sa_exc.ArgumentError):
        return StorageError(f"cannot open the study storage {shown(url)}: not a database URL SQLAlchemy knows "
                            f"({exc}); e.g. postgresql://user@host/db or sqlite:///path/study.db")
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    line = " ".join(t.strip() for t in text[:2]) if text else type(exc).__name__
    return StorageError(f"{failed} the study storage {shown(url)}: {line}")


def make_engine(url: str, shown_as: str | None = None) -> sa.Engine:
    """An engine for the storage, checked with one connection: a `StorageError` naming `shown_as` (default: `url`,
    without its password) when the storage cannot be opened, within CONNECT_TIMEOUT_S however many addresses the
    host name has (libpq's timeout is per address, so the check itself has a deadline)."""
    name = shown_as or url
    try:
        engine = sa.create_engine(url, **engine_kwargs(url))
    except (sa_exc.SQLAlchemyError, ImportError) as exc:
        raise describe(name, exc) from None
    failure: list[BaseException] = []

    def check() -> None:
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        except (sa_exc.SQLAlchemyError, ImportError) as exc:
            failure.append(exc)

    checker = threading.Thread(target=check, name="megasynth-storage-check", daemon=True)
    checker.start()
    checker.join(CONNECT_TIMEOUT_S + 1)
    if checker.is_alive():
        raise StorageError(f"cannot reach the study storage {shown(name)}: no answer in {CONNECT_TIMEOUT_S + 1} s")
    if failure:
        raise describe(name, failure[0]) from None
    return engine


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Claim:
    """What `Claims.claim` got: `slot`, now held by this process; or `holder`, the slot of the claim that already has
    this proposal (running elsewhere or done); or neither: every slot in the range is taken."""

    slot: int | None = None
    holder: int | None = None


#: The database's clock in seconds since the epoch, per dialect: heartbeats of every machine are on one clock.
_NOW = {"postgresql": "EXTRACT(EPOCH FROM clock_timestamp())::float8",
        "sqlite": "((julianday('now') - 2440587.5) * 86400.0)"}


class Claims:
    """The claims of one study, for one owner (a process). Every method is one short transaction."""

    def __init__(self, engine: sa.Engine, study: str, owner: str | None = None, shown_as: str | None = None) -> None:
        self.engine, self.study, self.owner = engine, study, owner or owner_id()
        self.url = engine.url.render_as_string(hide_password=False)  # for worker processes to connect
        self.shown_as = shown_as or self.url  # for messages (without the password)
        if engine.dialect.name not in _NOW:
            raise StorageError(f"the study storage {shown(self.shown_as)} is {engine.dialect.name}: claims are kept in "
                               "SQLite or PostgreSQL only")
        self._now = sa.literal_column(_NOW[engine.dialect.name])  # the database's clock, seconds since the epoch
        self._beat: threading.Thread | None = None
        self._stop = threading.Event()

    @contextmanager
    def _tx(self) -> Iterator[sa.Connection]:
        """One transaction; a database error becomes a `StorageError` (unique-constraint conflicts pass through)."""
        try:
            with self.engine.begin() as conn:
                yield conn
        except sa_exc.IntegrityError:
            raise
        except sa_exc.SQLAlchemyError as exc:
            raise describe(self.shown_as, exc, "lost or misused") from None

    def _mine(self, slot: int) -> Any:
        c = CLAIMS.c
        return sa.and_(c.study == self.study, c.slot == slot, c.owner == self.owner)

    # -- set-up -----------------------------------------------------------------------------------------------
    def create_tables(self) -> None:
        """Create the tables if they are missing. Several processes may start at once on an empty database: a lost
        CREATE race is retried (the winner's tables are then found)."""
        for attempt in range(5):
            try:
                _META.create_all(self.engine, checkfirst=True)
                return
            except sa_exc.SQLAlchemyError as exc:  # the server answered when the engine was made: a lost race
                if attempt == 4:
                    raise describe(self.shown_as, exc, "cannot set up") from None
                time.sleep(0.1 + random.random() * 0.4)

    def settle_info(self, info: dict[str, Any]) -> dict[str, Any]:
        """The run's settings as the first process recorded them (this process's `info` if it is the first)."""
        try:
            with self._tx() as conn:
                conn.execute(RUNS.insert().values(study=self.study, info=json.dumps(info, sort_keys=True)))
            return info
        except sa_exc.IntegrityError:
            with self._tx() as conn:
                text = conn.execute(sa.select(RUNS.c.info).where(RUNS.c.study == self.study)).scalar_one()
            return dict(json.loads(text))

    def info(self) -> dict[str, Any] | None:
        """The run's settings as recorded, or None when no process has opened this run yet."""
        with self._tx() as conn:
            text = conn.execute(sa.select(RUNS.c.info).where(RUNS.c.study == self.study)).scalar()
        return dict(json.loads(text)) if text else None

    def empty(self) -> bool:
        """True when no claim of this study exists yet."""
        with self._tx() as conn:
            return conn.execute(sa.select(CLAIMS.c.slot).where(CLAIMS.c.study == self.study).limit(1)).first() is None

    def adopt(self, rows: list[dict[str, Any]]) -> bool:
        """Record candidates made before claims existed (done, owned by `legacy`), all or none. False when another
        process adopted them (or claimed) first."""
        if not rows:
            return True
        try:
            with self._tx() as conn:
                conn.execute(CLAIMS.insert(), [{"study": self.study, "owner": "legacy", "state": "done",
                                                "heartbeat": 0.0, **r} for r in rows])
            return True
        except sa_exc.IntegrityError:
            return False

    # -- claiming ---------------------------------------------------------------------------------------------
    def claim(self, key: str, slots: range) -> Claim:
        """Take the lowest free slot of `slots` for the proposal `key`, unless a claim already has that key."""
        c = CLAIMS.c
        for _ in range(RACES):
            with self._tx() as conn:
                holder = conn.execute(sa.select(c.slot).where(c.study == self.study, c.proposal_key == key)).first()
                if holder is not None:
                    return Claim(holder=int(holder[0]))
                taken = set(conn.execute(sa.select(c.slot).where(c.study == self.study, c.slot >= slots.start,
                                                                 c.slot < slots.stop)).scalars())
            free = next((s for s in slots if s not in taken), None)
            if free is None:
                return Claim()
            try:
                with self._tx() as conn:
                    conn.execute(CLAIMS.insert().values(study=self.study, slot=free, proposal_key=key,
                                                        owner=self.owner, state="running", heartbeat=self._now))
                return Claim(slot=free)
            except sa_exc.IntegrityError:
                continue  # another process took this slot (or this key) between the two transactions: look again
        raise StorageError(f"could not take a slot of study {self.study} in {RACES} attempts")

    def claim_schedule(self, slot: int, key: str) -> int | None:
        """Record the schedule key of this process's claim `slot`. Returns the slot of the claim that already has
        that key (the caller then releases its own), or None when the key is now this claim's."""
        for _ in range(RACES):
            try:
                with self._tx() as conn:
                    conn.execute(CLAIMS.update().where(self._mine(slot)).values(schedule_key=key,
                                                                                 heartbeat=self._now))
                return None
            except sa_exc.IntegrityError:
                with self._tx() as conn:
                    holder = conn.execute(sa.select(CLAIMS.c.slot).where(CLAIMS.c.study == self.study,
                                                                         CLAIMS.c.schedule_key == key)).first()
                if holder is not None:
                    return int(holder[0])
                # the holder gave its claim back between the two transactions: try again
        raise StorageError(f"could not record a schedule key in study {self.study} in {RACES} attempts")

    def release(self, slot: int) -> None:
        """Give a running claim back (its slot and keys are free again)."""
        with self._tx() as conn:
            conn.execute(CLAIMS.delete().where(self._mine(slot), CLAIMS.c.state == "running"))

    def release_all(self) -> None:
        """Give back every running claim of this process (when it stops early)."""
        with self._tx() as conn:
            conn.execute(CLAIMS.delete().where(CLAIMS.c.study == self.study, CLAIMS.c.owner == self.owner,
                                               CLAIMS.c.state == "running"))

    def finish(self, slot: int, result: dict[str, Any], keep_schedule_key: bool = True) -> bool:
        """Record the outcome of this process's claim. False when the claim is no longer this process's (it was
        silent for longer than the lease and another process took the slot)."""
        values: dict[str, Any] = {"state": "done", "result": json.dumps(result), "heartbeat": self._now}
        if not keep_schedule_key:
            values["schedule_key"] = None
        with self._tx() as conn:
            n = conn.execute(CLAIMS.update().where(self._mine(slot), CLAIMS.c.state == "running").values(**values))
        return n.rowcount == 1

    def set_trial(self, slot: int, number: int) -> None:
        """Note the Optuna trial that records this claim's outcome."""
        with self._tx() as conn:
            conn.execute(CLAIMS.update().where(self._mine(slot)).values(trial=number))

    # -- reading ----------------------------------------------------------------------------------------------
    def done(self) -> set[int]:
        """The slots whose outcome is recorded."""
        c = CLAIMS.c
        with self._tx() as conn:
            return set(conn.execute(sa.select(c.slot).where(c.study == self.study, c.state == "done")).scalars())

    def results(self, slots: set[int]) -> dict[int, dict[str, Any]]:
        """slot -> recorded outcome, for the done claims among `slots` that have one."""
        c = CLAIMS.c
        out: dict[int, dict[str, Any]] = {}
        wanted = sorted(slots)
        for i in range(0, len(wanted), 500):
            with self._tx() as conn:
                rows = conn.execute(sa.select(c.slot, c.result).where(
                    c.study == self.study, c.state == "done", c.slot.in_(wanted[i:i + 500]))).all()
            out.update({int(s): json.loads(r) for s, r in rows if r})
        return out

    def rows(self) -> list[dict[str, Any]]:
        """Every claim of the study (for tests, `synth runs merge` and diagnostics), by slot."""
        c = CLAIMS.c
        with self._tx() as conn:
            rows = conn.execute(sa.select(CLAIMS).where(c.study == self.study).order_by(c.slot)).mappings().all()
        return [dict(r) for r in rows]

    def count(self, budget: int) -> tuple[int, int]:
        """(done, running) claims among the slots under the budget."""
        c = CLAIMS.c
        with self._tx() as conn:
            rows = conn.execute(sa.select(c.state, sa.func.count()).where(c.study == self.study, c.slot < budget)
                                .group_by(c.state)).all()
        n = {str(s): int(k) for s, k in rows}
        return n.get("done", 0), n.get("running", 0)

    # -- owners that are gone -----------------------------------------------------------------------------------
    def reap(self, lease_s: float = LEASE_S, grace_s: float = 3 * HEARTBEAT_S,
             salvage: Callable[[int, str | None], dict[str, Any] | None] | None = None
             ) -> list[tuple[int, str, bool]]:
        """Take over the running claims whose owner is gone: a process of this host whose pid is dead and that has
        not refreshed its claim for `grace_s` (a pid is only meaningful on its own host; the grace keeps a live
        process of another machine with the same host name safe), or any owner silent for `lease_s`. A claim whose
        outcome the owner left complete on disk (`salvage(slot, schedule_key)` returns it) is finished with it, in
        the owner's name (`orphans` then records its trial); any other is deleted, and its slot is free again.
        Returns (slot, owner, salvaged). Each UPDATE or DELETE repeats the staleness test, so a claim refreshed
        meanwhile stays its owner's."""
        c = CLAIMS.c
        host = self.owner.rsplit(":", 1)[0]
        with self._tx() as conn:
            rows = conn.execute(sa.select(c.slot, c.owner, c.schedule_key).where(
                c.study == self.study, c.state == "running", c.owner != self.owner)).all()
        out: list[tuple[int, str, bool]] = []
        for slot, owner, key in rows:
            h, _, pid = str(owner).rpartition(":")
            age = grace_s if h == host and pid.isdigit() and not _alive(int(pid)) else lease_s
            stale = sa.and_(c.study == self.study, c.slot == slot, c.owner == owner, c.state == "running",
                            c.heartbeat < self._now - age)
            with self._tx() as conn:
                if conn.execute(sa.select(c.slot).where(stale)).first() is None:
                    continue
            doc = salvage(int(slot), key) if salvage is not None else None
            with self._tx() as conn:
                if doc is not None:
                    n = conn.execute(CLAIMS.update().where(stale).values(state="done", result=json.dumps(doc)))
                else:
                    n = conn.execute(CLAIMS.delete().where(stale))
            if n.rowcount == 1:
                out.append((int(slot), str(owner), doc is not None))
        return out

    def orphans(self, lease_s: float = LEASE_S) -> list[tuple[int, str, dict[str, Any]]]:
        """Done claims whose owner is gone (same host and pid dead, or silent for `lease_s`) without having noted
        their Optuna trial (killed between recording the outcome and the trial). Each is taken over by this process
        (one UPDATE, so one process repairs it) and returned as (slot, former owner, outcome); the caller records
        the trial unless the former owner did just before it died."""
        c = CLAIMS.c
        host = self.owner.rsplit(":", 1)[0]
        with self._tx() as conn:
            rows = conn.execute(sa.select(c.slot, c.owner, c.result).where(
                c.study == self.study, c.state == "done", c.trial.is_(None), c.owner != "legacy",
                c.owner != self.owner, c.result.is_not(None))).all()
        out: list[tuple[int, str, dict[str, Any]]] = []
        for slot, owner, result in rows:
            h, _, pid = str(owner).rpartition(":")
            age = 0.0 if h == host and pid.isdigit() and not _alive(int(pid)) else lease_s
            with self._tx() as conn:
                n = conn.execute(CLAIMS.update().where(c.study == self.study, c.slot == slot, c.owner == owner,
                                                       c.trial.is_(None), c.heartbeat <= self._now - age)
                                 .values(owner=self.owner))
            if n.rowcount == 1:
                out.append((int(slot), str(owner), json.loads(result)))
        return out

    # -- heartbeat ----------------------------------------------------------------------------------------------
    def beat(self) -> None:
        """Refresh this process's running claims."""
        c = CLAIMS.c
        with self._tx() as conn:
            conn.execute(CLAIMS.update().where(c.study == self.study, c.owner == self.owner, c.state == "running")
                         .values(heartbeat=self._now))

    def start_heartbeat(self, every_s: float = HEARTBEAT_S) -> None:
        """Refresh this process's running claims every `every_s` seconds from a daemon thread until `stop`."""
        if self._beat is not None:
            return

        def run() -> None:
            while not self._stop.wait(every_s):
                try:
                    self.beat()
                except (StorageError, sa_exc.SQLAlchemyError):
                    pass  # the storage is unreachable for now: the main loop says so when it needs it

        self._stop.clear()
        self._beat = threading.Thread(target=run, name="megasynth-heartbeat", daemon=True)
        self._beat.start()

    def stop(self) -> None:
        """Stop the heartbeat thread."""
        if self._beat is not None:
            self._stop.set()
            self._beat.join(timeout=5)
            self._beat = None
