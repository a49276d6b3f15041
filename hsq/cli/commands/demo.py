"""`hsq demo`: `hsq run` on a synthetic dataset, reference server on CPU, `--verify`, with
the demo's summary (hsq/node/ runs it; nothing here but the dataset and the words)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hsq import extras
from hsq.cli.command import hsq_command
from hsq.cli.flags import RedisAccess
from hsq.cli.options import as_argv, settings_options, take
from hsq.settings import setting

if TYPE_CHECKING:
    from hsq.node.node import NodeOutcome


@dataclass(frozen=True)
class DemoFlags:
    samples: int = setting(300, minimum=1, help="synthetic samples to extract")
    out: Path = setting(
        Path("demo-out"),
        path="dir",
        help="output root: files in OUT/RUN/, the dataset in OUT/RUN.jsonl, hsq's state (its "
        "Redis, the logs) in OUT/.hsq/",
    )
    dataset_seed: int = setting(0, flag="--seed", help="seed of the synthetic dataset")
    redis_url: str | None = setting(
        None,
        flag="--redis",
        env=("HSQ_REDIS_URL", "REDIS_URL"),
        default_text="OUT's own redis-server",
        help="use this Redis (its auth as for every command: the environment or "
        "--redis-url-file, never a flag)",
    )
    access: RedisAccess = field(default_factory=RedisAccess)


@hsq_command("demo")
@settings_options(DemoFlags)
def demo(**values: Any) -> None:
    """Extract a synthetic dataset end to end on this machine, then verify every output.

    What `hsq run DATASET --out OUT --engine reference --verify` does, on a dataset it
    writes (a new run each time): a Redis (OUT's own unless one is given, as to every
    command: --redis, HSQ_REDIS_URL, REDIS_URL or --redis-url-file), a reference server with
    the tiny model, the enqueue and a worker; then the demo's summary.

    \b
    Example:
      hsq demo --samples 300
    """
    extras.require("reference", "hsq demo")  # its server runs the tiny model
    import secrets
    import time

    from hsq.node.node import NodeJob, dataset_enqueue, run_node
    from hsq.node.plan import REFERENCE, persist_procs_each, plan_node
    from hsq.node.redis import state_dir
    from hsq.producer.settings import RUN_SETTINGS, DatasetFlags, DatasetInput
    from hsq.producer.synthetic import write_synthetic
    from hsq.workers.settings import WorkerTuning

    f = take(DemoFlags, values)
    run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    f.out.mkdir(parents=True, exist_ok=True)
    dataset = f.out / f"{run}.jsonl"
    tokens = write_synthetic(dataset, f.samples, seed=f.dataset_seed, min_len=16, max_len=1024)
    click.echo(f"dataset  {f.samples} samples, {tokens:,} tokens -> {dataset}")
    plan = plan_node(
        requested=REFERENCE, model=None, gpus_flag=None, tp=1, servers=1, sglang=False, visible=()
    )
    data = DatasetInput(DatasetFlags(), {}, defaulted=frozenset(RUN_SETTINGS))
    job = NodeJob(
        run=run,
        out=f.out,
        plan=plan,
        redis_url=f.access.resolve(f.redis_url),
        enqueue=dataset_enqueue(dataset, f.out, data),
        worker_argv=as_argv(WorkerTuning(persist_procs=persist_procs_each(1))),
        server_args=("--warmup", "2"),
        metrics_port=None,
        node="demo",
        verify=True,
        url_file=f.access.redis_url_file,
    )
    outcome = run_node(job)
    lines, ok = summary(outcome, f.samples, state_dir(f.out.resolve()) / "logs")
    for line in lines:
        click.echo(line)
    sys.exit(outcome.rc or (0 if ok else 1))


def summary(o: NodeOutcome, samples: int, logs: Path) -> tuple[list[str], bool]:
    """The demo's summary (what was made, how fast, whether every output reads back) and
    whether it all went well."""
    st, rate, v = o.status, o.rate, o.verified
    lines = [
        "",
        "summary",
        f"  samples       {st.done}/{samples} done, {st.dead} dead",
        f"  tokens        {st.tokens_done:,}",
        f"  time          {rate.seconds:.1f} s with the workers running ({o.elapsed:.1f} s in all)",
        f"  throughput    {rate.samples_per_s:.1f} samples/s, {rate.tokens_per_s:,.0f} tokens/s",
        f"  bytes         {st.bytes_done / 1e6:.1f} MB written",
    ]
    lines += [f"  dead          {n} {why}" for why, n in sorted(st.dead_by_reason.items())]
    if v is not None:
        lines.append(f"  verified      {v.ok}/{v.checked} outputs OK")
        bad = list(v.corrupt.items())[:10]
        lines += [f"  BAD           {sid}: {'; '.join(problems)}" for sid, problems in bad]
        lines += [f"  MISSING       {sid}" for sid in v.missing[:10]]
    lines.append(f"  outputs       {o.run_dir}")
    if o.url_file is not None:
        lines.append(f"  redis         `hsq run --out {o.run_dir.parent} --redis-only` serves it")
    lines.append(f"  logs          {logs}")
    ok = o.rc == 0 and st.done == samples and v is not None and v.ok == st.done
    lines.append("demo OK" if ok else f"demo FAILED (exit code {o.rc or 1})")
    return lines, ok
