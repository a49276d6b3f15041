"""A streamed run's byte budget against its largest sample, at enqueue: a budget that can
never hold a sample still to extract is refused before anything is written (one line,
exit 2, the bytes needed and the sample), wherever the run's bytes per token are known.

They are known when the layers and the hidden size are: given (`--layers`,
`--hidden-size`), pinned by the run's first valid dump (a re-enqueue, a raised budget), or
read off the model by `hsq run` before it starts a server (hsq.runconfig.ModelShape). The
bytes per token are RunConfig.spool_bytes_per_token's, the formula every worker reserves
by. Where they are not known, the enqueue says that the check happens at the first dump
(the worker then pauses with the cause `spool_too_small` and the bytes needed).

Samples already done or dead are not held against the budget: they are not extracted
again (the first sample of a run, of unknown size, goes alone whatever its size, so a run
can be done with a sample larger than its budget; resuming it must not be refused).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hsq.errors import ConfigError
from hsq.runconfig import ModelShape, RunConfig, size_text

Settled = Callable[[list[str]], list[bool]]
"""For each sample id: done or dead already (an existing run's), so not extracted again."""


@dataclass(frozen=True)
class Longest:
    """A sample and its tokens."""

    sample_id: str
    tokens: int


@dataclass
class Found:
    """What the enqueue's first pass found, batch by batch (SpoolCheck.take)."""

    longest: Longest | None = None
    """The dataset's largest sample."""
    over: Longest | None = None
    """The largest sample still to extract whose output the budget cannot hold."""
    over_settled: int = 0
    """Samples the budget cannot hold that are done or dead already."""


class SpoolBudgetTooSmall(ConfigError):
    """The budget can never hold a sample still to extract: refused at enqueue (exit 2)."""


@dataclass(frozen=True)
class SpoolCheck:
    """The run's budget with the layers and hidden size as best known before any dump."""

    sized: RunConfig
    """The run's config with the budget it will have and the layers and hidden size as
    given, pinned or read off the model (only for sizing: none of it is recorded)."""
    shape: ModelShape | None
    """The model's shape when it gave the layers or hidden size (named in the messages)."""

    @property
    def budget(self) -> int:
        return self.sized.spool_budget or 0

    @property
    def per_token(self) -> int | None:
        return self.sized.spool_bytes_per_token()

    def need(self, tokens: int) -> int:
        return self.sized.spool_estimate(tokens) or 0

    def fits_tokens(self) -> int:
        """The most tokens a sample may have and fit the budget (the reservation is
        monotonic in the tokens: found by bisection, no second formula)."""
        lo, hi = 0, 1
        while self.need(hi) <= self.budget:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.need(mid) <= self.budget else (lo, mid)
        return lo

    def needs_scan(self) -> bool:
        """The dataset must be scanned first: the bytes per token are known and --max-tokens
        (if given) does not already bound every sample under the budget."""
        if self.per_token is None:
            return False
        bound = self.sized.max_tokens
        return bound is None or self.need(bound) > self.budget

    def take(
        self, valid: Sequence[tuple[str, str]], found: Found, settled: Settled | None, limit: int
    ) -> None:
        """Add a scan batch ((id, encoded index entry): the entry ends with the tokens) to
        `found`; `limit`: fits_tokens(); `settled`: an existing run's done-or-dead look, for
        the samples above the limit only."""
        over: list[Longest] = []
        for sid, entry in valid:
            n = int(entry.rpartition(":")[2])
            if found.longest is None or n > found.longest.tokens:
                found.longest = Longest(sid, n)
            if n > limit:
                over.append(Longest(sid, n))
        if over and settled is not None:
            flags = settled([o.sample_id for o in over])
            found.over_settled += sum(flags)
            over = [o for o, gone in zip(over, flags, strict=True) if not gone]
        for o in over:
            if found.over is None or o.tokens > found.over.tokens:
                found.over = o

    def verdict(self, found: Found | None) -> str:
        """The enqueue's line on the budget (found None: not scanned); SpoolBudgetTooSmall
        when a sample still to extract cannot fit it."""
        budget = size_text(self.budget)
        if self.per_token is None:
            return (
                f"spool budget    {budget}, checked against each sample at the first dump "
                "(the run's hidden size and layers are not known yet: --hidden-size and "
                "--layers check it now)"
            )
        if found is None or found.longest is None:  # bounded by --max-tokens
            bound = self.sized.max_tokens or 0
            return (
                f"spool budget    {budget}: every sample fits (--max-tokens {bound} needs "
                f"{size_text(self.need(bound))}; {self._per_token_words()})"
            )
        if found.over is not None:
            o = found.over
            raise SpoolBudgetTooSmall(
                f"--spool-budget {self.budget} bytes is below the largest sample: "
                f"{o.sample_id} ({o.tokens} tokens) needs {self.need(o.tokens)} bytes "
                f"({self._per_token_words()}); give --spool-budget {self.need(o.tokens)} or more"
            )
        top = found.longest
        said = f"{top.sample_id} ({top.tokens} tokens), needs {size_text(self.need(top.tokens))}"
        if found.over_settled:
            return (
                f"spool budget    {budget}: every sample left fits; the {found.over_settled} "
                f"larger are done or dead already (the largest, {said})"
            )
        return f"spool budget    {budget}: the largest sample, {said} ({self._per_token_words()})"

    def _per_token_words(self) -> str:
        s = self.sized
        words = (
            f"{self.per_token} bytes a token: hidden size {s.hidden_size}, "
            f"{len(s.layer_ids or [])} aux layers, {s.store_dtype}"
            + (", pre-norm" if s.prenorm else "")
        )
        return words + (f", as {self.shape.source} gives" if self.shape is not None else "")


def spool_check(
    cfg: RunConfig, existing: RunConfig | None, shape: ModelShape | None
) -> SpoolCheck | None:
    """The check of a streamed run (None: not streamed). The budget is the one given, or
    the run's; the layers and hidden size are the given ones, else the run's pins, else
    the model's shape (`hsq run`)."""
    budget = cfg.spool_budget or (existing.spool_budget if existing is not None else None)
    if not budget:
        return None
    layers = cfg.layer_ids or (existing.layer_ids if existing is not None else None)
    hidden = cfg.hidden_size or (existing.hidden_size if existing is not None else None)
    used = shape is not None and (layers is None or hidden is None)
    if shape is not None:
        layers = layers or shape.layer_ids
        hidden = hidden or shape.hidden_size
    sized = replace(cfg, spool_budget=budget, layer_ids=layers, hidden_size=hidden)
    return SpoolCheck(sized, shape if used else None)
