"""What `hsq launch-sglang` and `hsq launch-vllm` share: the flags both servers take and
what both hand to their launcher (hsq.engines.sglang.launch_sglang.run_checked,
hsq.engines.vllm.launch.run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click

from hsq.settings import setting
from hsq.states import ENCODINGS, PLAIN

PASS_ON = {"ignore_unknown_options": True, "allow_extra_args": True}
"""context_settings of a launch command: options it does not know go to the server."""


@dataclass(frozen=True)
class LaunchCommon:
    host: str = setting("127.0.0.1", help="address to listen on")
    tp: int = setting(1, help="tensor parallel size (GPUs of one server)")
    dump_encoding: str = setting(
        PLAIN,
        choices=ENCODINGS,
        help="fp8-e4m3: the server quantizes the states as fp8 outputs store them (for runs "
        "enqueued with --store-dtype fp8-e4m3)",
    )
    prenorm: bool = setting(False, help="also dump the final norm's input (runs with --prenorm)")
    print_only: bool = setting(False, help="print the command, start nothing")

    def launcher_args(self, ctx: click.Context) -> dict[str, Any]:
        """The launcher's keyword arguments these flags and the passed-on options make."""
        import shlex

        return {
            "host": self.host,
            "tp_size": self.tp,
            "encoding": self.dump_encoding,
            "prenorm": self.prenorm,
            "print_only": self.print_only,
            "extra": list(ctx.args),
            "echo": click.echo,
            "quote": shlex.join,
        }
