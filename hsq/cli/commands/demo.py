"""`hsq demo`: the whole pipeline on this machine (hsq/node/demo.py)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsq import extras
from hsq.cli.command import hsq_command
from hsq.cli.flags import RedisAccess
from hsq.cli.options import settings_options, take
from hsq.settings import setting


@dataclass(frozen=True)
class DemoFlags:
    samples: int = setting(300, help="synthetic samples to extract")
    out: Path = setting(Path("demo-out"), path="dir", help="output root (files in OUT/RUN/)")
    dataset_seed: int = setting(0, flag="--seed", help="seed of the synthetic dataset")
    redis_url: str | None = setting(
        None,
        flag="--redis",
        env=("REDIS_URL",),
        default_text="a private redis-server",
        help="use this Redis instead of starting a private one (its auth as for every "
        "command: the environment or --redis-url-file, never a flag)",
    )
    access: RedisAccess = field(default_factory=RedisAccess)


@hsq_command("demo")
@settings_options(DemoFlags)
def demo(**values: Any) -> None:
    """Extract a synthetic dataset end to end on this machine, then verify every output.

    Starts a private redis-server (unless a Redis is given, as to every command: --redis,
    HSQ_REDIS_URL, REDIS_URL or --redis-url-file), a reference server with the tiny model,
    the producer and a worker.

    \b
    Example:
      hsq demo --samples 300
    """
    extras.require("reference", "hsq demo")  # its server runs the tiny model
    from hsq.node.demo import run_demo

    f = take(DemoFlags, values)
    url = f.access.resolve(f.redis_url)
    sys.exit(run_demo(samples=f.samples, out=f.out, redis_url=url, seed=f.dataset_seed))
