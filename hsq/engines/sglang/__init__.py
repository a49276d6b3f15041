"""Hidden-state dumps from stock SGLang (no fork): a plugin for 0.5.11+, a launcher before.

Everything but plugin.py and legacy_launch.py is plain Python and torch, tested on a CPU.
docs/sglang.md says how to use it and what has and has not been verified.
"""

from hsq.engines.sglang.compat import PINNED_VERSIONS
from hsq.engines.sglang.config import HookConfig
from hsq.engines.sglang.launch_args import check_launch_args, check_server_info, launch_command
from hsq.engines.sglang.layers import effective_layer_ids

__all__ = [
    "PINNED_VERSIONS",
    "HookConfig",
    "check_launch_args",
    "check_server_info",
    "effective_layer_ids",
    "launch_command",
]
