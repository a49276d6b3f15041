"""A bundle in two parts (scripts/sglang_parts.sh, scripts/sglang_live.sh --part): the
split, the first call's stash, and the second call's refusal when the first part is not
on the machine (it was given back between the calls). Real scripts on real files; nothing
is installed (the refusal comes before)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


FILES = (
    ("wheels/sglang-0.5.17-cp312-x.whl", 3000),
    ("wheels/flashinfer_python-1-x.whl", 2000),
    ("wheels/redis-8-x.whl", 100),
    ("wheels/if-missing/pydantic-2-x.whl", 50),
    ("sgl_kernel.tar.gz", 700),
    ("redis/redis-server", 40),
)


def _bundle(wh: Path) -> None:
    for rel, size in FILES:
        (wh / rel).parent.mkdir(parents=True, exist_ok=True)
        (wh / rel).write_bytes(b"x" * size)
    (wh / "VERSION").write_text("0.5.17\n")
    (wh / "dl").mkdir()
    (wh / "dl" / "big.whl").write_bytes(b"y" * 9000)  # downloads: never part of a part


def _sh(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
        timeout=60, env={"PATH": "/usr/bin:/bin", **env},
    )  # fmt: skip


def test_split_then_stash_then_refuse_without_the_first_part(tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    _bundle(wh)
    r = _sh("sglang_parts.sh", str(wh), "1")
    assert r.returncode == 0, r.stdout + r.stderr
    one = sorted(
        p.relative_to(wh / "part1").as_posix() for p in (wh / "part1").rglob("*") if p.is_file()
    )
    assert one == [
        "PARTS",
        "VERSION",
        "wheels/flashinfer_python-1-x.whl",
        "wheels/sglang-0.5.17-cp312-x.whl",
    ]
    parts = (wh / "part2" / "PARTS").read_text().split("\n")
    assert "dl/big.whl 9000" not in parts and "sgl_kernel.tar.gz 700" in parts
    assert (wh / "part1" / "PARTS").read_text() == (wh / "part2" / "PARTS").read_text()

    stash = tmp_path / "stash"
    r = _sh("sglang_live.sh", "--part", str(wh / "part1"), "--stash-only", STASH=str(stash))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "still to come" in r.stdout and (stash / "wheels" / "sglang-0.5.17-cp312-x.whl").exists()

    r = _sh("sglang_live.sh", "--part", str(wh / "part2"), "--job", "a=x",
            STASH=str(tmp_path / "other"), SITE=str(tmp_path / "site"))  # fmt: skip
    assert r.returncode == 2
    assert "lacks 2 files of the bundle" in r.stdout + r.stderr

    r = _sh("sglang_live.sh", "--part", str(wh / "part1"), "--part", str(wh / "part2"), "--dry-run")
    assert r.returncode == 0 and "0 of 7 bundle files not in them" in r.stdout, r.stdout


def test_stash_only_needs_a_part(tmp_path: Path) -> None:
    r = _sh("sglang_live.sh", "--stash-only", "--dry-run", WHEELHOUSE=str(tmp_path))
    assert r.returncode == 2 and "--stash-only needs --part" in r.stderr
