"""`hsq recover`: rebuild a run's Redis state from its output files (hsq/producer/recover.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from hsq.cli.command import hsq_argument, hsq_command
from hsq.cli.flags import RedisFlags, RunName
from hsq.cli.options import given, settings_options, take
from hsq.runconfig import RunConfig
from hsq.settings import int_list_or_none, setting

RECOVER_SETTINGS = ("chunk_size", "store_dtype", "prenorm")


@dataclass(frozen=True)
class RecoverFlags:
    out: Path | None = setting(
        None,
        path="dir",
        default_text="the run's, if known",
        help="output root the run wrote to (files are in OUT/RUN/)",
    )
    server_dump_dirs: tuple[Path, ...] = setting(
        (),
        flag="--server-dump-dir",
        path="dir",
        exists=True,
        help="dump dir of one of the run's servers (repeatable): its readiness marker says "
        "the model and layers the run uses",
    )
    layer_ids: list[int] | None = setting(
        None,
        flag="--layers",
        parse=int_list_or_none,
        metavar="IDS",
        help="the run's aux layer ids (HF hidden_states indices), for a run Redis lost: files "
        "with other layers are stale, enqueued again [default: the --server-dump-dir "
        "markers', else what most files hold; a run Redis has: its own]",
    )
    model_id: str | None = setting(
        None,
        help="the run's model id (name@digest), for a run Redis lost: files of another "
        "model are stale, enqueued again [default: as --layers]",
    )
    no_progress: bool = setting(False, help="no progress bar")


@hsq_command("recover")
@hsq_argument(
    "dataset",
    required=False,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="the run's JSONL; needed when Redis lost the run [default: the recorded one]",
)
@settings_options(RunName)
@settings_options(RecoverFlags)
@settings_options(RedisFlags)
@settings_options(RunConfig, only=RECOVER_SETTINGS)
def recover(dataset: Path | None, **values: Any) -> None:
    """Rebuild a run's Redis state from its output files (after a Redis loss).

    Every file under OUT/RUN/ is checked against its DATASET line (header, every tensor,
    token ids, finite values); valid ones are marked done with their checksum, the rest of
    the dataset is enqueued. Safe to run on a live run: it only adds what is missing.
    The run's model and layers are its recorded ones, else --model-id/--layers, else what
    the readiness markers in --server-dump-dir say, else what most files hold (a tie is
    refused); files of another model or layers are stale: reported and enqueued again.
    Symlinks are never adopted.

    \b
    Example (Redis was wiped; HSQ_REDIS_URL set):
      hsq recover data.jsonl --run kimi-v1 --out /shared/hs --server-dump-dir /dev/shm/hsq0
    """
    from hsq.producer.identity import IdentityHint, announced_identity
    from hsq.producer.recover import RecoverRequest, recover_run
    from hsq.runstore import RunStore

    run = take(RunName, values).run
    flags = take(RecoverFlags, values)
    redis = take(RedisFlags, values)
    store = RunStore(redis.client(), run)
    hint = IdentityHint(flags.model_id, flags.layer_ids, announced_identity(flags.server_dump_dirs))
    req = RecoverRequest(
        run,
        dataset,
        flags.out,
        chunk_size=values["chunk_size"],
        # Not given: read off the run's files (hsq/producer/recover.py).
        store_dtype=values["store_dtype"] if given("store_dtype") else None,
        prenorm=values["prenorm"] if given("prenorm") else None,
        hint=hint,
    )
    report = recover_run(store, req, progress=not flags.no_progress)
    for line in report.lines_out() + report.recover_lines():
        click.echo(line)
    for sid, why in list(report.rejected_files.items())[:10]:
        click.echo(f"  rejected file of {sid}: {why}", err=True)
