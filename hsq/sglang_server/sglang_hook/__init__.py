"""Hidden-state dumps from stock SGLang (no fork): a plugin for 0.5.11+, a launcher before.

Everything but plugin.py and legacy_launch.py is plain Python and torch, tested on a CPU.
docs/sglang.md says how to use it and what has and has not been verified.
"""

from hsq.sglang_server.sglang_hook.compat import PINNED_VERSIONS
from hsq.sglang_server.sglang_hook.config import HookConfig
from hsq.sglang_server.sglang_hook.launch_args import (
    check_launch_args,
    check_server_info,
    launch_command,
)
from hsq.sglang_server.sglang_hook.layers import effective_layer_ids

__all__ = [
    "PINNED_VERSIONS",
    "HookConfig",
    "check_launch_args",
    "check_server_info",
    "effective_layer_ids",
    "launch_command",
]
