"""A sliding-window rate (samples/s, tokens/s) over recent completions; pure logic."""

from __future__ import annotations

import threading
import time
from collections import deque


class RateWindow:
    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self._started = time.monotonic()

    def add(self, tokens: int, now: float | None = None) -> None:
        with self._lock:
            self._events.append((time.monotonic() if now is None else now, tokens))

    def rates(self, now: float | None = None) -> tuple[float, float]:
        """(samples/s, tokens/s) over the window, or since start if that is shorter."""
        t = time.monotonic() if now is None else now
        with self._lock:
            while self._events and self._events[0][0] < t - self.window_s:
                self._events.popleft()
            span = min(self.window_s, max(t - self._started, 1e-9))
            n = len(self._events)
            tokens = sum(tok for _, tok in self._events)
        return n / span, tokens / span
