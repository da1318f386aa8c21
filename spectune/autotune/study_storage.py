"""Optuna storage for the measurement study: opening it, the claim lock, journal repair, heartbeats.

- ``open_storage``: None -> in memory; ``postgresql://`` / ``sqlite:///`` -> Optuna's
  ``RDBStorage`` with its heartbeat (``heartbeat_interval``, ``grace_period``; a stale trial is
  failed by ``optuna.storages.fail_stale_trials`` and handed to the study's re-queue callback);
  a path -> ``JournalStorage`` over :class:`SafeJournalFileBackend`.
- The **claim lock** serialises what must not interleave between workers — enqueueing points,
  claiming one, failing a dead worker's trial — so a point key has at most one live trial. It is
  the database's own lock on PostgreSQL (``pg_advisory_lock``, released by the server when a
  worker's connection dies) and an ``flock`` beside the file for a journal or SQLite (released by
  the kernel when a worker dies). Re-entrant within a process.
- A journal line cut short (a full disk, a kill mid-write) is detected: a torn last line is cut
  off under the journal's own lock before the next append; a bad line inside the file is refused
  with the command that recovers the records before it (:func:`repair_journal`). A file whose first
  line is no record (a profile, a log) is no journal at all: refused, never cut nor repaired.
- ``open_storage(..., create=False)`` is a reader's (``spectune status``): a journal or SQLite
  file that does not exist is an error, and nothing is written (no folder, file or lock file).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
from optuna.storages.journal import JournalFileBackend
from optuna.storages.journal._file import (
    BaseJournalFileLock,  # the ABC JournalFileBackend takes as lock_obj
)

from spectune.autotune.measurement_plan import StudyError

HEARTBEAT_S = 10  # RDB heartbeat interval of a running trial
GRACE_S = 60  # a running trial whose heartbeat is older than this is a dead worker's
RDB_PREFIXES = ("sqlite:", "postgresql")
POLL_LOCK_S = 0.002  # how often a worker waiting for a file lock tries again


def storage_label(storage: Any) -> str:
    return storage if isinstance(storage, str) else type(storage).__name__


# ---------------------------------------------------------------------------------------------
# journal file


def _torn_tail(path: str) -> int:
    """Bytes after the last newline (0 when the file ends cleanly or is empty)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as f:
        step, pos = 4096, size
        while pos > 0:
            start = max(0, pos - step)
            f.seek(start)
            chunk = f.read(pos - start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                return size - (start + nl + 1)
            pos = start
    return size


def _cut_torn_tail(path: str) -> int:
    """Truncate a torn last line; returns the bytes removed. Call with the journal lock held."""
    torn = _torn_tail(path)
    if torn:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - torn)
            f.flush()
            os.fsync(f.fileno())
    return torn


class FlockJournalLock(BaseJournalFileLock):
    """The journal's append lock as an ``flock`` on ``<path>.flock`` (filelock): the kernel
    releases it when a writer dies, and a waiter polls every 2 ms instead of Optuna's symlink
    lock's back-off to 1 s, which serialised N workers' appends into seconds of sleep."""

    def __init__(self, path: str) -> None:
        from filelock import FileLock

        self._lock = FileLock(f"{path}.flock")

    def acquire(self) -> bool:
        self._lock.acquire(poll_interval=POLL_LOCK_S)
        return True

    def release(self) -> None:
        self._lock.release()


class SafeJournalFileBackend(JournalFileBackend):
    """Optuna's journal file backend whose appends never leave a torn line behind: a torn tail
    left by a writer that died mid-line is cut before writing, and a write that fails (a full
    disk) is rolled back to the size before it. Both under the backend's file lock."""

    def __init__(self, file_path: str) -> None:
        super().__init__(file_path, lock_obj=FlockJournalLock(file_path))
        self.repaired_bytes = 0

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        text = "\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n"
        with journal_lock(self._file_path):
            self.repaired_bytes += _cut_torn_tail(self._file_path)
            size = os.path.getsize(self._file_path)
            try:
                with open(self._file_path, "ab") as f:
                    f.write(text.encode("utf-8"))
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:
                with open(self._file_path, "r+b") as f:
                    f.truncate(size)
                raise


@contextlib.contextmanager
def journal_lock(path: str) -> Iterator[None]:
    """The lock the journal's appends hold (:class:`FlockJournalLock`)."""
    lock = FlockJournalLock(path)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


RECORD_START = b'{"op_code":'  # how Optuna's journal writes every record


