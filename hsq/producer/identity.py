"""A run's identity for `hsq recover`: the model and effective layers its files must hold,
and the dtype of their states (decide_states_dtype).

Never taken from one file (one stale file of an earlier model once decided a whole
run's identity). In order: the run's recorded pins; else what
was given (`--model-id`, `--layers`); else what the run's servers announce in their
readiness markers (`--server-dump-dir`, which must agree); else what most valid files hold
(a tie is refused). Each part is decided separately, so a model given alone picks among
the files of that model. A given value that contradicts a recorded pin is refused, never
ignored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hsq.dump.ready import read_ready
from hsq.errors import ConfigError
from hsq.runconfig import RunConfig

Identity = tuple[str, list[int]]
"""A run's model id and effective layer ids."""


@dataclass(frozen=True)
class IdentityHint:
    """What recover is told about the run's identity besides the files."""

    model_id: str | None = None
    """Given (--model-id)."""
    layer_ids: list[int] | None = None
    """Given (--layers)."""
    announced: Identity | None = None
    """What the run's servers announce in their readiness markers (--server-dump-dir)."""


def announced_identity(dump_dirs: Iterable[Path]) -> Identity | None:
    """The model and layers the readiness markers in these dump dirs announce (they must
    agree); None without dirs."""
    seen: dict[tuple[str, tuple[int, ...]], Path] = {}
    for d in dump_dirs:
        marker = read_ready(d)
        if marker is None:
            raise ConfigError(f"--server-dump-dir {d} holds no readiness marker (hsq-ready.json)")
        seen.setdefault((marker.model.model_id, tuple(marker.layer_ids)), d)
    if len(seen) > 1:
        said = "; ".join(f"{d}: {m} layers {list(ls)}" for (m, ls), d in seen.items())
        raise ConfigError(f"the servers announce different models or layers: {said}")
    if not seen:
        return None
    (model, layers), _ = seen.popitem()
    return model, list(layers)


def given_conflicts(recorded: RunConfig, hint: IdentityHint) -> list[str]:
    """The given model or layers that contradict the run's recorded pins, in words."""
    pairs = (
        ("model_id", recorded.model_id, hint.model_id),
        ("layer_ids", recorded.layer_ids, hint.layer_ids),
    )
    return [
        f"{name}: recorded {rec!r}, given {arg!r}"
        for name, rec, arg in pairs
        if arg is not None and rec is not None and rec != arg
    ]


def decide_identity(
    cfg: RunConfig, hint: IdentityHint, counts: Counter[tuple[str, tuple[int, ...]]]
) -> tuple[Identity | None, str]:
    """The run's model and layers and how they were decided (module docstring); `counts`:
    valid files per (model, layers)."""
    if conflicts := given_conflicts(cfg, hint):
        raise ConfigError(f"run {cfg.run!r} exists with other settings: " + "; ".join(conflicts))
    model, layers, source = cfg.model_id, cfg.layer_ids, "recorded in the run"
    if model is None or layers is None:
        source = "given"
        model = model if model is not None else hint.model_id
        layers = layers if layers is not None else hint.layer_ids
    if (model is None or layers is None) and hint.announced is not None:
        source = "announced by the run's servers"
        model = model if model is not None else hint.announced[0]
        layers = layers if layers is not None else hint.announced[1]
    total = sum(counts.values())
    if model is not None and layers is not None:
        n = counts.get((model, tuple(layers)), 0)
        return (model, list(layers)), f"{model} layers {layers} ({source}; {n} of {total} files)"
    fits = Counter(
        {
            k: n
            for k, n in counts.items()
            if (model is None or k[0] == model) and (layers is None or list(k[1]) == layers)
        }
    )
    ranked = fits.most_common()
    if not ranked:  # nothing to adopt: the run's first fully valid dump pins it, as usual
        return None, f"not decided: no valid file of what was given among {total} files"
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        tied = "; ".join(f"{n} files of model {m} layers {list(ls)}" for (m, ls), n in ranked)
        raise ConfigError(
            f"the run's files disagree with no majority ({tied}): pass --model-id and "
            "--layers, or --server-dump-dir of one of its servers; nothing was changed"
        )
    (m, ls), n = ranked[0]
    return (m, list(ls)), f"{m} layers {list(ls)} (majority: {n} of {total} files)"


def decide_states_dtype(cfg: RunConfig, found: Counter[str], total: int) -> tuple[str | None, str]:
    """The dtype the run's states are stored in (the worker pins it, so a run
    never mixes float32 and bf16 files): the recorded pin, else what most of the files of
    the run's identity hold (`found`: files per dtype; a tie is refused). None when nothing
    says (fp8-e4m3 files do not keep it): the first valid dump pins it, as usual."""
    if cfg.dump_dtype is not None:
        n = found.get(cfg.dump_dtype, 0)
        return cfg.dump_dtype, f"{cfg.dump_dtype} (recorded in the run; {n} of {total} files)"
    ranked = found.most_common()
    if not ranked:
        return None, "not decided"
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        tied = "; ".join(f"{n} files of {d}" for d, n in ranked)
        raise ConfigError(
            f"the run's files disagree on the states' dtype with no majority ({tied}): move "
            "the files of the dtype the run does not use out of its directory; nothing was "
            "changed"
        )
    dtype, n = ranked[0]
    return dtype, f"{dtype} (majority: {n} of {total} files)"


def identity_key(ident: Identity) -> tuple[str, tuple[int, ...]]:
    return ident[0], tuple(ident[1])
