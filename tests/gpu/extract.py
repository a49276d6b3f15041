"""One extraction run through hsq's own commands against a live server: `hsq enqueue`,
`hsq worker --inflight K` (optionally with the server SIGKILLed and started again
mid-run), then what the run's records and `hsq verify --deep` say."""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hsq.node.procs import ManagedProcess, hsq_command, worker_process
from tests.support.sglang import wait_for


class Serving(Protocol):
    """What an extraction needs of its server (tests.support.sglang.SGLangServer; the CPU
    tests' reference-server stand-in)."""

    url: str

    @property
    def dump_dir(self) -> Path | None: ...

    @property
    def proc(self) -> ManagedProcess | None: ...

    def start(self) -> float: ...

    def kill(self) -> None: ...


def hsq(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        hsq_command("--log-format", "json", *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def make_dataset(
    path: Path, lengths: Sequence[int], *, vocab: int, seed: int, prefix: str = "s"
) -> dict[str, list[int]]:
    rng = random.Random(seed)
    rows = {
        f"{prefix}{i:05d}": [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]
        for i, n in enumerate(lengths)
    }
    with open(path, "w") as f:
        for sid, ids in rows.items():
            f.write(json.dumps({"id": sid, "input_ids": ids}) + "\n")
    return rows


def lengths_mixed(n: int, seed: int, *, chunk: int, equal_pairs: int = 0) -> list[int]:
    """Mostly chat-length samples (batched together), a fifth past the chunked-prefill
    size; `equal_pairs` pairs of equal length (a mix-up between them keeps the shape)."""
    rng = random.Random(seed)
    out = [rng.randint(16, 512) for _ in range(n - n // 5 - 2 * equal_pairs)]
    out += [rng.randint(chunk + 1, 3 * chunk) for _ in range(n // 5)]
    for _ in range(equal_pairs):
        out += [rng.randint(32, 256)] * 2
    rng.shuffle(out)
    return out


def log_events(path: Path, event: str) -> Iterator[dict[str, Any]]:
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == event:
            yield rec


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def run_status(redis_url: str, run: str) -> dict[str, Any]:
    r = hsq("status", "--run", run, "--redis", redis_url, "--json", timeout=60)
    for line in r.stdout.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("run") == run:
            return obj
    raise RuntimeError(f"hsq status: {r.returncode}\n{r.stdout}\n{r.stderr}")


def done_count(redis_url: str, run: str) -> Callable[[], tuple[int, int]]:
    """A cheap poll of the run's (done, dead) counts, for timing the mid-run kill."""
    from hsq.runstore import RunStore
    from hsq.store import connect

    store = RunStore(connect(redis_url), run)
    return lambda: (store.count(store.keys.done), store.count(store.keys.dead))


@dataclass
class Extraction:
    work: Path
    run: str
    dataset: dict[str, list[int]]
    dataset_path: Path
    redis_url: str
    server: Serving
    worker_url: str
    """Where the worker sends: the server itself, or a proxy in front of it."""
    layers: str
    inflight: int
    run_flags: Sequence[str] = ()
    res: dict[str, Any] = field(default_factory=dict)
    """The run's figures, filled as they are measured (also when go() fails)."""

    @property
    def out_dir(self) -> Path:
        return self.work / "out" / self.run

    def go(self, *, kill_at: float | None) -> dict[str, Any]:
        """Extract every sample; SIGKILL the server's group once `kill_at` of them are
        done and start it again. The figures of the run."""
        assert self.server.dump_dir is not None
        r = hsq(
            "enqueue", str(self.dataset_path), "--run", self.run, "--out",
            str(self.work / "out"), "--redis", self.redis_url, "--layers", self.layers,
            "--no-progress", *self.run_flags,
        )  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"enqueue: {r.stdout}\n{r.stderr}")
        wlog = self.work / f"worker-{self.run}.log"
        worker = worker_process(
            self.run, self.worker_url, self.server.dump_dir, self.redis_url, wlog,
            "--inflight", str(self.inflight), "--name", f"live-{self.run}",
            "--dump-timeout", "60", prefix=(),
        )  # fmt: skip
        n = len(self.dataset)
        res = self.res
        res.update(samples=n, tokens=sum(map(len, self.dataset.values())))
        t0 = time.monotonic()
        counts = done_count(self.redis_url, self.run)

        def ended(at_least: float) -> bool:
            """Done and dead together (a dead sample never comes back); an error if the
            server died on its own meanwhile."""
            proc = self.server.proc
            if proc is not None and not proc.alive():
                raise RuntimeError(f"the server exited: {counts()} (done, dead)\n"
                                   f"{proc.log_tail(40)}")  # fmt: skip
            return sum(counts()) >= at_least

        try:
            if kill_at is not None:
                wait_for(lambda: ended(n * kill_at), 600, "first part", worker, 0.02)
                res["killed_with_done"] = counts()[0]
                self.server.kill()
                time.sleep(3)  # the worker sees a dead server with K requests in flight
                res["restart_s"] = round(self.server.start(), 1)
            wait_for(lambda: ended(n), 600, f"all {n} ended", worker)
            res["wall_s"] = round(time.monotonic() - t0, 1)
        except Exception as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
            res["counts_done_dead"] = counts()
            raise
        finally:
            worker.stop(30)
            res["worker_log_tail"] = [ln[-300:] for ln in _tail(wlog, 15)]
            res["dead_reasons"] = sorted(
                {str(e.get("reason")) for e in log_events(wlog, "sample_dead")}
            )
        st = run_status(self.redis_url, self.run)
        res["status"] = {k: st.get(k) for k in ("total", "done", "dead", "queued", "in_progress")}
        marks = Counter(str(e["sample"]) for e in log_events(wlog, "sample_done"))
        res["marked_done_once"] = all(v == 1 for v in marks.values()) and len(marks) == n
        res["discarded_dumps"] = sum(1 for _ in log_events(wlog, "dump_discarded"))
        v = hsq("verify", "--run", self.run, "--redis", self.redis_url, "--deep",
                "--no-progress", timeout=600)  # fmt: skip
        res["verify_deep_exit"] = v.returncode
        return res
