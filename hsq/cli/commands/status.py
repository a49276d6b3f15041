"""`hsq status` and `hsq runs`: how far along runs are (hsq/ops/status.py)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import click

from hsq.cli.command import hsq_command
from hsq.cli.flags import RedisFlags
from hsq.cli.options import settings_options, take
from hsq.settings import setting

if TYPE_CHECKING:
    from hsq.store import RunListing


@dataclass(frozen=True)
class StatusFlags:
    run: str | None = setting(None, default_text="every run", help="one run")
    json: bool = setting(False, help="one JSON object per run (stable keys)")
    failed: bool = setting(
        False,
        help="also list each dead sample: id, reason, message (JSON: key `failed`)",
    )
    watch: bool = setting(False, help="refresh in place until Ctrl-C")
    interval_s: float = setting(2.0, help="seconds between refreshes (--watch)")
    recount: bool = setting(
        False,
        help="re-derive the run's counters from its queues and hashes first (O(samples); "
        "status does it by itself when they are missing or disagree with the queues)",
    )


@hsq_command("status")
@settings_options(StatusFlags)
@settings_options(RedisFlags)
def status(**values: Any) -> None:
    """How far along a run is: counts, rate, ETA, workers, dead letter by reason.

    Reads a handful of counters per run, whatever its size (docs/queue.md, "Counters").

    \b
    Example:
      hsq status --run kimi-v1 --watch
      hsq status --json | jq .done
      hsq status --run kimi-v1 --failed
    JSON keys: run, total, done, queued, in_progress, retry, dead, missing, invalid_lines,
    tokens_done, tokens_total, bytes_done, samples_per_s, tokens_per_s, eta_s,
    dead_by_reason, workers, stream (a streamed run's spool and groups, else null); with
    --failed also failed (docs/operations.md).
    """
    from hsq.errors import ConfigError
    from hsq.ops import dead_samples, dead_text, dumps_json, run_status, status_text
    from hsq.runstore import RunStore
    from hsq.store import scan_runs

    flags = take(StatusFlags, values)
    client = take(RedisFlags, values).client()
    if flags.run:
        RunStore(client, flags.run).require_config()  # an unknown run: exit 2, in words
    first = True
    while True:
        # Every run, listed again each round; one that cannot be read is skipped and
        # reported, never hides the others.
        listing = None if flags.run else scan_runs(client)
        runs = listing.runs if listing is not None else [flags.run] if flags.run else []
        reports, dead = [], []
        for r in runs:
            try:
                st = RunStore(client, r)
                reports.append(run_status(st, recount_first=flags.recount and first))
                dead.append(dead_samples(st) if flags.failed else [])
            except ConfigError as exc:
                if listing is None:
                    raise
                listing.skip(f"run {r!r}: {exc}")
        first = False
        if listing is not None:
            report_skipped(listing)
        if flags.json:
            out = "\n".join(
                dumps_json(
                    r.to_dict() | ({"failed": [asdict(d) for d in ds]} if flags.failed else {})
                )
                for r, ds in zip(reports, dead, strict=True)
            )
        else:
            out = "\n".join(
                "\n".join(
                    status_text(r, listed=flags.failed) + (dead_text(ds) if flags.failed else [])
                )
                for r, ds in zip(reports, dead, strict=True)
            )
            out = out or "no runs"
        if not flags.watch:
            click.echo(out)
            return
        click.echo("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + "\n" + out)
        try:
            time.sleep(flags.interval_s)
        except KeyboardInterrupt:
            return


@hsq_command("runs")
@settings_options(RedisFlags)
def runs(**values: Any) -> None:
    """List runs with their progress.

    \b
    Example:
      hsq runs --redis-url-file /run/secrets/redis_url
    """
    from hsq.errors import ConfigError
    from hsq.ops import run_figures
    from hsq.runstore import RunStore
    from hsq.store import scan_runs

    client = take(RedisFlags, values).client()
    listing = scan_runs(client)
    shown = 0
    for name in listing.runs:
        try:
            fig = run_figures(RunStore(client, name))
        except ConfigError as exc:  # purged meanwhile, or a config that cannot be read
            listing.skip(f"run {name!r}: {exc}")
            continue
        click.echo(f"{name}  done {fig.done}/{fig.total}  dead {fig.dead}")
        shown += 1
    if not shown:
        click.echo("no runs")
    report_skipped(listing)


def report_skipped(listing: RunListing) -> None:
    """What looked like a run but could not be listed, on stderr (stdout stays parseable)."""
    for why in listing.skipped:
        click.echo(f"skipped: {why}", err=True)
    if listing.skipped_total > len(listing.skipped):
        click.echo(f"skipped: {listing.skipped_total - len(listing.skipped)} more", err=True)
