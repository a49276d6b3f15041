"""Run watching: is the run this worker writes for still the one it read?

A run purged (FLUSHALL, `hsq purge`) or re-created under a running worker is *changed*:
the worker drops its in-flight work without marking anything and reads the run again
(:meth:`RunWatch.reload`). Fenced writes tell a busy worker (RunChangedError); an idle one
writes nothing, so it looks now and then (:meth:`RunWatch.check`). A config rewritten
without a new generation (another output dir, dataset or creation time) is refused: the
worker stops without writing anything more (exit 2).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from hsq.errors import ConfigError
from hsq.runconfig import RunConfig
from hsq.workers.policy import STORE_DOWN_OR_RUN_CHANGED, backoff
from hsq.workers.runview import RunView

log = structlog.get_logger("hsq.worker")


class ConfigSource(Protocol):
    def load_config(self) -> RunConfig | None: ...

    def require_config(self) -> RunConfig: ...


@dataclass(eq=False)
class RunWatch:
    run: str
    store: ConfigSource
    stop: threading.Event
    request_stop: Callable[[], None]
    backoff_max_s: float
    changed: str | None = field(default=None, init=False)
    """Why the run is not the one read (purged, re-created); None while it is."""
    refused: str | None = field(default=None, init=False)
    """Why the worker stops: the config changed where only a new generation may."""

    def note_changed(self, why: str) -> None:
        self.changed = self.changed or why

    def check(self, cfg: RunConfig) -> None:
        """An idle worker writes nothing, so no fenced write tells it the run is gone
        (FLUSHALL, purge) or was re-created: look now and then. ``cfg``: the one in use."""
        try:
            now = self.store.load_config()
        except (TypeError, ValueError) as exc:  # a hash holding only pins, or garbage
            self.note_changed(f"the run's config is unreadable: {exc}")
            return
        if now is None:
            self.note_changed("the run's config is gone from Redis")
        elif tampered := config_tampered(cfg, now):
            self.refuse(tampered)
        elif (now.created, now.out, now.dataset) != (cfg.created, cfg.out, cfg.dataset):
            self.note_changed("the run's config was re-created")

    def reload(self, old: RunView) -> RunView | None:
        """Read the changed run again (waiting while it is gone); the new view, or None
        if the worker is stopping or refuses the new config. In-flight work is settled."""
        n = 0
        while not self.stop.is_set():
            try:
                cfg = self.store.require_config()
                break
            except ConfigError as exc:
                n += 1
                log.error("run_gone_waiting", run=self.run, error=str(exc), attempt=n)
            except STORE_DOWN_OR_RUN_CHANGED as exc:
                n += 1
                log.error("run_reload_failed", run=self.run, error=str(exc), attempt=n)
            self.stop.wait(backoff(n, base=1.0, cap=self.backoff_max_s))
        else:
            return None
        if tampered := config_tampered(old.cfg, cfg):
            self.refuse(tampered)
            return None
        view = RunView.of(cfg, self.run)
        view.out_root.mkdir(parents=True, exist_ok=True)
        self.changed = None
        log.warning("run_config_reloaded", run=self.run, out=str(view.out_root))
        return view

    def refuse(self, why: str) -> None:
        """Stop without writing anything more: the run's config changed where only a new
        run (a new generation) may change it. Exit code 2; in-flight work is handed back."""
        if self.refused is None:
            log.error("run_config_changed_refused", run=self.run, why=why)
            self.refused = why
        self.request_stop()


def config_tampered(old: RunConfig, new: RunConfig) -> str | None:
    """Why `new` cannot be the same run as `old`: its output dir, dataset or creation time
    changed but its generation did not. Only a re-created run (a new generation: purge and
    enqueue) may change them; anything else is someone rewriting the config under running
    workers (a worker then wrote to the rewriter's path)."""
    if old.generation is None or new.generation != old.generation:
        return None  # a re-created run; None: no generation to judge by (never from RunStore)
    changed = [
        f"{name} {getattr(old, name)!r} -> {getattr(new, name)!r}"
        for name in ("out", "dataset", "created")
        if getattr(old, name) != getattr(new, name)
    ]
    if not changed:
        return None
    return (
        "the run's config changed without a new generation (" + "; ".join(changed) + "): "
        "refusing to write anywhere else; re-create the run (hsq purge, hsq enqueue) to move it"
    )
