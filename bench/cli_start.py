"""What the `hsq` command costs to start: CPU (user+sys, from
wait4) and wall of short commands, each run several times, medians reported.

The test suite starts `hsq` as a subprocess hundreds of times (workers, enqueue, status,
verify ...) on a 2-core machine, so each command's own start is CPU the suite pays again
and again. Cases: the interpreter alone (the floor), --version and --help, a command's
--help, and real commands against a private redis-server: `status`, `enqueue` of a small
run, and `worker --burst` doing one sample against the null-model server (start to exit).

    .venv/bin/python -m bench.cli_start                  # 7 runs a case
    .venv/bin/python -m bench.cli_start --repeat 15 --json-out cli.json

Prints a table and, last, one JSON line. CPU is the comparable figure on a loaded machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hsq.node.procs import RedisServer, hsq_command
from hsq.producer.synthetic import write_synthetic
from tests.support.procs import NullServer


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_once(argv: Sequence[str], env: dict[str, str]) -> tuple[float, float]:
    """(CPU seconds user+sys, wall seconds) of one run of `argv`, which must exit 0. The
    CPU is what the children reaped meanwhile cost: only this one (the servers this
    script started are still running, so not reaped)."""
    cpu0, t0 = _children_cpu(), time.monotonic()
    proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(
            f"{argv} failed ({proc.returncode}):\n{proc.stderr.decode(errors='replace')}"
        )
    return cpu, wall


def _same(argv: Sequence[str], _i: int) -> Sequence[str]:
    return argv


def measure(
    name: str,
    make: Callable[[int], Sequence[str]],
    env: dict[str, str],
    repeat: int,
    prepare: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    cpu: list[float] = []
    wall: list[float] = []
    for i in range(repeat):
        if prepare is not None:
            prepare(i)
        c, w = run_once(make(i), env)
        cpu.append(c)
        wall.append(w)
    return {
        "case": name,
        "cpu_s": round(statistics.median(cpu), 3),
        "cpu_min_s": round(min(cpu), 3),
        "wall_s": round(statistics.median(wall), 3),
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("HSQ_LOG_FORMAT", None)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hsq-cli-start-") as tmp:
        base = Path(tmp)
        ds = base / "d.jsonl"
        write_synthetic(ds, 8, seed=1, min_len=8, max_len=64)
        static = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "hsq --version": hsq_command("--version"),
            "hsq --help": hsq_command("--help"),
            "hsq status --help": hsq_command("status", "--help"),
            "hsq worker --help": hsq_command("worker", "--help"),
            "hsq enqueue --help": hsq_command("enqueue", "--help"),
        }
        for name, cmd in static.items():
            results.append(measure(name, functools.partial(_same, cmd), env, args.repeat))
        redis = RedisServer(base / "redis")
        null = NullServer(base / "dumps", base / "null.log", args=["--shape", "tiny"])
        with redis, null:
            redis.wait_ready()
            null.wait_ready()
            renv = {**env, "HSQ_REDIS_URL": redis.url}
            out = str(base / "out")

            def enqueue(run: str, dataset: Path = ds) -> list[str]:
                return hsq_command("enqueue", str(dataset), "--run", run, "--out", out,
                                   "--no-progress")  # fmt: skip

            results.append(measure("hsq enqueue (8 samples)", lambda i: enqueue(f"e{i}"),
                                   renv, args.repeat))  # fmt: skip
            results.append(measure("hsq status", lambda _i: hsq_command("status"), renv,
                                   args.repeat))  # fmt: skip
            one = base / "one.jsonl"
            write_synthetic(one, 1, seed=2, min_len=16, max_len=16)

            def one_sample(i: int) -> None:
                run_once(enqueue(f"w{i}", one), renv)

            def worker(i: int) -> list[str]:
                return hsq_command("worker", "--run", f"w{i}", "--server", null.url,
                                   "--dump-dir", str(null.dump_dir), "--burst")  # fmt: skip

            results.append(measure("hsq worker --burst (1 sample)", worker, renv, args.repeat,
                                   prepare=one_sample))  # fmt: skip

    width = max(len(r["case"]) for r in results)
    print(f"{'case':<{width}}  cpu s (median, min)  wall s")
    for r in results:
        cpu = f"{r['cpu_s']:6.3f}  {r['cpu_min_s']:6.3f}"
        print(f"{r['case']:<{width}}  {cpu}       {r['wall_s']:6.3f}")
    doc = {"repeat": args.repeat, "results": results}
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
