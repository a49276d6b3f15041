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
from hsq.ops.status import StreamStatus, stream_status
from hsq.runconfig import RunConfig, size_text
from hsq.runstore import RunStore, finish_rejects, remove_committed

EVERY_S = 10.0
"""How often a log (stdout not a terminal) gets the stream's line."""
FRAME_S = 2.0
"""How often the live view on a terminal reads the stream's figures again (a few Redis
calls each: the view itself redraws every half second)."""
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
        self._frame: list[str] = []
        self._frame_at = -FRAME_S
        self._paused = 0.0
        self.removed = 0

    def tick(self, *, log: bool = True) -> str | None:
        """Remove what every group committed; with `log`, the stream's line every EVERY_S
        (None between, or while Redis cannot be read: the next tick tries again). A view
        on a terminal shows `frame()` instead."""
        try:
            self.removed += remove_committed(self.store, self.run_dir)
            finish_rejects(self.store, self.run_dir)  # a consumer killed mid-reject
        except HsqError:
            return None
        now = time.monotonic()
        if not log or now - self._last < EVERY_S:
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
        """The workers' seconds held back by a full spool over their time alive. Once no
        worker's record is left (they ended), the last share seen: not 0."""
        held = alive = 0.0
        for info in self.store.workers.workers_info().values():
            try:
                held += float(info.get("spool_paused_s", 0) or 0)
            except ValueError:
                continue
            alive += time.monotonic() - self.t0
        if alive > 0:
            self._paused = held / alive
        return self._paused

    def _figures(self) -> tuple[StreamStatus, dict[str, float], float] | None:
        """The stream's status, each group's data-wait share, the producer's paused share
        (None: the run's record is gone, purged under us)."""
        st = stream_status(self.store)
        if st is None:
            return None
        waits = {g: w["wait_share"] for g, w in self.store.spool.consumer_waits().items()}
        return st, waits, self.paused_share()

    def line(self) -> str:
        """The stream in one line: the log's (stdout not a terminal) and the summary's."""
        figures = self._figures()
        if figures is None:
            return "stream   the run's record is gone"
        st, waits, paused = figures
        groups = "  ".join(
            f"{g.name}: delivered {g.delivered} committed {g.committed} pending {g.pending}"
            for g in st.groups
        )
        removed = "" if st.keep_after_commit else f"  consumed {st.consumed}"
        wait = "  ".join(f"{g} {100 * w:.0f}%" for g, w in sorted(waits.items()))
        return (
            f"stream   spool {size_text(st.spool_bytes)}/{size_text(st.budget)}"
            f"  published {st.published}{removed}  {groups}  producer paused "
            f"{100 * paused:.0f}%  consumer wait {wait or '-'}"
        )

    def frame(self, *, fresh: bool = False) -> list[str]:
        """The stream's lines in the live view on a terminal, redrawn with it: one for the
        spool and the producer, one a group (a single line would be cut at 80 columns,
        losing the two tuning signals at its end). Read again every FRAME_S (`fresh`: now,
        for the view's last draw); while Redis cannot be read, the last lines read."""
        now = time.monotonic()
        if not fresh and now - self._frame_at < FRAME_S:
            return self._frame
        self._frame_at = now
        try:
            figures = self._figures()
        except HsqError:
            return self._frame
        if figures is None:
            self._frame = ["  stream: the run's record is gone"]
            return self._frame
        st, waits, paused = figures
        consumed = "" if st.keep_after_commit else f", consumed {st.consumed}"
        self._frame = [
            f"  stream: spool {size_text(st.spool_bytes)}/{size_text(st.budget)}, "
            f"published {st.published}{consumed}, producer paused {100 * paused:.0f}%"
        ]
        for g in st.groups:
            wait = f", data wait {100 * waits[g.name]:.0f}%" if g.name in waits else ""
            self._frame.append(
                f"    group {g.name}: delivered {g.delivered}, committed {g.committed}, "
                f"pending {g.pending}{wait}"
            )
        return self._frame

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
