"""Fault injection: the failure modes real extraction runs produced, on demand.

Pure logic, no I/O: the engine asks the plan which fault (if any) applies to a request.

Modes (per request):
  stale        the dump carries the previous request's rid, fingerprint and states
  split        two dumps for one request (as chunked prefill can produce)
  no_done      a req_<N>/ that never gets its `done` marker
  wrong_count  the dump is one token short (what a radix-cache hit does)
  nan          the hidden states contain NaN
  corrupt      the tensor file is garbage
  crash        the server process dies mid-request, leaving a partial req_<N>.tmp/
  slow         the request sleeps `seconds` before answering
  http_500     the server answers 500 without dumping
  mix          in a batched forward (--max-batch-requests > 1), the request's dump gets the
               states of another request of the same length in the batch (its own rid,
               fingerprint and count on someone else's tensors: every metadata check
               passes; only `hsq audit` finds it). Alone in its batch it is unaffected
  mix_prenorm  as `mix`, but only `last_hidden_state_prenorm` (and its scale) is another
               request's: the tensor `--format speculators` trains on (needs --prenorm)
The counter offset of warm-ups is a start-up option (--counter-start, --warmup).

A rule: MODE[:key=value,...] with keys `times` (apply to the next N matching requests;
default: every one), `prob` (probability per request, seeded), `fingerprint` (only the
request with this input fingerprint: a fault that follows one sample), `seconds` (slow).
"""

from __future__ import annotations

import random
import threading
from dataclasses import asdict, dataclass
from typing import Any

from hsq.errors import ConfigError

MODES = (
    "stale",
    "split",
    "no_done",
    "wrong_count",
    "nan",
    "corrupt",
    "crash",
    "slow",
    "http_500",
    "mix",
    "mix_prenorm",
)
MIXING = ("mix", "mix_prenorm")


@dataclass
class FaultRule:
    mode: str
    times: int | None = None
    prob: float | None = None
    fingerprint: str | None = None
    seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown fault mode {self.mode!r}; known: {', '.join(MODES)}")
        if self.times is not None and self.times < 0:
            raise ConfigError("fault `times` must be >= 0")
        if self.prob is not None and not 0.0 <= self.prob <= 1.0:
            raise ConfigError("fault `prob` must be within [0, 1]")
        if self.seconds < 0:
            raise ConfigError("fault `seconds` must be >= 0")

    @classmethod
    def parse(cls, text: str) -> FaultRule:
        """Parse `MODE[:key=value,...]`, e.g. `slow:seconds=2,prob=0.1`."""
        mode, _, rest = text.strip().partition(":")
        kwargs: dict[str, Any] = {}
        for part in filter(None, rest.split(",")):
            key, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(f"fault option {part!r} is not key=value")
            kwargs[key.strip()] = value.strip()
        return cls.from_dict({"mode": mode, **kwargs})

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FaultRule:
        casts = {"times": int, "prob": float, "seconds": float, "fingerprint": str, "mode": str}
        unknown = set(raw) - set(casts)
        if unknown:
            raise ConfigError(f"unknown fault option(s): {', '.join(sorted(unknown))}")
        try:
            args = {k: (None if v is None else casts[k](v)) for k, v in raw.items()}
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad fault option value: {exc}") from exc
        if "mode" not in args:
            raise ConfigError("a fault rule needs a mode")
        return cls(**args)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FaultPlan:
    """The active rules; the first rule that matches a request decides its fault."""

    def __init__(self, rules: list[FaultRule] | None = None, seed: int = 0) -> None:
        self._rules = list(rules or [])
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def replace(self, rules: list[FaultRule]) -> None:
        with self._lock:
            self._rules = list(rules)

    def rules(self) -> list[FaultRule]:
        with self._lock:
            return [FaultRule(**r.to_dict()) for r in self._rules]

    def pick(self, input_fingerprint: str) -> FaultRule | None:
        with self._lock:
            for rule in self._rules:
                if rule.fingerprint is not None and rule.fingerprint != input_fingerprint:
                    continue
                if rule.times is not None and rule.times <= 0:
                    continue
                if rule.prob is not None and self._rng.random() >= rule.prob:
                    continue
                if rule.times is not None:
                    rule.times -= 1
                return FaultRule(**rule.to_dict())
            return None


def mix_sources(lengths: list[int], mixing: list[bool]) -> list[int]:
    """For each request of a batch, the request whose states its dump gets: its own, or
    with the `mix` fault the next request of the same length in the batch (cyclically),
    so B's dump holds A's states, C's B's, ..., and every check on metadata passes."""
    sources = list(range(len(lengths)))
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        for j, i in enumerate(members):
            if mixing[i]:
                sources[i] = members[(j + 1) % len(members)]
    return sources
