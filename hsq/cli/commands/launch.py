"""What `hsq launch-sglang` and `hsq launch-vllm` share on the command line (the flags
both launchers take are hsq.engines.launch.LaunchCommon)."""

from __future__ import annotations

PASS_ON = {"ignore_unknown_options": True, "allow_extra_args": True}
"""context_settings of a launch command: options it does not know go to the server."""
