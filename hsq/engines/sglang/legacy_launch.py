"""Launch stock SGLang with the dump hooks, for versions without the plugin API (< 0.5.11).

    SGLANG_HS_DUMP_DIR=/dumps python -m hsq.engines.sglang.legacy_launch \\
        --model-path ... --disable-radix-cache [other sglang.launch_server flags]

SGLang starts its schedulers with multiprocessing "spawn", so patches made in this process
are not inherited. But spawn re-runs the parent's main module, as ``__mp_main__``, in each
child before it unpickles the target; for ``python -m pkg.module`` it does so by module
name (not for a package's ``__main__``). So the patches are applied from the top level:
in each child by the ``__mp_main__`` branch, in this process by main() before SGLang
starts. Must be run with ``-m`` exactly as above.
"""

from __future__ import annotations

import os
import sys

from hsq.engines.sglang import plugin
from hsq.engines.sglang.launch_args import check_launch_args

if __name__ == "__mp_main__":
    plugin.install_patches()  # a spawned child: before it unpickles its target


def main(argv: list[str]) -> int:
    problems = check_launch_args(argv)
    if not os.environ.get("SGLANG_HS_DUMP_DIR", "").strip():
        problems.append("SGLANG_HS_DUMP_DIR is unset: the server would dump nothing")
    if "--disable-radix-cache" not in argv:
        problems.insert(0, "--disable-radix-cache is required: cached prefixes are not dumped")
    if problems:
        for p in problems:
            print(f"hs_dump launcher: refusing to start: {p}", file=sys.stderr)
        return 2
    plugin.install_patches()  # still at the top level: main() is called from there
    from sglang.launch_server import run_server  # type: ignore[import-not-found,unused-ignore]
    from sglang.srt.server_args import (  # type: ignore[import-not-found,unused-ignore]
        prepare_server_args,
    )
    from sglang.srt.utils import (  # type: ignore[import-not-found,unused-ignore]
        kill_process_tree,
    )

    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
