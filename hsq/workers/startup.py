"""Worker start-up: validate the run, the server URL and the dump dir, then take the dump
dir. Nothing is created, changed or deleted before every check has passed:
a worker pointed at a shared directory (/tmp, /dev/shm: sticky, owned by someone else, or
writable by other users) refuses it unless --dump-dir-force, and only a directory it
created itself is chmodded. :func:`take_dump_dir` runs again when the dump dir is removed
or replaced under a running worker.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from hsq import extras
from hsq.dump.find import clear_dump_dir
from hsq.errors import ConfigError, StoreError
from hsq.fsio import remove_entry
from hsq.outputs.manifest import ManifestEntry
from hsq.runstore import RunStore
from hsq.states import FP8
from hsq.store import WorkerStore, connect
from hsq.workers.lock import DumpDirLock
from hsq.workers.runview import RunView
from hsq.workers.settings import WorkerSettings

log = structlog.get_logger("hsq.worker")
STAGING = ".hsq-staging"


@dataclass
class Started:
    store: WorkerStore[ManifestEntry]
    view: RunView
    lock: DumpDirLock
    staging: Path
    cleared: int


def check_dump_dir(path: Path, force: bool) -> bool:
    """Refuse a dump dir that is not ours to clear; True if it does not exist yet."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"--dump-dir {path} exists and is not a directory")
    problems = []
    if st.st_mode & stat.S_ISVTX:
        problems.append("it has the sticky bit (a shared directory such as /tmp or /dev/shm)")
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        # Another local user could plant dumps, FIFOs or a forged readiness marker in it.
        problems.append(
            f"it is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"`chmod 700 {path}` makes it private (the server runs as the same user)"
        )
    if st.st_uid != os.geteuid():
        problems.append(f"it is owned by uid {st.st_uid}, not by this worker (uid {os.geteuid()})")
    if problems and not force:
        raise ConfigError(
            f"--dump-dir {path} looks shared: {'; '.join(problems)}. The worker deletes every "
            "req_* in its dump dir and trusts what its server writes there; give it a "
            "private directory (mode 0700, owned by the worker's user), or --dump-dir-force"
        )
    if problems:
        log.warning("dump_dir_forced", dump_dir=str(path), problems=problems)
    return False


def fresh_staging(dump_dir: Path) -> Path:
    """An empty <dump_dir>/.hsq-staging. Whatever holds the name is removed without being
    followed: a link or a file there made mkdir fail with "[Errno 17] File exists", and a
    link must never lead the worker's writes elsewhere."""
    staging = dump_dir / STAGING
    remove_entry(staging)
    staging.mkdir(mode=0o700)
    return staging


def require_dump_dir(
    path: Path,
    force: bool,
    healthy: Callable[[], bool] = lambda: True,
    *,
    timeout_s: float = 1800.0,
    poll_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """The dump dir is its server's: the server makes it at start (and writes its readiness
    marker there). A worker started beside its server waits for it, creating nothing; once
    the server answers and the dir is still missing, --dump-dir is mistyped: exit 2.
    Creating a missing one turned a typo into a directory, a lock and a staging dir left
    behind by a worker that then exited 2."""
    deadline = clock() + timeout_s
    logged = False
    while check_dump_dir(path, force):
        if healthy() and check_dump_dir(path, force):  # once more: it may just have come
            raise missing_dump_dir(path)
        if clock() >= deadline:
            raise missing_dump_dir(path)
        if not logged:
            log.info("waiting_for_dump_dir", dump_dir=str(path), timeout_s=timeout_s)
            logged = True
        time.sleep(poll_s)


def missing_dump_dir(path: Path) -> ConfigError:
    return ConfigError(
        f"--dump-dir {path} does not exist: give the directory the server writes its "
        "dumps to (the server creates it at start)"
    )


def take_dump_dir(
    s: WorkerSettings, worker_id: str, *, create_missing: bool = False
) -> tuple[DumpDirLock, Path, int]:
    """Check the dump dir, create it (0700) if missing and `create_missing`, take its lock,
    make the staging dir and clear leftovers: (lock, staging dir, dumps cleared). At start
    the dir must exist; when it was removed or replaced under a running worker it is taken
    again, and made again if removed (the path passed the checks at start)."""
    d = s.dump_dir
    create = check_dump_dir(d, s.tuning.exchange.dump_dir_force)
    if create and not create_missing:
        raise missing_dump_dir(d)
    try:
        if create:
            d.mkdir(parents=True, mode=0o700)
            os.chmod(d, 0o700)  # ours: private to this worker whatever the umask
        lock = DumpDirLock(d)
        lock.acquire(worker_id)
        try:
            staging = fresh_staging(d)
            cleared = clear_dump_dir(d)  # leftovers of an earlier worker or server: never ours
        except BaseException:
            lock.release()
            raise
    except OSError as exc:
        raise ConfigError(f"cannot take the dump dir {d}: {exc}") from exc
    return lock, staging, cleared


class HeldDumpDir:
    """The dump dir this worker holds (its lock), taken again when it was removed or
    replaced under the worker (:meth:`retake`)."""

    def __init__(self, settings: WorkerSettings, worker_id: str, lock: DumpDirLock) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.lock = lock

    def retake(self) -> tuple[Path, int]:
        """(new staging dir, dumps cleared); ConfigError if the path fails the checks."""
        self.lock.release()
        self.lock, staging, cleared = take_dump_dir(
            self.settings, self.worker_id, create_missing=True
        )
        return staging, cleared

    def release(self) -> None:
        self.lock.release()


def _answers(server: str) -> bool:
    """Whether the server answers /health (SGLang, vLLM and the reference server all do)."""
    import httpx

    try:
        return httpx.get(server.rstrip("/") + "/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def startup(s: WorkerSettings, worker_id: str) -> Started:
    s.validate()
    store = RunStore(connect(s.redis_url), s.run)
    cfg = store.require_config()  # a run that does not exist: exit 2, nothing touched
    if cfg.store_dtype == FP8:  # it quantizes, or checks a server's fp8, with torch
        extras.require("fp8", f"a worker of run {s.run} (stored as {FP8})")
    if not os.access(cfg.dataset, os.R_OK):
        raise StoreError(f"dataset {cfg.dataset} is not readable on this node")
    # before anything is created anywhere
    require_dump_dir(s.dump_dir, s.tuning.exchange.dump_dir_force, lambda: _answers(s.server))
    view = RunView.of(cfg, s.run)
    lock, staging, cleared = take_dump_dir(s, worker_id, create_missing=False)
    view.out_root.mkdir(parents=True, exist_ok=True)
    return Started(store, view, lock, staging, cleared)
