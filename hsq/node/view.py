"""`hsq run`'s live view: the run's figures (hsq/ops/status.py, as `hsq status` shows
them) with this node's servers beside their workers.

Pure: `render` and `log_line` turn a RunStatus and the pairs' states into text; `Screen`
puts it on a terminal in place, or as plain lines when stdout is not one.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from hsq.ops.status import RunStatus, WorkerStatus


@dataclass(frozen=True)
class PairView:
    """One server and its worker, as the supervisor sees them."""

    index: int
    kind: str
    url: str
    server_state: str
    worker_name: str
    worker_rc: int | None
    stopped: bool = False
    """The worker was told to stop (Ctrl-C, its server given up): exit 0 is not `finished`."""
    worker_seen: bool = False
    """Its record was in Redis once: without one now it is ending, not `starting`."""


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _token(text: str) -> str:
    """`text` as one word of a key=value line ("exited 1, given up" -> "exited-1-given-up")."""
    return re.sub(r"[^\w.]+", "-", text).strip("-")


def _cause(w: WorkerStatus) -> str:
    # `hsq status` names causes (server down since T, disk full) where it knows them; the
    # field is optional so this view works with the status of any version.
    cause = getattr(w, "cause_text", None) or getattr(w, "cause", None)
    return f" ({cause})" if cause else ""


def _ended(p: PairView) -> str:
    if p.worker_rc == 0:
        return "stopped" if p.stopped else "finished"
    return f"exited {p.worker_rc}"


def _worker_text(w: WorkerStatus | None, p: PairView | None) -> str:
    if p is not None and p.worker_rc is not None:
        return _ended(p)
    if w is None:
        if p is not None and p.worker_seen:
            return "[stopping]" if p.stopped else "[ending]"
        return "[starting]"
    return f"[{w.state}]{_cause(w)} done {w.done}, {w.tokens_per_s:,.0f} tokens/s" + (
        f", last {w.last_sample}" if w.last_sample else ""
    )


WIDE = 110
"""Columns from which a server and its worker share one line (narrower: two lines)."""


def render(
    st: RunStatus, pairs: Sequence[PairView], elapsed_s: float, width: int = 10_000
) -> list[str]:
    """The view's lines, none wider than `width` (a longer one is cut: a line that wraps
    would break the redraw in place, which counts lines)."""
    pct = 100.0 * st.done / (st.total or 1)
    lines = [
        f"run {st.run}: {st.done}/{st.total} done ({pct:.1f}%), dead {st.dead}, "
        f"{st.tokens_per_s:,.0f} tokens/s, ETA {duration(st.eta_s)}, "
        f"elapsed {duration(elapsed_s)}",
        f"  queued {st.queued}  in progress {st.in_progress}  retry {st.retry}  "
        f"missing {st.missing}",
    ]
    if st.dead_by_reason:
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(st.dead_by_reason.items()))
        lines.append(f"  dead by reason: {reasons}")
    by_name = {w.name: w for w in st.workers if w.name}
    ours = {p.worker_name for p in pairs}
    names = max((len(p.worker_name) for p in pairs), default=0)
    for p in pairs:
        w = by_name.get(p.worker_name)
        server = f"server {p.index} {p.kind} {p.url} [{p.server_state}]"
        worker = f"worker {p.worker_name:<{names}} {_worker_text(w, p)}"
        if width >= WIDE:
            lines.append(f"  {server:<52} {worker}")
        else:
            lines += [f"  {server}", f"    {worker}"]
    others = [w for w in st.workers if w.name not in ours]
    for w in others:
        lines.append(f"  (another node) worker {w.name or w.id} {_worker_text(w, None)}")
    return [fit(line, width) for line in lines]


def fit(line: str, width: int) -> str:
    """`line` cut to `width` columns, its end marked."""
    return line if len(line) <= width else line[: max(width - 3, 0)] + "..."


def log_line(st: RunStatus, pairs: Sequence[PairView], elapsed_s: float) -> str:
    """The plain progress line written when stdout is not a terminal."""
    by_name = {w.name: w for w in st.workers if w.name}
    states = []
    for p in pairs:
        w = by_name.get(p.worker_name)
        if p.worker_rc is not None:
            state = _ended(p).replace(" ", "-")
        else:
            state = (w.state or "?") if w is not None else "starting"
            if p.server_state != "up":  # a worker waiting on its server: the server says why
                state += f"(server-{_token(p.server_state)})"
        states.append(f"{p.worker_name}={state}{_cause(w) if w else ''}")
    dead = ",".join(f"{r}:{n}" for r, n in sorted(st.dead_by_reason.items())) or "-"
    return (
        f"progress run={st.run} done={st.done}/{st.total} dead={st.dead} dead_by_reason={dead} "
        f"tokens_per_s={st.tokens_per_s:.0f} eta={duration(st.eta_s)} "
        f"elapsed={duration(elapsed_s)} workers {' '.join(states)}"
    )


class Screen:
    """The live view on a terminal (redrawn in place), else a line every `every_s`."""

    def __init__(self, out: TextIO = sys.stdout, *, every_s: float = 10.0) -> None:
        self.out = out
        self.tty = out.isatty()
        self.every_s = every_s
        self._drawn = 0
        self._last_line_at: float | None = None

    def _clear(self) -> None:
        if self._drawn:
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def event(self, text: str) -> None:
        """A line that stays (a restart, a dead child), printed above the view."""
        self._clear()
        self.out.write(text + "\n")
        self.out.flush()

    def show(
        self,
        st: RunStatus,
        pairs: Sequence[PairView],
        elapsed_s: float,
        *,
        final: bool = False,
        extra: Sequence[str] = (),
    ) -> None:
        """`extra`: more lines of the view on a terminal (a streamed run's), cut as its own."""
        if self.tty:
            self._clear()
            # One column spare: a line that fills the last column leaves the cursor there
            # on some terminals, and the next line would count twice.
            width = shutil.get_terminal_size().columns - 1
            lines = render(st, pairs, elapsed_s, width) + [fit(x, width) for x in extra]
            self.out.write("\n".join(lines) + "\n")
            self._drawn = 0 if final else len(lines)
        elif final or self._last_line_at is None or elapsed_s - self._last_line_at >= self.every_s:
            self._last_line_at = elapsed_s
            self.out.write(log_line(st, pairs, elapsed_s) + "\n")
        self.out.flush()
