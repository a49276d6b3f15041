"""How many Python processes a test run starts, by kind, and their CPU: one instrumented run.

    python scripts/test_census.py --out census.jsonl -- nice -n 5 make test
    python scripts/test_census.py --summarize census.jsonl

The run gets a temporary folder first on PYTHONPATH holding scripts/census_site.py as its
sitecustomize.py, which makes every Python process the suite starts (fresh or forked, e.g.
from the test zygote) append a JSON line at exit (atexit or os._exit) to the --out file.
Processes killed by a signal (SIGKILL chaos, the zygote itself, servers stopped with
SIGKILL) leave no line, so counts are lower bounds; the same method before and after a
change counts the same tests' starts.

Prints a Markdown table (kind, fresh starts, forked starts, CPU seconds) and, for a run,
its wall time and the 1-minute load average sampled every 10 s while it ran (the machine
is shared: a time means little without the load beside it). The `hsq` commands the tests
call in their own process (tests/support/inproc.py) are no processes: each appends a line
marked "inproc", counted in a row of its own, its CPU (its thread's) already inside the
pytest row's, so not added to the total again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
KINDS = (
    "`hsq` commands (status, verify, enqueue, audit, export, ...)",
    "`hsq` commands called in the test's process (not processes; CPU within pytest's)",
    "`hsq worker`",
    "`hsq serve-reference`",
    "`hsq run`, `hsq demo`, `hsq exporter`, launch-*",
    "persist processes",
    "null-model / fake vLLM servers",
    "pytest (main process, xdist workers and their forks)",
    "the test zygote",
    "other Python (`-c` helpers, bench, probes, tinymodel, toytok, venvs)",
)


def kind(rec: dict[str, object]) -> str:
    if rec.get("inproc"):
        return KINDS[1]
    argv = [str(a) for a in rec["argv"]]  # type: ignore[union-attr]
    head = " ".join(argv[:1])
    if rec.get("zygote") and not rec.get("forked") and "tests.support.zygote" in head:
        return KINDS[8]
    if head.endswith("tests/support/zygote.py") or "tests.support.zygote" in head:
        return KINDS[8]
    if head.endswith(("hsq/__main__.py", "/bin/hsq")) or head == "hsq":
        words = [a for a in argv[1:] if not a.startswith("-")]
        sub = next((w for w in words if w not in ("json", "console")), "")
        if sub == "worker":
            return KINDS[2]
        if sub == "serve-reference":
            return KINDS[3]
        if sub in ("run", "demo", "exporter", "launch-sglang", "launch-vllm"):
            return KINDS[4]
        return KINDS[0]
    if "persist" in head:
        return KINDS[5]
    if "nullserver" in head or "fakevllm" in head:
        return KINDS[6]
    if rec.get("pytest"):
        return KINDS[7]
    return KINDS[9]


def summarize(path: Path) -> str:
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        row = rows[kind(rec)]
        row[1 if rec.get("forked") else 0] += 1
        row[2] += float(rec["user"]) + float(rec["sys"])
    out = ["| kind | fresh | forked | CPU s |", "|---|---:|---:|---:|"]
    total = [0, 0, 0.0]
    for k in KINDS:
        if k in rows:
            fresh, forked, cpu = rows[k]
            out.append(f"| {k} | {fresh:.0f} | {forked:.0f} | {cpu:.1f} |")
            if k == KINDS[1]:
                continue
            total = [total[0] + fresh, total[1] + forked, total[2] + cpu]
    out.append(f"| total recorded | {total[0]:.0f} | {total[1]:.0f} | {total[2]:.1f} |")
    return "\n".join(out)


def run(out: Path, command: list[str]) -> int:
    out.unlink(missing_ok=True)
    site = Path(tempfile.mkdtemp(prefix="hsq-census-"))
    shutil.copy(HERE / "census_site.py", site / "sitecustomize.py")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    env["HSQ_CENSUS"] = str(out.resolve())
    loads: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(10):
            loads.append(os.getloadavg()[0])

    threading.Thread(target=sample, daemon=True).start()
    t0, cpu0 = time.monotonic(), os.times()
    rc = subprocess.call(command, env=env)
    wall, cpu1 = time.monotonic() - t0, os.times()
    stop.set()
    shutil.rmtree(site, ignore_errors=True)
    print(summarize(out))
    user = cpu1.children_user - cpu0.children_user
    system = cpu1.children_system - cpu0.children_system
    load = (
        f"load (1-min avg, every 10 s) min {min(loads):.1f} mean "
        f"{sum(loads) / len(loads):.1f} max {max(loads):.1f}"
        if loads
        else "load not sampled"
    )
    print(f"\nexit {rc}; wall {wall:.1f} s; user {user:.0f} s + sys {system:.0f} s; {load}")
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("census.jsonl"))
    ap.add_argument("--summarize", type=Path, help="only print the table of a census file")
    ap.add_argument("command", nargs="*", help="the test command (after --)")
    args = ap.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    if not args.command:
        ap.error("give the test command after --, e.g. -- nice -n 5 make test")
    return run(args.out, args.command)


if __name__ == "__main__":
    sys.exit(main())
