"""`hsq run` with a stream (--spool-budget): the removal pass for files every consumer
group committed (a consumer killed between its commit and the removal leaves them to
whoever comes next: this loop, or the consumer's next commit), and the stream's lines in
the live view and the summary: spool bytes against the budget, the files consumed
(removed once every group committed them), delivered / committed / pending per group
(hsq.ops.status.stream_status, as `hsq status` shows them), the producer's paused share
(the workers' seconds held back by a full spool over their time) and each group's
data-wait share (its trainers' seconds blocked waiting for data over their time, written
with each commit). Each pass also finishes a reject a consumer was killed in the middle
of (queued again).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from hsq.errors import HsqError
from hsq.ops.status import stream_status
from hsq.runconfig import RunConfig, size_text
from hsq.runstore import RunStore, finish_rejects, remove_committed

EVERY_S = 10.0
LINGER_S = 60.0
"""How long a finished streamed run keeps its Redis for consumers still attached: the time
a trainer needs, after its last commit, to read the end of the stream (its DataLoader
workers included) and make its final commit. A consumer attached longer (a trainer that
keeps its dataset open while it exports) is not waited for."""


class StreamView:
    def __init__(self, store: RunStore, cfg: RunConfig, run_dir: Path) -> None:
        self.store = store
        self.cfg = cfg
        self.run_dir = run_dir
        self.t0 = time.monotonic()
        self._last = -EVERY_S
        self.removed = 0

    def tick(self) -> str | None:
        """Remove what every group committed; the stream's line every EVERY_S (None
        between, or while Redis cannot be read: the next tick tries again)."""
        try:
            self.removed += remove_committed(self.store, self.run_dir)
            finish_rejects(self.store, self.run_dir)  # a consumer killed mid-reject
        except HsqError:
            return None
        now = time.monotonic()
        if now - self._last < EVERY_S:
            return None
        self._last = now
        try:
            return self.line()
        except HsqError:
            return None

    def linger(self, say: Callable[[str], None], stop: Callable[[], bool]) -> None:
        """Everything is committed: before the Redis goes, give the consumers still attached
        up to LINGER_S to read the end (else each would wait for a Redis that never comes
        back). Returns at once when none is attached, or when `stop` says so."""
        try:
            if not self.all_committed():
                return  # the workers ended for another reason: nothing to wait for
        except HsqError:
            return
        deadline = time.monotonic() + LINGER_S
        said = False
        while not stop():
            try:
                n = self.store.spool.attached()
            except HsqError:
                return
            if n == 0 or time.monotonic() >= deadline:
                return
            if not said:
                say(f"stream   every sample committed; waiting up to {LINGER_S:.0f} s for "
                    f"{n} attached consumer connection(s) to read the end")  # fmt: skip
                said = True
            time.sleep(0.1)

    def paused_share(self) -> float:
        """The workers' seconds held back by a full spool over their time alive."""
        held = alive = 0.0
        for info in self.store.workers.workers_info().values():
            try:
                held += float(info.get("spool_paused_s", 0) or 0)
            except ValueError:
                continue
            alive += time.monotonic() - self.t0
        return held / alive if alive > 0 else 0.0

    def line(self) -> str:
        st = stream_status(self.store)
        if st is None:  # the run's record is gone (purged under us): nothing to show
            return "stream   the run's record is gone"
        groups = "  ".join(
            f"{g.name}: delivered {g.delivered} committed {g.committed} pending {g.pending}"
            for g in st.groups
        )
        removed = "" if st.keep_after_commit else f"  consumed {st.consumed}"
        waits = self.store.spool.consumer_waits()
        wait = "  ".join(f"{g} {100 * w['wait_share']:.0f}%" for g, w in sorted(waits.items()))
        return (
            f"stream   spool {size_text(st.spool_bytes)}/{size_text(st.budget)}"
            f"  published {st.published}{removed}  {groups}  producer paused "
            f"{100 * self.paused_share():.0f}%  consumer wait {wait or '-'}"
        )

    def all_committed(self) -> bool:
        """Every published sample committed by every group, and the removals settled."""
        spool = self.store.spool
        published = spool.published()
        every = all(g.committed >= published and g.pending == 0 for g in spool.groups())
        return every and spool.settled()

    def summary(self) -> str:
        spool = self.store.spool
        groups = spool.groups()
        published = spool.published()
        names = ", ".join(g.name for g in groups)
        if self.all_committed():
            kept = "files kept" if self.cfg.keep_after_commit else f"{spool.consumed()} consumed"
            return (
                f"stream   every sample committed by every group ({names}): {published} "
                f"published, {kept}"
            )
        return f"stream   not all committed: {self.line().removeprefix('stream   ')}"
