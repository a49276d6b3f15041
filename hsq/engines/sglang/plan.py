"""The batch plan: which rows of a prefill forward belong to which request.

Built in ``Scheduler.run_batch`` from the batch as it is launched. With the overlap
scheduler the request objects already describe the next chunk by the time results are
processed, so lengths are snapshotted here, before the forward, and never read later.
"""

from __future__ import annotations

import re
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from typing import Protocol

HEALTH_CHECK_PREFIX = "HEALTH_CHECK"
# Requests sent without a rid (SGLang's own startup warm-up among them) get uuid4().hex.
_AUTO_RID = re.compile(r"^[0-9a-f]{32}$")


class ReqLike(Protocol):
    """The two fields of SGLang's ``Req`` the plan reads."""

    @property
    def rid(self) -> str: ...

    @property
    def origin_input_ids(self) -> Sized: ...


@dataclass(frozen=True)
class PlanEntry:
    rid: str
    row_offset: int
    """First row of this request in the forward's [T_batch, ...] tensors."""
    prefix_len: int
    """Tokens of the request already computed (earlier chunks): rows start at this position."""
    extend_len: int
    """Rows this forward computes for the request."""
    total_len: int
    """len(origin_input_ids): the request is complete when prefix + extend reaches it."""

    @property
    def rows(self) -> slice:
        return slice(self.row_offset, self.row_offset + self.extend_len)

    @property
    def is_last(self) -> bool:
        return self.prefix_len + self.extend_len == self.total_len


@dataclass(frozen=True)
class BatchPlan:
    entries: tuple[PlanEntry, ...]
    num_rows: int
    """Rows the forward must have: the sum of every request's extend length."""


@dataclass(frozen=True)
class RidFilter:
    """Which requests are dumped: never health checks or rid-less (warm-up) requests."""

    prefix: str = ""

    def wants(self, rid: str) -> bool:
        if rid.startswith(HEALTH_CHECK_PREFIX) or _AUTO_RID.match(rid):
            return False
        return rid.startswith(self.prefix)


def build_plan(
    reqs: Sequence[ReqLike],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    rid_filter: RidFilter,
    *,
    skip: Sequence[bool] | None = None,
) -> BatchPlan | None:
    """The plan of one extend batch, or None when no request in it is to be dumped.

    Rows are laid out request after request in batch order. ``skip`` marks requests to
    leave out but still count rows for (SGLang aborted them before the forward). Rows
    past a request's prompt (a decode row in a mixed batch) are not prompt states.
    """
    if not len(reqs) == len(prefix_lens) == len(extend_lens):
        raise ValueError(
            f"batch has {len(reqs)} requests, {len(prefix_lens)} prefix and "
            f"{len(extend_lens)} extend lengths"
        )
    entries: list[PlanEntry] = []
    offset = 0
    for i, (req, pre, ext) in enumerate(zip(reqs, prefix_lens, extend_lens, strict=True)):
        total = len(req.origin_input_ids)
        rid = str(req.rid)
        if (
            not (skip is not None and skip[i])
            and ext > 0
            and pre + ext <= total
            and rid_filter.wants(rid)
        ):
            entries.append(PlanEntry(rid, offset, int(pre), int(ext), total))
        offset += int(ext)
    return BatchPlan(tuple(entries), offset) if entries else None
