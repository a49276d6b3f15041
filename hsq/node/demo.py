"""`hsq demo` / `make demo`: the whole pipeline on one machine, with real processes.

A private redis-server (unless a URL is given), a reference server with the tiny model, a
synthetic dataset, the producer and one worker; then every output is verified.
"""

from __future__ import annotations

import secrets
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import click

from hsq.logs import progress
from hsq.node.procs import RedisServer, ReferenceServer, worker_process
from hsq.ops import verify
from hsq.producer.enqueue import enqueue_run
from hsq.producer.synthetic import write_synthetic
from hsq.runconfig import RunConfig
from hsq.runstore import RunStore
from hsq.store import connect, redis_calls


def run_demo(*, samples: int, out: Path, redis_url: str | None, seed: int) -> int:
    work = Path(tempfile.mkdtemp(prefix="hsq-demo-"))
    run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    echo = click.echo
    with ExitStack() as stack:
        if redis_url is None:
            rs = RedisServer(work / "redis", password=secrets.token_hex(12)).wait_ready()
            stack.callback(rs.stop)
            redis_url = rs.url
            echo(f"redis        private redis-server on 127.0.0.1:{rs.port} (password set)")
        dataset = work / "dataset.jsonl"
        tokens = write_synthetic(dataset, samples, seed=seed, min_len=16, max_len=1024)
        echo(f"dataset      {samples} samples, {tokens} tokens -> {dataset}")
        server = ReferenceServer(
            work / "dumps-0", work / "server-0.log", args=["--model", "tiny", "--warmup", "2"]
        )
        stack.callback(server.stop)
        server.wait_ready()
        echo(f"server       reference server (tiny Llama) at {server.url}")

        store = RunStore(connect(redis_url), run)
        report = enqueue_run(
            store, RunConfig(run=run, dataset=str(dataset), out=str(out.resolve())), progress=False
        )
        echo(f"enqueued     {report.enqueued} samples in {report.chunks} jobs (run {run})")
        calls0 = redis_calls(store.client)
        polls = 0
        t0 = time.perf_counter()
        worker = worker_process(
            run,
            server.url,
            server.dump_dir,
            redis_url,
            work / "worker-0.log",
            "--burst",
            "--name",
            "demo-w0",
        )
        stack.callback(worker.stop)
        with progress(report.valid, "sample", "extracting") as bar:
            while worker.alive():
                polls += 1
                bar.update(store.count(store.keys.done) + store.count(store.keys.dead) - bar.n)
                time.sleep(0.5)
            done = store.count(store.keys.done)
            bar.update(done - bar.n)
        elapsed = time.perf_counter() - t0
        # Subtract the demo's own polling (2 per poll) and the INFO call itself.
        calls = redis_calls(store.client) - calls0 - 2 * polls - 1
        rc = worker.proc.returncode
        stats = store.stats()
        dead_entries = store.dead_entries()
        echo("verifying    every output (checksum, shapes, finite values) ...")
        v = verify(store, out.resolve() / run, deep=True)

    done_tokens = stats.get("tokens", 0)
    echo("")
    echo("summary")
    echo(f"  samples       {done}/{samples} done, {len(dead_entries)} dead")
    echo(f"  tokens        {done_tokens}")
    echo(f"  time          {elapsed:.1f} s")
    echo(f"  throughput    {done / elapsed:.1f} samples/s, {done_tokens / elapsed:,.0f} tokens/s")
    echo(f"  bytes         {stats.get('bytes', 0) / 1e6:.1f} MB written")
    echo(
        f"  redis         {calls / max(done, 1):.2f} commands per sample "
        f"({calls} commands, INFO commandstats)"
    )
    for sid, entry in list(dead_entries.items())[:10]:
        echo(f"  dead          {sid}: {entry['reason']}: {entry['message'][:120]}")
    echo(f"  verified      {v.ok}/{v.checked} outputs OK")
    for sid, problems in list(v.corrupt.items())[:10]:
        echo(f"  BAD           {sid}: {'; '.join(problems)}")
    for sid in v.missing[:10]:
        echo(f"  MISSING       {sid}")
    echo(f"  outputs       {out.resolve() / run}")
    echo(f"  logs          {work}")
    ok = rc == 0 and done == samples and not dead_entries and v.ok == done
    echo("demo OK" if ok else f"demo FAILED (worker exit code {rc})")
    return 0 if ok else 1
