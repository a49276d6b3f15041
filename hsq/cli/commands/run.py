"""`hsq run`: a whole node's share of a run in one command (hsq/node/)."""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from hsq import extras
from hsq.cli.command import hsq_argument, hsq_command
from hsq.cli.dataset import dataset_options, take_dataset
from hsq.cli.flags import RedisAccess
from hsq.cli.options import as_argv, settings_options, take
from hsq.errors import ConfigError
from hsq.node.plan import NODE_ENGINES
from hsq.settings import setting
from hsq.workers.settings import WorkerTuning

NODE = "Node"
"""--help's heading of how this node's processes are named, kept and watched."""


@dataclass(frozen=True)
class RunFlags:
    out: Path = setting(path="dir", help="output root: files in OUT/RUN/, hsq's state in OUT/.hsq/")
    run: str | None = setting(None, default_text="DATASET's name", metavar="NAME", help="run name")
    join: bool = setting(
        False,
        flag_only=True,
        help="add servers and workers to another node's run (its Redis: --redis-url-file)",
    )
    engine: str | None = setting(
        None,
        choices=NODE_ENGINES,
        deprecated=("--server",),
        deprecated_env=("HSQ_SERVER_KIND",),
        default_text="sglang on GPUs, else reference",
        help="the inference servers to start",
    )
    model: str | None = setting(
        None, default_text="reference: tiny", metavar="PATH", help="checkpoint to serve"
    )
    gpus: str | None = setting(
        None, default_text="every visible one", metavar="LIST", help="GPUs: 0-7 or 0,2"
    )
    tp: int = setting(1, minimum=1, help="GPUs per server")
    servers: int | None = setting(
        None,
        minimum=1,
        default_text="GPUs / TP; reference: 1",
        help="servers, a worker each",
    )
    stay: bool = setting(
        False,
        section=NODE,
        help="keep the workers waiting for more work once the queue is empty (a node of a "
        "long-lived cluster; stop it with Ctrl-C or SIGTERM)",
    )
    node_name: str | None = setting(
        None,
        default_text="the short host name",
        section=NODE,
        help="names this node's workers NODE-i",
    )
    max_server_restarts: int = setting(
        3, minimum=0, section=NODE, help="times one server that exits is started again"
    )
    metrics_port: int | None = setting(
        None,
        section=NODE,
        help="worker i serves Prometheus metrics on this port + i [default: off]",
    )
    json: bool = setting(False, help="one JSON summary on stdout at the end")
    verify: bool = setting(False, help="read every output back (verify --deep) at the end")
    redis_only: bool = setting(
        False,
        flag_only=True,
        section=NODE,
        help="serve OUT's own Redis until Ctrl-C (for hsq verify/export after a run)",
    )
    redis_url: str | None = setting(
        None,
        flag="--redis",
        env=("HSQ_REDIS_URL", "REDIS_URL"),
        default_text="OUT's own redis-server",
        metavar="URL",
        help="use this Redis (auth through the environment or --redis-url-file, never a flag)",
    )
    listen: str | None = setting(
        None,
        default_text="this host only",
        metavar="HOST[:PORT]",
        help="serve OUT's Redis to other hosts over TLS (docs/multinode.md)",
    )
    access: RedisAccess = field(default_factory=RedisAccess)


def run_name_of(dataset: Path) -> str:
    """A run name from a file name: `train.tokens.jsonl` -> `train-tokens`."""
    stem = dataset.name.removesuffix(".jsonl")
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", stem).strip("-_")[:64]
    if not name:
        raise ConfigError(f"no run name in {dataset.name!r}: give --run")
    return name


def listen_of(text: str | None, url: str | None) -> Any:
    """--listen as hsq.node.redis.Listen; only OUT's own Redis can be served."""
    if text is None:
        return None
    if url is not None:
        raise click.UsageError("--listen serves OUT's own Redis: not with a given Redis")
    from hsq.node.redis import Listen

    return Listen.parse(text)