def _is_record(line: bytes) -> bool:
    try:
        log = json.loads(line)
    except ValueError:  # not JSON, not UTF-8
        return False
    return isinstance(log, dict) and "op_code" in log


def _refuse_non_journal(path: str) -> None:
    """Refuse a file whose first line is no journal record: it is no journal (a YAML profile, a
    log), and a repair would keep 0 records of it. An empty file is an empty journal."""
    with open(path, "rb") as f:
        first = f.readline()
    if first.endswith(b"\n"):
        ours = _is_record(first)
    else:  # the whole file is one unterminated line: a torn first write begins as every record does
        ours = first[:len(RECORD_START)] == RECORD_START[:len(first)]
    if not ours:
        raise StudyError(f"storage {path}: not an Optuna journal file (line 1 is not a journal record)")


def check_journal(path: str, *, cut: bool = True) -> int:
    """Refuse a file that is no journal, or a journal with a bad line inside; cut a torn last line
    (``cut=False``, a reader: take no lock and leave it, Optuna's reader skips it). Returns the
    bytes cut."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return 0
    _refuse_non_journal(path)  # before cutting: a file that is not ours keeps its last line
    with journal_lock(path) if cut else contextlib.nullcontext():
        removed = _cut_torn_tail(path) if cut else 0
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.endswith(b"\n"):  # a torn tail (cut=False), or a writer's line under way
                    break
                if not _is_record(line):
                    raise StudyError(
                        f"storage {path}: line {number} is not a journal record (a write cut short by a "
                        f"full disk or a crash, then appended to); keep the {number - 1} records before it "
                        f"with `spectune status --storage {path} --repair` (the file is kept as a backup)"
                    )
    return removed


def repair_journal(path: str) -> tuple[int, int, Path]:
    """Keep the records before the first bad line; the original goes to ``<path>.bad-<time>``.
    Returns (records kept, lines dropped, backup path)."""
    from spectune.io import atomic_write_bytes

    if not os.path.exists(path):
        raise StudyError(f"storage {path}: no such journal file")
    _refuse_non_journal(path)  # before the lock: a file that is no journal is left as it is
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    backup = Path(f"{path}.bad-{stamp}")
    with journal_lock(path):
        data = Path(path).read_bytes()
        lines = data.splitlines(keepends=True)
        kept = 0
        for line in lines:
            if not (line.endswith(b"\n") and _is_record(line)):
                break
            kept += 1
        backup.write_bytes(data)
        atomic_write_bytes(path, b"".join(lines[:kept]))
    return kept, len(lines) - kept, backup


# ---------------------------------------------------------------------------------------------
# opening


def open_storage(storage: str | Path | optuna.storages.BaseStorage | None, *,
                 heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S,
                 on_stale: Callable[[optuna.Study, optuna.trial.FrozenTrial], None] | None = None,
                 create: bool = True) -> optuna.storages.BaseStorage:
    """None -> in memory; sqlite:/postgresql: URL -> RDBStorage with heartbeats; a path -> journal.

    ``on_stale(study, trial)`` runs after ``fail_stale_trials`` failed a trial whose heartbeat
    stopped (RDB only: the journal has no heartbeat; its dead workers are found by process id).
    ``create=False`` (a reader): a journal or SQLite file must exist, and opening writes nothing.
    """
    if storage is None:
        return optuna.storages.InMemoryStorage()
    if isinstance(storage, optuna.storages.BaseStorage):
        return storage
    text = str(storage)
    try:
        if "://" in text:
            if not text.startswith(RDB_PREFIXES):
                raise StudyError(f"storage: unsupported URL {text!r} (postgresql://, sqlite:/// or a journal file)")
            db = text[len("sqlite:///"):].split("?")[0] if text.startswith("sqlite:///") else ""
            if not create and db not in ("", ":memory:") and not os.path.exists(db):
                raise StudyError(f"storage {text}: no such database file")  # SQLite would create it
            return _open_rdb(text, heartbeat_s, grace_s, on_stale)
        if not create and not os.path.exists(text):
            raise StudyError(f"storage {text}: no such journal file")  # Optuna's backend would create it
        if create:
            Path(text).parent.mkdir(parents=True, exist_ok=True)
        check_journal(text, cut=create)
        return optuna.storages.JournalStorage(SafeJournalFileBackend(text))
    except StudyError:
        raise
    except Exception as exc:  # driver missing, unreachable database, unwritable folder
        # the driver is missing (not a database that said no: an unknown host names psycopg too)
        hint = ' (pip install "spectune[postgres]")' if isinstance(exc, ImportError) or "No module named" in str(exc) else ""
        raise StudyError(f"storage: cannot open {text!r}: {exc}".splitlines()[0] + hint) from None


def _open_rdb(url: str, heartbeat_s: int, grace_s: int,
              on_stale: Callable[[optuna.Study, optuna.trial.FrozenTrial], None] | None) -> optuna.storages.RDBStorage:
    def build() -> optuna.storages.RDBStorage:
        with warnings.catch_warnings():  # the heartbeat arguments: experimental since Optuna 2.9, stable in use
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                url, engine_kwargs={"pool_pre_ping": True} if url.startswith("postgresql") else None,
                heartbeat_interval=heartbeat_s, grace_period=grace_s, heartbeat_stale_trial_callback=on_stale)

    if not url.startswith("postgresql"):
        return build()
    import sqlalchemy

    # workers that start at the same instant would race to create Optuna's tables
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": _lock_key("optuna-schema")})
            try:
                return build()
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": _lock_key("optuna-schema")})
    finally:
        engine.dispose()


def _lock_key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)


# ---------------------------------------------------------------------------------------------
# claim lock


class ClaimLock:
    """Re-entrant cross-process lock for one study in one storage (see the module docstring)."""

    def __init__(self, storage: optuna.storages.BaseStorage, study_name: str) -> None:
        self._depth = 0
        self._thread = threading.RLock()
        self._inner: Any = None
        base = _unwrap(storage)
        if isinstance(base, optuna.storages.RDBStorage) and base.url.startswith("postgresql"):
            self._engine, self._key = base.engine, _lock_key(f"spectune-claim:{study_name}")
            self._conn: Any = None
        else:
            self._engine = None  # type: ignore[assignment]
            path = _lock_path(base)
            if path is None and not isinstance(base, optuna.storages.InMemoryStorage):
                raise StudyError(f"storage: {type(base).__name__} has no lock to share a study safely "
                                 f"(a journal file, postgresql:// or sqlite:///)")
            if path is not None:
                from filelock import FileLock

                self._inner = FileLock(f"{path}.claim.lock")


    def __enter__(self) -> ClaimLock:
        self._thread.acquire()
        if self._depth == 0:
            try:
                self._acquire()
            except BaseException:
                self._thread.release()
                raise
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        try:
            if self._depth == 0:
                self._release()
        finally:
            self._thread.release()

    def _acquire(self) -> None:
        if self._engine is not None:
            import sqlalchemy

            self._conn = self._engine.connect()
            self._conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": self._key})
        elif self._inner is not None:
            self._inner.acquire(poll_interval=POLL_LOCK_S)

    def _release(self) -> None:
        if self._engine is not None and self._conn is not None:
            import sqlalchemy

            try:
                self._conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": self._key})
            finally:
                self._conn.close()
                self._conn = None
        elif self._inner is not None:
            self._inner.release()


def _unwrap(storage: optuna.storages.BaseStorage) -> optuna.storages.BaseStorage:
    """The RDBStorage inside Optuna's _CachedStorage; any other storage as it is."""
    inner = getattr(storage, "_backend", None)
    return inner if isinstance(inner, optuna.storages.RDBStorage) else storage


