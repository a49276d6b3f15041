"""SGLang's own source as the pinned wheels hold it: .cache/sglang/, filled by
scripts/fetch_sglang_sources.sh, read as files (SGLang is never imported or run)."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hsq.engines.sglang.srccheck import SourceReader

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "sglang"


def wheel_reader(version: str) -> Iterator[SourceReader]:
    """The files of the pinned SGLang wheel of `version`, read without installing it; a skip
    (a failure in CI, which must have the cache) where the wheel is not there."""
    wheels = sorted(CACHE.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        why = f"no sglang {version} wheel in {CACHE}: run scripts/fetch_sglang_sources.sh"
        if os.environ.get("CI"):
            pytest.fail(why + " (CI must have it: `make setup` fetches it)")
        pytest.skip(why)
    with zipfile.ZipFile(wheels[0]) as zf:
        names = set(zf.namelist())

        def read(path: str) -> str | None:
            return zf.read(path).decode() if path in names else None

        yield read
