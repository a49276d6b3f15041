"""The run's config and the dataset index: creating and reading the config (which sets the
generation the store's fenced writes present), pinning what the first valid dump showed,
and the index of sample ids."""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import replace
from itertools import chain, islice
from typing import Any

from hsq.dataset.jsonl import IndexEntry
from hsq.errors import ConfigError
from hsq.runconfig import RunConfig
from hsq.store import scripts
from hsq.store.connection import (
    pack_per_key,
    packed_call,
    send_packed,
    send_packed_many,
    text,
    translate_public,
)
from hsq.store.fence import Aggregate, Fence
from hsq.store.jobs import AnyRef
from hsq.store.spool import create_groups


@translate_public
class ConfigIndex(Aggregate):
    def __init__(self, fence: Fence) -> None:
        super().__init__(fence)
        reg = self.client.register_script
        self._pin = reg(scripts.PIN)
        self._create = reg(scripts.CREATE)
        self._adopt = reg(scripts.ADOPT)
        fence.reload_with(self.require_config)

    def load_config(self) -> RunConfig | None:
        """The run's config (None if there is none); refreshes the generation we hold."""
        raw = self.client.hgetall(self.keys.config)
        if not raw:
            return None
        cfg = RunConfig.from_redis(raw)  # type: ignore[arg-type]
        if cfg.generation is None:
            # A run created before generations existed gets one now (once, atomically).
            self._adopt(keys=[self.keys.config], args=[json.dumps(secrets.token_hex(8))])
            return self.load_config()
        self.fence.hold(cfg.generation)
        return cfg

    def require_config(self) -> RunConfig:
        return required(self.load_config(), self.run)

    def create_config(self, cfg: RunConfig) -> tuple[RunConfig, bool]:
        """Record the run's config with a fresh generation unless one exists (atomic: of two
        concurrent creators one wins). Returns (the recorded config, whether we created it)."""
        fresh = replace(cfg, generation=secrets.token_hex(8))
        flat = [x for kv in fresh.to_redis().items() for x in kv]
        created = bool(self._create(keys=[self.keys.config, self.keys.stats], args=flat))
        recorded = self.require_config()
        create_groups(self.client, self.keys.ready, recorded.groups)  # a streamed run's
        return recorded, created

    def pin_model(self, model_id: str, layer_ids: list[int]) -> tuple[str, list[int]]:
        """Record the model and layers of the first valid dump (atomic HSETNX); return the
        recorded ones, so a worker behind a different model sees the mismatch."""
        self.fence.call(
            self._pin, [], ["model_id", json.dumps(model_id), "layer_ids", json.dumps(layer_ids)]
        )
        cfg = self.require_config()
        assert cfg.model_id is not None and cfg.layer_ids is not None
        return cfg.model_id, cfg.layer_ids

    def pin_dump_identity(
        self, model_id: str, layer_ids: list[int], dump_dtype: str, hidden_size: int
    ) -> dict[str, Any]:
        """Record what the first fully valid dump showed (model, layers, dtype, hidden size;
        each HSETNX, so the first worker wins) and return the recorded values by name."""
        values = {
            "model_id": model_id,
            "layer_ids": layer_ids,
            "dump_dtype": dump_dtype,
            "hidden_size": hidden_size,
        }
        pairs = [x for name, value in values.items() for x in (name, json.dumps(value))]
        self.fence.call(self._pin, [], pairs)  # never pins into a purged or re-created run
        recorded = self.client.hmget(self.keys.config, list(values))
        return {
            name: json.loads(raw) if raw is not None else None
            for name, raw in zip(values, recorded, strict=True)
        }

    # ------------------------------------------------------------------ the index
    def put_index(self, entries: Iterable[AnyRef], batch: int = 5000) -> int:
        n = 0
        it = iter(entries)
        while part := list(islice(it, batch)):
            # HSET's arguments, field, value, ...: flattened and packed in C (packed_call).
            args: list[Any] = list(chain.from_iterable(part))
            args[1::2] = [e if isinstance(e, str) else e.encode() for e in args[1::2]]
            packed_call(self.client, "HSET", self.keys.index, *args)
            n += len(part)
        return n

    def put_index_packed(self, packed: bytes) -> None:
        """An index HSET already packed (hsq.store.connection.pack) by the enqueue's
        scanning processes, on this run's index key (`keys.index`, the one they were given)."""
        send_packed(self.client, packed)

    def get_index(self, ids: list[str]) -> dict[str, IndexEntry]:
        if not ids:
            return {}
        vals = self.client.hmget(self.keys.index, ids)
        out: dict[str, IndexEntry] = {}
        for sid, v in zip(ids, vals, strict=True):
            if v:
                with contextlib.suppress(ValueError):  # a damaged entry counts as absent
                    out[sid] = IndexEntry.decode(v)
        return out

    def presence(self, ids: list[str]) -> tuple[list[str | None], list[bool], list[bool]]:
        """For each id: its index entry as stored (None: not indexed), done, in the dead
        letter (three HMGETs, one trip)."""
        if not ids:
            return [], [], []
        keys = (self.keys.index, self.keys.done, self.keys.dead)
        index, done, dead = send_packed_many(self.client, pack_per_key("HMGET", keys, ids))
        return (
            [None if v is None else text(v) for v in index],
            [v is not None for v in done],
            [v is not None for v in dead],
        )

    def iter_hash_keys(self, key: str) -> Iterator[str]:
        # HSCAN NOVALUES needs Redis 7.4; values are small here.
        for field, _ in self.client.hscan_iter(key, count=10000):
            yield text(field)

    def count(self, key: str) -> int:
        return int(self.client.hlen(key))


def required(cfg: RunConfig | None, run: str) -> RunConfig:
    """The config a store read, or ConfigError: the run does not exist."""
    if cfg is None:
        raise ConfigError(f"run {run!r} does not exist (run `hsq enqueue` first)")
    return cfg
