"""Build-time check of the GPU server image (Dockerfile.sglang): run by the image's Python.

Fails the build unless SGLang is a version the hook conforms to, SGLang's plugin loader will
find hsq's `hsq_dump` entry point, and `hsq` (for `hsq launch-sglang`) is on PATH. Reads
metadata only: importing SGLang would need a GPU.
"""

from __future__ import annotations

import importlib.metadata as md
import shutil
import sys

from hsq.engines.sglang.compat import (
    ENTRY_POINT_GROUP,
    ENTRY_POINT_NAME,
    ENTRY_POINT_VALUE,
    PINNED_VERSIONS,
    parse_version,
    plugin_supported,
)


def main() -> int:
    problems = []
    version = md.version("sglang")
    if parse_version(version) not in {parse_version(v) for v in PINNED_VERSIONS}:
        problems.append(f"sglang {version} is not pinned in compat.py ({PINNED_VERSIONS})")
    elif not plugin_supported(version):
        problems.append(f"sglang {version} has no plugin API: use `hsq launch-sglang`")
    eps = [e for e in md.entry_points(group=ENTRY_POINT_GROUP) if e.name == ENTRY_POINT_NAME]
    if [e.value for e in eps] != [ENTRY_POINT_VALUE]:
        problems.append(f"entry point {ENTRY_POINT_GROUP}:{ENTRY_POINT_NAME} is {eps}")
    if shutil.which("hsq") is None:
        problems.append("no `hsq` on PATH")
    for p in problems:
        print(f"check_hook: {p}", file=sys.stderr)
    if not problems:
        print(f"check_hook: sglang {version}, {ENTRY_POINT_NAME} -> {ENTRY_POINT_VALUE}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
