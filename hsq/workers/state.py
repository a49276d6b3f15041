"""The worker's state: one of a few names that `hsq status`, the worker's record in Redis
and the hsq_worker_state metric show (docs/operations.md); the values are those strings."""

from __future__ import annotations

import enum
from collections.abc import Callable


class WorkerState(enum.Enum):
    STARTING = "starting"
    WORKING = "working"
    IDLE = "idle"
    SERVER_DOWN = "server_down"
    BACKING_OFF = "backing_off"
    STOPPING = "stopping"


class StateCell:
    """The current state; ``on_change`` hears each change (not a repeat of the same)."""

    def __init__(self, on_change: Callable[[WorkerState], None]) -> None:
        self.current = WorkerState.STARTING
        self._on_change = on_change

    def set(self, state: WorkerState) -> None:
        if state is not self.current:
            self.current = state
            self._on_change(state)
