"""`hsq export --target-dir`: the checkpoint is never written into, whatever path names it
(a check by path let an export through a bind-mounted alias replace the checkpoint's
weights). A real bind mount where this machine allows one (root), else that case is
skipped; a symlinked alias and a `..` path always."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hsq.errors import ConfigError
from hsq.ops.export.target import write_target_dir


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ckpt = tmp_path_factory.mktemp("ckpt") / "model"
    subprocess.run([sys.executable, "-m", "tests.support.tinymodel", str(ckpt)], check=True)
    return ckpt


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture
def bind_alias(checkpoint: Path, tmp_path: Path) -> Iterator[Path]:
    """The checkpoint again through a bind mount (another path, another mount, one dir)."""
    alias = tmp_path / "alias"
    alias.mkdir()
    res = subprocess.run(["mount", "--bind", str(checkpoint), str(alias)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"no bind mount here: {res.stderr.decode().strip()}")
    try:
        yield alias
    finally:
        subprocess.run(["umount", str(alias)], check=True)


def _symlink_alias(checkpoint: Path, tmp_path: Path) -> Path:
    (tmp_path / "link").symlink_to(checkpoint, target_is_directory=True)
    return tmp_path / "link"


def _dotdot_alias(checkpoint: Path, _tmp: Path) -> Path:
    return checkpoint / "not-yet" / ".."  # mkdir -p would make it, then `..` is CKPT


def test_a_bind_mounted_alias_of_the_checkpoint_is_refused(
    checkpoint: Path, bind_alias: Path
) -> None:
    """The case that was reported. Old code (resolved paths compared): rc 0, the checkpoint's
    model.safetensors replaced by one holding only the embedding and LM head."""
    before = _digests(checkpoint)
    assert os.path.realpath(bind_alias) != os.path.realpath(checkpoint)  # what fooled it
    with pytest.raises(ConfigError, match="is the checkpoint"):
        write_target_dir(checkpoint, bind_alias)
    assert _digests(checkpoint) == before
    with pytest.raises(ConfigError, match="is the checkpoint"):  # and the other way round
        write_target_dir(bind_alias, checkpoint)
    assert _digests(checkpoint) == before


@pytest.mark.parametrize(
    ("alias", "said"),
    [(_symlink_alias, "is the checkpoint"), (_dotdot_alias, "without `..` in the part to make")],
)
def test_other_aliases_of_the_checkpoint_are_refused_and_another_dir_is_written(
    checkpoint: Path, tmp_path: Path, alias: Callable[[Path, Path], Path], said: str
) -> None:
    before = _digests(checkpoint)
    with pytest.raises(ConfigError, match=said):
        write_target_dir(checkpoint, alias(checkpoint, tmp_path))
    assert _digests(checkpoint) == before
    assert not (checkpoint / "not-yet").exists()  # refused before anything was made
    target = tmp_path / "target" / "sub"
    assert write_target_dir(checkpoint, target) == [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
    ]
    assert _digests(checkpoint) == before
