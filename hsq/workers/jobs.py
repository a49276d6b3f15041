"""The function RQ records for hsq's chunk jobs.

hsq's own worker (`hsq worker`) executes chunks; it needs a private dump dir and an
inference server, which a stock `rq worker` does not have. Naming a real function keeps the
jobs readable to RQ's tools (`rq info`, rq-dashboard) and makes a misdirected `rq worker`
fail loudly instead of doing something else.
"""

from __future__ import annotations

from typing import Any


def extract_chunk(**_kwargs: Any) -> None:
    raise RuntimeError("hsq chunk jobs run in `hsq worker`, not in `rq worker`")
