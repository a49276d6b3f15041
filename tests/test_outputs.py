"""Output files: written durably; a failed or killed writer leaves no temp behind."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hsq import fsio
from hsq.errors import OutputError
from tests.support.fakeoutput import written


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_next_write_removes_temps_of_dead_writers_only(tmp_path: Path) -> None:
    shard = tmp_path / "bf16"
    shard.mkdir()
    host = fsio.HOST
    temps = {
        "dead here": f".s1.safetensors.{host}.{dead_pid()}.0a0b0c0d.tmp",
        "alive here": f".s1.safetensors.{host}.{os.getppid()}.0a0b0c0d.tmp",
        "fresh elsewhere": ".s1.safetensors.other-host.12.0a0b0c0d.tmp",
        "old elsewhere": ".s1.safetensors.other-host.13.0a0b0c0d.tmp",
        "another sample": f".s2.safetensors.{host}.{dead_pid()}.0a0b0c0d.tmp",
        "not ours": ".s1.safetensors.tmp",
    }
    for name in temps.values():
        (shard / name).write_bytes(b"torn")
    old = time.time() - fsio.FOREIGN_TEMP_AGE_S - 60
    os.utime(shard / temps["old elsewhere"], (old, old))

    path, _, _ = written(tmp_path, "bf16")

    left = {what for what, name in temps.items() if (shard / name).exists()}
    assert left == {"alive here", "fresh elsewhere", "another sample", "not ours"}
    assert path.exists() and not list(shard.glob(f".s1.safetensors.{host}.{os.getpid()}.*"))


def test_a_full_disk_is_an_output_error_and_leaves_no_temp(tmp_path: Path) -> None:
    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OutputError, match="disk full"):
        fsio.write_durably(tmp_path / "s1.safetensors", full)
    assert list(tmp_path.iterdir()) == []


def test_any_failure_while_filling_leaves_no_temp(tmp_path: Path) -> None:
    def broken(_fd: int) -> None:
        raise ValueError("not an OSError")

    with pytest.raises(ValueError, match="not an OSError"):
        fsio.write_durably(tmp_path / "s1.safetensors", broken)
    assert list(tmp_path.iterdir()) == []
