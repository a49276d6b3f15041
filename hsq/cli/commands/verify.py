"""`hsq verify` and `hsq audit`: checking a run's outputs, by their files and by
re-extraction."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from hsq import extras
from hsq.cli.command import hsq_command
from hsq.cli.flags import MountedOut, RedisFlags, RunName
from hsq.cli.options import settings_options, take
from hsq.errors import EXIT_PROBLEMS
from hsq.settings import setting
from hsq.workers.settings import EngineApi, ExchangeTuning


@dataclass(frozen=True)
class VerifyFlags:
    deep: bool = setting(False, help="read every byte: checksum, tensors, finite values")
    requeue: bool = setting(
        False,
        flag_only=True,
        help="un-done missing and corrupt samples (corrupt files removed) and requeue",
    )
    jobs: int | None = setting(
        None,
        minimum=1,
        default_text="the CPUs, from 20,000 samples",
        help="processes checking files",
    )
    read_threads: int = setting(
        1,
        minimum=1,
        help="threads a process reading files: more queue reads on storage with high latency "
        "(a network filesystem); on a local disk the processes already do",
    )


@hsq_command("verify")
@settings_options(RunName)
@settings_options(RedisFlags)
@settings_options(VerifyFlags)
@settings_options(MountedOut)
def verify(**values: Any) -> None:
    """Check every output file against the run's manifest; exit 1 if anything is wrong.

    Reads only headers (size, names, shapes, token count) unless --deep. Reports missing
    and corrupt files, and orphans (files no manifest entry claims).

    \b
    Example:
      hsq verify --run kimi-v1 --deep --requeue
    """
    from hsq.ops import repair
    from hsq.ops import verify as do_verify

    st = take(RedisFlags, values).run_store(take(RunName, values).run)
    f = take(VerifyFlags, values)
    mounted = take(MountedOut, values)
    root = mounted.run_dir(st)
    with mounted.progress(st.count(st.keys.done), "verifying") as bar:
        res = do_verify(
            st, root, deep=f.deep, on_progress=bar.update, jobs=f.jobs, threads=f.read_threads
        )
    consumed = f", consumed {res.consumed} (trained, files removed)" if res.consumed else ""
    click.echo(
        f"checked {res.checked}: ok {res.ok}{consumed}, missing {len(res.missing)}, "
        f"corrupt {len(res.corrupt)}, orphans {len(res.orphans)}, refused {len(res.refused)}"
    )
    for sid in res.missing[:20]:
        click.echo(f"  missing  {sid}")
    for sid, problems in list(res.corrupt.items())[:20]:
        click.echo(f"  corrupt  {sid}: {'; '.join(problems)}")
    for rel in res.orphans[:20]:
        click.echo(f"  orphan   {rel}")
    for sid, why in list(res.refused.items())[:20]:
        click.echo(f"  refused  {sid}: manifest entry not trusted ({why}); left alone")
    if f.requeue and (res.missing or res.corrupt):
        n = repair(st, root, res)
        click.echo(f"requeued {n} samples")
    if res.problems:
        sys.exit(EXIT_PROBLEMS)


@dataclass(frozen=True)
class AuditFlags:
    """The audit's own flags; how it talks to --server is a worker's (EngineApi,
    ExchangeTuning: the same flags and variables)."""

    # audit_*: not HSQ_SERVER / HSQ_DUMP_DIR / HSQ_SEED, which name a worker's server and
    # dump dir and the reference server's weights, things the audit must not take by accident.
    sample_fraction: float = setting(
        help="fraction of the done samples to re-extract, chosen at random (0 < F <= 1)"
    )
    audit_server: str = setting(
        flag="--server", help="inference server URL the audit may use alone"
    )
    audit_dump_dir: Path = setting(
        flag="--dump-dir",
        path="dir",
        help="that server's dump dir; the audit takes it as a worker does (refused while a "
        "worker holds it)",
    )
    requeue: bool = setting(False, flag_only=True, help="un-done and requeue mismatches")
    audit_seed: int | None = setting(
        None, flag="--seed", default_text="random, printed", help="which samples"
    )


@hsq_command("audit")
@settings_options(RunName)
@settings_options(RedisFlags)
@settings_options(AuditFlags)
@settings_options(EngineApi)
@settings_options(ExchangeTuning)
@settings_options(MountedOut)
def audit(**values: Any) -> None:
    """Re-extract a random subset of done samples alone and compare with the stored states.

    No check on a dump's metadata can tell that a batching server put one request's rid,
    fingerprint and token count on another request's states: they are saved as valid and
    `verify --deep` passes. The audit sends each chosen sample alone (one request at a
    time, so alone in its batch) to --server, through --dump-dir (which it owns while it
    runs), and compares every stored tensor with the stored file within the reference
    tolerance (per token: cosine >= 0.999, max |diff| <= 1% of the norm; fp8-e4m3 states as
    values times scales, the bound widened by e4m3's rounding). A mismatch is confirmed by
    a second extraction before it counts. Exit 1 on any mismatch or a sample it could not
    audit; exit 2 when --server cannot be reached. Workers can audit continuously too:
    `hsq worker --audit-fraction F`.

    \b
    Example (a spare server; HSQ_REDIS_URL set):
      hsq audit --run kimi-v1 --sample-fraction 0.01 --server http://127.0.0.1:30009 \\
          --dump-dir /dev/shm/hsq-audit --requeue
      # a vLLM server (hsq launch-vllm) of its own:
      hsq audit --run kimi-v1 --sample-fraction 0.01 --server http://127.0.0.1:8009 \\
          --engine vllm --dump-dir /dev/shm/hsq-audit
    """
    extras.require("reference", "hsq audit")  # it compares states as tensors (torch)
    from hsq.ops.audit import run_audit

    api, exchange = take(EngineApi, values), take(ExchangeTuning, values)
    exchange.validate()
    st = take(RedisFlags, values).run_store(take(RunName, values).run)
    f = take(AuditFlags, values)
    mounted = take(MountedOut, values)
    with mounted.progress(0, "auditing") as bar:

        def set_total(n: int) -> None:  # known once the samples are chosen
            bar.total = n
            bar.refresh()

        report = run_audit(
            st,
            server=f.audit_server,
            dump_dir=f.audit_dump_dir,
            fraction=f.sample_fraction,
            out_root=mounted.run_dir(st),
            seed=f.audit_seed,
            do_requeue=f.requeue,
            api=api,
            exchange=exchange,
            on_progress=bar.update,
            on_total=set_total,
        )
    for line in report.lines_out():
        click.echo(line)
    for sid, why in list(report.mismatched.items())[:50]:
        click.echo(f"  mismatch  {sid}: {why}")
    for sid, why in list(report.failed.items())[:20]:
        click.echo(f"  failed    {sid}: {why}")
    if report.mismatched or report.failed:
        sys.exit(EXIT_PROBLEMS)