def _lock_path(base: optuna.storages.BaseStorage) -> str | None:
    if isinstance(base, optuna.storages.JournalStorage):
        backend = getattr(base, "_backend", None)
        return getattr(backend, "_file_path", None)
    if isinstance(base, optuna.storages.RDBStorage) and base.url.startswith("sqlite:///"):
        return base.url[len("sqlite:///"):]
    return None  # in memory: one process, the thread lock is enough


# ---------------------------------------------------------------------------------------------
# heartbeat


@contextlib.contextmanager
def heartbeat(storage: optuna.storages.BaseStorage, trial_id: int) -> Iterator[None]:
    """Record the trial's heartbeat every interval while the block runs (RDB storage only; the
    ask/tell loop does what ``study.optimize`` does around an objective)."""
    get_interval = getattr(storage, "get_heartbeat_interval", None)  # Optuna's BaseHeartbeat (RDB)
    interval = get_interval() if get_interval is not None else None
    if interval is None:
        yield
        return
    record: Callable[[int], None] = storage.record_heartbeat  # type: ignore[attr-defined]
    stop = threading.Event()

    def beat() -> None:
        while True:
            with contextlib.suppress(Exception):  # a lost beat only delays nothing: the next one comes
                record(trial_id)
            if stop.wait(interval):
                return

    record(trial_id)  # before the block: a trial is never RUNNING without one
    thread = threading.Thread(target=beat, name="spectune-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
