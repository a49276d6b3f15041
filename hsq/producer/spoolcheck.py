"""A streamed run's byte budget against its largest sample, at enqueue: a budget that can
never hold the largest sample's output is refused before anything is written (one line,
exit 2, the bytes needed and the sample), wherever the run's bytes per token are known.

They are known when the layers and the hidden size are: given (`--layers`,
`--hidden-size`), pinned by the run's first valid dump (a re-enqueue, a raised budget), or
read off the model by `hsq run` before it starts a server (hsq.runconfig.ModelShape). The
bytes per token are RunConfig.spool_bytes_per_token's, the formula every worker reserves
by. Where they are not known, the enqueue says that the check happens at the first dump
(the worker then pauses with the cause `spool_too_small` and the bytes needed).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from hsq.errors import ConfigError
from hsq.runconfig import ModelShape, RunConfig, size_text


@dataclass(frozen=True)
class Longest:
    """The dataset's largest sample: its id and tokens."""

    sample_id: str
    tokens: int


def longest_of(valid: Iterable[tuple[str, str]], best: Longest | None) -> Longest | None:
    """The longer of `best` and the samples of a scan batch ((id, encoded index entry):
    the entry ends with the sample's tokens)."""
    for sid, entry in valid:
        n = int(entry.rpartition(":")[2])
        if best is None or n > best.tokens:
            best = Longest(sid, n)
    return best


@dataclass(frozen=True)
class SpoolCheck:
    """The run's budget with the layers and hidden size as best known before any dump."""

    sized: RunConfig
    """The run's config with the budget it will have and the layers and hidden size as
    given, pinned or read off the model (only for sizing: none of it is recorded)."""
    shape: ModelShape | None

    @property
    def budget(self) -> int:
        return self.sized.spool_budget or 0

    @property
    def per_token(self) -> int | None:
        return self.sized.spool_bytes_per_token()

    def needs_scan(self) -> bool:
        """The largest sample must be found first: the bytes per token are known and
        --max-tokens (if given) does not already bound every sample under the budget."""
        if self.per_token is None:
            return False
        bound = self.sized.max_tokens
        return bound is None or (self.sized.spool_estimate(bound) or 0) > self.budget

    def verdict(self, longest: Longest | None) -> str:
        """The enqueue's line on the budget; SpoolBudgetTooSmall when the largest sample
        cannot fit it."""
        budget = size_text(self.budget)
        if self.per_token is None:
            return (
                f"spool budget    {budget}, checked against each sample at the first dump "
                "(the run's hidden size and layers are not known yet: --hidden-size and "
                "--layers check it now)"
            )
        if longest is None:  # bounded by --max-tokens (needs_scan False), or no valid sample
            bound = self.sized.max_tokens or 0
            need = self.sized.spool_estimate(bound) or 0
            return (
                f"spool budget    {budget}: every sample fits (--max-tokens {bound} needs "
                f"{size_text(need)}; {self._per_token_words()})"
            )
        need = self.sized.spool_estimate(longest.tokens) or 0
        if need > self.budget:
            raise SpoolBudgetTooSmall(
                f"--spool-budget {self.budget} bytes is below the largest sample: "
                f"{longest.sample_id} ({longest.tokens} tokens) needs {need} bytes "
                f"({self._per_token_words()}); give --spool-budget {need} or more"
            )
        return (
            f"spool budget    {budget}: the largest sample, {longest.sample_id} "
            f"({longest.tokens} tokens), needs {size_text(need)} ({self._per_token_words()})"
        )

    def _per_token_words(self) -> str:
        s = self.sized
        layers = len(s.layer_ids or [])
        words = (
            f"{self.per_token} bytes a token: hidden size {s.hidden_size}, {layers} aux "
            f"layers, {s.store_dtype}" + (", pre-norm" if s.prenorm else "")
        )
        if self.shape is not None:
            words += f", as {self.shape.source} gives"
        return words


class SpoolBudgetTooSmall(ConfigError):
    """The budget can never hold the largest sample: refused at enqueue (exit 2)."""


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
