"""Fencing: a run's config holds a random `generation` made when the run is created. Every
write a worker makes (done-mark, finish, give-back, retry enqueue, dead letter, model pin,
worker heartbeat) is conditional on the generation this store read (Lua, or WATCH for RQ's
enqueue), so a purge, a Redis wipe or a re-created run is never written into by a worker
that holds the old one, and a purged done hash never comes back.

One Fence per store, shared by its aggregates: reading the config (hsq/store/config.py)
sets the generation it holds; the others' fenced writes present it.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from typing import Any

from hsq.errors import ConfigError, RunChangedError
from hsq.keys import RunKeys
from hsq.store.connection import Client


class Fence:
    def __init__(self, client: Client, run: str) -> None:
        self.client = client
        self.run = run
        try:
            self.keys = RunKeys(run)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self._token: str | None = None  # the generation as stored (JSON)
        self._reload: weakref.WeakMethod[Callable[[], object]] | None = None

    def reload_with(self, method: Callable[[], object]) -> None:
        """Reads the config (and so the generation) when none is held yet: set by the
        config aggregate. Held weakly: the aggregate holds this fence, and a cycle would
        leave the Redis client's sockets to the garbage collector (ResourceWarning)."""
        self._reload = weakref.WeakMethod(method)

    @property
    def generation(self) -> str | None:
        return None if self._token is None else json.loads(self._token)

    def hold(self, generation: str) -> None:
        """The generation the config just read holds."""
        self._token = json.dumps(generation)

    def token(self) -> str:
        """The generation to present, as stored; read first if none is held yet."""
        if self._token is None:
            reload = None if self._reload is None else self._reload()
            if reload is None:
                raise ConfigError(f"run {self.run!r}: no config was read")
            reload()
        assert self._token is not None
        return self._token

    def call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a fenced script (KEYS[1] the config, ARGV[1] the generation); its reply."""
        res = script(keys=[self.keys.config, *keys], args=[self.token(), *args])
        if res == -1:
            raise RunChangedError(
                f"run {self.run!r} was purged or re-created (generation {self.generation} "
                "is no longer current); re-read its config"
            )
        return res

    def count(self, script: Any, keys: list[str], args: list[Any]) -> int:
        return int(self.call(script, keys, args))

    def call_many(self, script: Any, keys: list[str], argss: list[list[Any]]) -> list[Any]:
        """The fenced script once per argument list, in one pipelined round trip (not a
        transaction: each call is atomic, as `call`'s); their replies in order."""
        pipe = self.client.pipeline(transaction=False)
        token = self.token()
        for args in argss:
            script(keys=[self.keys.config, *keys], args=[token, *args], client=pipe)
        replies = pipe.execute()
        if any(r == -1 for r in replies):
            raise RunChangedError(
                f"run {self.run!r} was purged or re-created (generation {self.generation} "
                "is no longer current); re-read its config"
            )
        return list(replies)


class Aggregate:
    """One aggregate of a run's store (config, queue, ledger, workers, lifecycle): the
    fence its writes present, and the Redis client and the run's keys it shares with the
    others."""

    def __init__(self, fence: Fence) -> None:
        self.fence = fence
        self.client = fence.client
        self.run = fence.run
        self.keys = fence.keys