def split_args(args: tuple[str, ...], *, join: bool) -> tuple[Path | None, tuple[str, ...]]:
    """(DATASET, the servers' arguments): with --join every argument is the servers' (the
    run exists; --run names it), else the first is DATASET."""
    if join:
        if args and args[0].endswith(".jsonl") and Path(args[0]).is_file():
            raise click.UsageError("--join enqueues nothing: name the run with --run, no DATASET")
        return None, args
    if not args:
        raise click.UsageError("give DATASET (or --join --run RUN to join a run)")
    dataset = Path(args[0])
    if not dataset.exists():
        raise click.UsageError(f"DATASET {args[0]!r}: no such file")
    if not dataset.is_file():
        raise click.UsageError(f"DATASET {args[0]!r} is not a file")
    return dataset, args[1:]


@hsq_command("run")
@hsq_argument(
    "args",
    nargs=-1,
    type=click.UNPROCESSED,
    metavar="[DATASET] [-- SERVER_ARGS]",
    help="",
    rows=(
        ("DATASET", "JSONL: token rows, or chat rows with --tokenizer"),
        ("SERVER_ARGS", "after `--`: given as they are to every server"),
    ),
)
@settings_options(RunFlags)
@settings_options(WorkerTuning)
@dataset_options
def run(args: tuple[str, ...], **values: Any) -> None:
    """Run a whole node's share of a run: Redis, servers, workers, live view.

    Starts a Redis in OUT (unless given one), a server per GPU group, a worker
    each. Safe to rerun. Exit 0 done, 1 samples dead or left, 2 usage, 3 Redis.

    \b
    Example:
      hsq run data.jsonl --out out/  # CPU: the tiny reference model
      hsq run data.jsonl --out /hs --model /m/qwen3-8b --tp 2  # 8 GPUs: 4 servers
      hsq run --join --run data --out /n2 --redis-url-file F --model M  # node 2
    """
    import socket

    from hsq.node.node import NodeJob, dataset_enqueue, report_node, run_node, serve_redis_only
    from hsq.node.plan import (
        REFERENCE,
        model_shape,
        persist_procs_each,
        plan_node,
        sglang_importable,
        visible_gpus,
    )

    f = take(RunFlags, values)
    if f.redis_only:
        sys.exit(serve_redis_only(f.out))
    tuning = take(WorkerTuning, values)  # each worker's, checked before anything starts
    tuning.validate()
    data = take_dataset(values, "hsq run")
    dataset, server_args = split_args(args, join=f.join)
    name = f.run or (run_name_of(dataset) if dataset is not None else None)
    if name is None:
        raise click.UsageError("--join needs --run")
    url = f.access.resolve(f.redis_url)
    if f.join and url is None:
        raise click.UsageError(
            "--join needs the Redis of the run: --redis-url-file FIRST_OUT/.hsq/redis-url"
        )
    plan = plan_node(
        requested=f.engine, model=f.model, gpus_flag=f.gpus, tp=f.tp, servers=f.servers,
        sglang=sglang_importable(), visible=visible_gpus(),
    )  # fmt: skip
    if plan.kind == REFERENCE:  # before Redis or any server starts
        extras.require("reference", "hsq run --engine reference")

    if tuning.persist_procs is None:  # the host's cores shared by this node's workers
        tuning = dataclasses.replace(tuning, persist_procs=persist_procs_each(len(plan.servers)))
    job = NodeJob(
        run=name, out=f.out, plan=plan, redis_url=url,
        enqueue=None if dataset is None else dataset_enqueue(
            dataset, f.out, data, model_shape(plan, server_args)
        ),
        worker_argv=as_argv(tuning),
        server_args=server_args,
        metrics_port=f.metrics_port,
        node=f.node_name or socket.gethostname().split(".")[0],
        max_restarts=f.max_server_restarts, json=f.json, verify=f.verify, stay=f.stay,
        url_file=f.access.redis_url_file,
        listen=listen_of(f.listen, url),
    )  # fmt: skip
    outcome = run_node(job)
    report_node(job, outcome)
    sys.exit(outcome.rc)
