"""Worker start-up: validate the run, the server URL and the dump dir, then take the dump
dir. Nothing is created, changed or deleted before every check has passed:
a worker pointed at a shared directory (/tmp, /dev/shm: sticky, or owned by someone else)
refuses it unless --dump-dir-force, and only a directory it created itself is chmodded.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import structlog

from hsq.errors import ConfigError, StoreError
from hsq.protocol import clear_dump_dir
from hsq.store import RunStore, connect
from hsq.workers.lock import DumpDirLock
from hsq.workers.runview import RunView
from hsq.workers.settings import WorkerSettings

log = structlog.get_logger("hsq.worker")
STAGING = ".hsq-staging"


@dataclass
class Started:
    store: RunStore
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
    if st.st_uid != os.geteuid():
        problems.append(f"it is owned by uid {st.st_uid}, not by this worker (uid {os.geteuid()})")
    if problems and not force:
        raise ConfigError(
            f"--dump-dir {path} looks shared: {'; '.join(problems)}. The worker deletes every "
            "req_* in its dump dir; give it a private subdirectory, or --dump-dir-force"
        )
    if problems:
        log.warning("dump_dir_forced", dump_dir=str(path), problems=problems)
    return False


def fresh_staging(dump_dir: Path) -> Path:
    """An empty <dump_dir>/.hsq-staging. Whatever holds the name is removed without being
    followed: a symlink or a file left there (by anyone who could write the dump dir) made
    mkdir fail with "[Errno 17] File exists" (issue 23 item 15)."""
    staging = dump_dir / STAGING
    try:
        try:
            st = os.lstat(staging)
        except FileNotFoundError:
            pass
        else:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(staging)
            else:
                os.unlink(staging)  # the link itself, never its target
                log.warning("staging_replaced", path=str(staging), mode=oct(st.st_mode))
        staging.mkdir(mode=0o700)
    except OSError as exc:
        raise ConfigError(f"cannot make a fresh {staging}: {exc.strerror or exc}") from exc
    return staging


def startup(s: WorkerSettings, worker_id: str) -> Started:
    s.validate()
    store = RunStore(connect(s.redis_url), s.run)
    cfg = store.require_config()  # a run that does not exist: exit 2, nothing touched
    if not os.access(cfg.dataset, os.R_OK):
        raise StoreError(f"dataset {cfg.dataset} is not readable on this node")
    create = check_dump_dir(s.dump_dir, s.dump_dir_force)
    view = RunView.of(cfg, s.run)
    d = s.dump_dir
    if create:
        d.mkdir(parents=True, mode=0o700)
        os.chmod(d, 0o700)  # ours: private to this worker whatever the umask
    lock = DumpDirLock(d)
    lock.acquire(worker_id)
    staging = fresh_staging(d)
    cleared = clear_dump_dir(d)  # leftovers of an earlier worker or server: never ours now
    view.out_root.mkdir(parents=True, exist_ok=True)
    return Started(store, view, lock, staging, cleared)
