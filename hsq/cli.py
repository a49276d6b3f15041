"""The old home of the `hsq` command, kept for console scripts installed before the shell
moved to hsq/app/ (an editable install's `bin/hsq` imports `hsq.cli:main` until it is
reinstalled). Part of the shell, not of the contracts: nothing else imports it."""

from hsq.app.cli import main

__all__ = ["main"]
