"""A trainer as a user writes one over hsq's stream, for tests/test_stream*.py: it "trains"
on each item (adds its id to its model state), checkpoints every --every items (the
model state and the dataset's state_dict, written atomically), then commits. Started
again after a kill -9 it restores its last checkpoint (load_state_dict) and goes on.

    python -m tests.support.streamtrainer --run R --redis-url-file F --ckpt C.json \\
        [--group train] [--every 3] [--workers 0] [--progress P] [--die-after N]

--progress gets one line per item received (no fsync: what the test waits on).
--die-after N: the process kills itself with SIGKILL once it received N items in this
life (a kill -9 at a known point, its DataLoader workers with it).
--sleep-after-commit S: a slow step after each commit (the run can see everything
committed before the trainer reads the end of the stream).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from hsq.data import StreamingDataLoader, StreamingHiddenStateDataset


def save(path: Path, state: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--redis-url-file", required=True)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--group", default="train")
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--progress", type=Path)
    ap.add_argument("--die-after", type=int)
    ap.add_argument("--sleep-after-commit", type=float, default=0.0)
    a = ap.parse_args()
    ds = StreamingHiddenStateDataset(a.run, redis_url_file=a.redis_url_file, group=a.group)
    trained: list[str] = []
    if a.ckpt.exists():
        ckpt = json.loads(a.ckpt.read_text())
        trained = list(ckpt["trained"])
        ds.load_state_dict(ckpt["data"])
    loader = StreamingDataLoader(ds, batch_size=None, num_workers=a.workers)
    progress = open(a.progress, "a") if a.progress else None  # noqa: SIM115
    since = 0
    for got, item in enumerate(loader, 1):
        assert item["aux_hidden_states"].shape[0] == item["input_ids"].shape[0]
        trained.append(str(item["id"]))
        if progress is not None:
            progress.write(item["id"] + "\n")
            progress.flush()
        since += 1
        if a.die_after is not None and got >= a.die_after:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        if since >= a.every:
            state = ds.state_dict()
            save(a.ckpt, {"trained": trained, "data": state})
            ds.commit(state)
            since = 0
            time.sleep(a.sleep_after_commit)
    state = ds.state_dict()
    save(a.ckpt, {"trained": trained, "data": state, "finished": True})
    ds.commit(state)


if __name__ == "__main__":
    main()
