"""`hsq requeue`, `hsq purge`, `hsq acl`: changing what a run holds, and who may touch it."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import click

from hsq.cli.command import hsq_command
from hsq.cli.flags import RedisFlags, RunName
from hsq.cli.options import settings_options, take
from hsq.errors import EXIT_PROBLEMS, ConfigError
from hsq.settings import setting


@dataclass(frozen=True)
class RequeueFlags:
    failed: bool = setting(False, flag_only=True, help="every sample in the dead letter")
    reason: str | None = setting(None, flag_only=True, help="dead-letter samples with this reason")
    samples: tuple[str, ...] = setting(
        (), flag="--sample", flag_only=True, help="these sample ids (repeatable)"
    )
    missing: bool = setting(
        False, flag_only=True, help="samples in no queue, not done and not dead"
    )
    dry_run: bool = setting(False, help="say what would be requeued, change nothing")


@hsq_command("requeue")
@settings_options(RunName)
@settings_options(RedisFlags)
@settings_options(RequeueFlags)
def requeue(**values: Any) -> None:
    """Put failed, chosen or lost samples back in the queue (idempotent).

    \b
    Examples:
      hsq requeue --run kimi-v1 --failed --dry-run   # lists the ids
      hsq requeue --run kimi-v1 --reason stale_dump
      hsq requeue --run kimi-v1 --sample s000042 --sample s000043
      hsq requeue --run kimi-v1 --missing
    """
    from hsq.ops import requeue as do_requeue
    from hsq.ops import select_for_requeue
    from hsq.ops.requeue import UNKNOWN_ID

    run = take(RunName, values).run
    redis = take(RedisFlags, values)
    f = take(RequeueFlags, values)
    if not (f.failed or f.reason or f.samples or f.missing):
        raise click.UsageError("say what to requeue: --failed, --reason, --sample or --missing")
    st = redis.run_store(run)
    ids, res = select_for_requeue(
        st, failed=f.failed, reason=f.reason, samples=f.samples, missing=f.missing
    )
    do_requeue(st, ids, res, dry_run=f.dry_run)
    verb = "would requeue" if f.dry_run else "requeued"
    click.echo(f"selected {res.selected}, {verb} {res.enqueued}")
    if f.dry_run:
        for sid in res.ids:
            click.echo(f"  {sid}")
    for why, sids in res.skipped.items():
        shown = ", ".join(sids[:10]) + (" ..." if len(sids) > 10 else "")
        click.echo(f"skipped {len(sids)}: {why}: {shown}")
    unknown = [sid for sid in res.skipped.get(UNKNOWN_ID, []) if sid in set(f.samples)]
    if unknown:  # the others were requeued; a mistyped id is still an error
        click.echo(f"error: {len(unknown)} unknown sample id(s) in run {run}", err=True)
        sys.exit(EXIT_PROBLEMS)


@dataclass(frozen=True)
class PurgeFlags:
    yes: bool = setting(False, flag_only=True, aliases=("-y",), help="do not ask for confirmation")


@hsq_command("purge")
@settings_options(RunName)
@settings_options(RedisFlags)
@settings_options(PurgeFlags)
def purge(**values: Any) -> None:
    """Delete a run's Redis state (queues, done, dead letter). Output files stay on disk.

    \b
    Example:
      hsq purge --run old-run --yes    # or -y
    """
    from hsq.ops import purge as do_purge

    run = take(RunName, values).run
    st = take(RedisFlags, values).run_store(run)
    if not take(PurgeFlags, values).yes:
        click.confirm(
            f"delete every Redis key of run {run!r} ({st.count(st.keys.done)} done entries)?",
            abort=True,
        )
    n = do_purge(st)
    click.echo(f"purged run {run}: {n} keys deleted; output files untouched")


@dataclass(frozen=True)
class AclFlags:
    user: str | None = setting(None, default_text="hsq-RUN", help="ACL user name")


@hsq_command("acl")
@settings_options(RunName)
@settings_options(AclFlags)
def acl(**values: Any) -> None:
    """Print a Redis ACL user that can work on one run only.

    It can enqueue, run workers, status/requeue/verify/recover/audit/purge that run, and
    cannot read, change or list another run's keys (docs/operations.md). Put the line in
    Redis's ACL file with a real password in place of <PASSWORD>, then `ACL LOAD`; never
    pass a password to redis-cli as an argument.

    \b
    Example:
      hsq acl --run kimi-v1 >> /etc/redis/users.acl   # then edit <PASSWORD>
    """
    from hsq.keys import RunKeys

    run = take(RunName, values).run
    try:
        keys = RunKeys(run)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    click.echo(keys.acl_user(take(AclFlags, values).user))
