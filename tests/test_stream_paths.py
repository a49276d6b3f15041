"""Train while extracting: the paths around the main loop (tests/test_stream.py has the loop
itself under `hsq run`). Each test extracts a small dataset with a real worker and the
reference server (tiny model) on the session's redis-server, and reads it with
StreamingHiddenStateDataset in this process or in tests/support/streamtrainer.py (killed
with a real SIGKILL where the test says so).

- verify, audit and export count committed-and-removed samples as consumed, not missing;
- a reject left by a consumer killed before it queued the sample again is finished: the
  sample is extracted again and delivered, nothing stays dead;
- a restart with fewer DataLoader workers delivers the old workers' pending entries again,
  each once, in order;
- a budget below a sample pauses the worker (no dead letter) naming the bytes needed; once
  the first dump pinned the bytes per token a re-enqueue with a budget still too small is
  refused up front, and one with a bigger budget lets it go on;
- `hsq status` shows each group's delivered, committed and pending, the spool against its
  budget and the files consumed (removed only once every group committed them);
- --keep-after-commit keeps the files and releases the reservations (never blocks);
- states of another run or group are refused, a plain DataLoader with workers too (one
  line each);
- a stale entry (its sample re-done since) is acked and skipped, the new one trained once;
- a file a DataLoader worker checked and handed over by name (CheckedFile) that changed
  before the trainer's process opened it is checked again there: rejected, re-extracted,
  delivered once.
Waits for events, never for time.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from torch.utils.data import DataLoader

from hsq.data import StreamingDataLoader, StreamingHiddenStateDataset
from hsq.data.reads import CheckedFile
from hsq.errors import ConfigError
from hsq.node.procs import ManagedProcess
from hsq.node.stream import StreamView
from hsq.outputs.check import read_checked
from hsq.outputs.manifest import MANIFEST_CODEC
from hsq.producer.synthetic import write_synthetic
from hsq.runstore import RunStore
from hsq.store import connect, consumer_client
from hsq.store.ledger import dead_entry
from tests.helpers import enqueue, hsq, start_worker, store, wait_until
from tests.support.procs import ReferenceServer
from tests.support.trainers import start_trainer

pytestmark = [
    pytest.mark.usefixtures("no_trainer_left"),  # tests/support/trainers.py
    pytest.mark.skipif(sys.platform != "linux", reason="process groups"),
    pytest.mark.timeout(90),
]

SAMPLES = 8


@pytest.fixture(scope="module")
def server(server_factory: Any) -> ReferenceServer:
    return server_factory("--warmup", "2", name="streamsrv").wait_ready()  # type: ignore[no-any-return]


WORKERS: list[ManagedProcess] = []


@pytest.fixture(autouse=True)
def no_worker_left() -> Iterator[None]:
    """A failed test's worker is stopped: the next one's worker needs the dump dir."""
    yield
    while WORKERS:
        WORKERS.pop().stop()


class Run:
    """A streamed run extracted by one worker (--burst: it stays until every output is
    committed, then exits 0)."""

    def __init__(
        self, tmp: Path, server: ReferenceServer, redis_url: str, name: str, *flags: str,
        samples: int = SAMPLES,
    ) -> None:  # fmt: skip
        self.tmp, self.name, self.url = tmp, name, redis_url
        self.dataset = tmp / f"{name}.jsonl"
        write_synthetic(self.dataset, samples, seed=5, min_len=4, max_len=24)
        self.ids = {json.loads(x)["id"] for x in self.dataset.read_text().splitlines() if x}
        self.out = tmp / "out"
        enqueue(self.dataset, name, self.out, redis_url, "--chunk-size", "2", *flags)
        self.st: RunStore = store(redis_url, name)
        self.worker: ManagedProcess = start_worker(tmp, name, server, redis_url, "--burst")
        WORKERS.append(self.worker)

    def ds(self, group: str = "train", **kw: Any) -> StreamingHiddenStateDataset:
        return StreamingHiddenStateDataset(self.name, redis_url=self.url, group=group, **kw)

    def wait_published(self, n: int) -> None:
        wait_until(lambda: self.st.spool.published() >= n, 120, interval=0.05)

    def files(self) -> list[Path]:
        return sorted((self.out / self.name).rglob("*.safetensors"))

    def worker_exits_0(self) -> None:
        assert self.worker.proc.wait(120) == 0, self.worker.log_tail()
        assert self.st.spool.settled()


def consume(ds: StreamingHiddenStateDataset, every: int = 2) -> list[str]:
    """A trainer in this process: checkpoint (state) and commit every `every` items."""
    got: list[str] = []
    for item in DataLoader(ds, batch_size=None):
        got.append(str(item["id"]))
        if len(got) % every == 0:
            ds.commit(ds.state_dict())
    ds.commit(ds.state_dict())
    return got


def trainer(tmp: Path, run: Run, tag: str, *extra: str) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable, "-m", "tests.support.streamtrainer", "--run", run.name,
        "--redis-url-file", str(write_url(tmp, run.url)), "--ckpt", str(tmp / f"{tag}.json"),
        "--progress", str(tmp / f"{tag}.progress"), *extra,
    ]  # fmt: skip
    return start_trainer(argv, tmp / f"{tag}.log")


def write_url(tmp: Path, url: str) -> Path:
    path = tmp / "redis-url"
    path.write_text(url)
    path.chmod(0o600)
    return path


def trained(tmp: Path, tag: str) -> list[str]:
    ckpt = json.loads((tmp / f"{tag}.json").read_text())
    assert ckpt.get("finished"), ckpt
    return list(ckpt["trained"])


def test_verify_audit_and_export_count_committed_removed_files_as_consumed(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    run = Run(tmp_path, server, redis_url, "gone", "--spool-budget", "1M")
    run.wait_published(SAMPLES)
    assert Counter(consume(run.ds())) == Counter(run.ids)
    run.worker_exits_0()
    assert not run.files()  # every file removed once committed
    common = ["--run", "gone", "--redis", redis_url]
    v = hsq("verify", *common, "--deep", "--no-progress")
    assert v.returncode == 0, v.stdout + v.stderr
    assert f"ok 0, consumed {SAMPLES} (trained, files removed), missing 0" in v.stdout
    e = hsq("export", *common, "--format", "specforge", "--to", str(tmp_path / "sf"),
            "--no-progress")  # fmt: skip
    assert e.returncode == 0, e.stdout + e.stderr
    assert f"{SAMPLES} samples consumed by the stream" in e.stdout and "failed    0" in e.stdout
    a = hsq("audit", *common, "--server", server.url, "--dump-dir", str(tmp_path / "ad"),
            "--sample-fraction", "1")  # fmt: skip
    assert a.returncode == 0, a.stdout + a.stderr
    assert f"consumed        {SAMPLES}" in a.stdout and "not audited     0" in a.stdout


def test_a_reject_left_by_a_killed_consumer_is_queued_again_and_delivered(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    run = Run(tmp_path, server, redis_url, "rej", "--spool-budget", "1M")
    run.wait_published(SAMPLES)
    # What a consumer killed right after its reject script leaves: the sample un-marked,
    # dead-lettered (output_corrupt) and released; its file still there, nothing queued.
    [d] = run.st.spool.read("train", "rank0-worker0", 1, None, None)
    entry = MANIFEST_CODEC.decode(d.sample_id, d.stored)
    assert entry is not None
    dead = json.dumps(dead_entry("output_corrupt", "checksum mismatch", 0, "consumer:train"))
    totals = MANIFEST_CODEC.totals(entry)
    assert run.st.spool.reject("train", d, totals, dead, "output_corrupt")
    assert run.st.ledger.dead_reasons() == {"output_corrupt": 1}
    proc = trainer(tmp_path, run, "t", "--every", "3")
    assert proc.wait(180) == 0, (tmp_path / "t.log").read_text()
    assert Counter(trained(tmp_path, "t")) == Counter(run.ids)  # the rejected one too, once
    run.worker_exits_0()
    assert not run.st.ledger.dead_reasons()
    assert run.st.count(run.st.keys.done) == SAMPLES


def test_a_restart_with_fewer_dataloader_workers_delivers_the_old_ones_pending_once(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    run = Run(tmp_path, server, redis_url, "fewer", "--spool-budget", "1M", samples=12)
    run.wait_published(12)
    first = trainer(tmp_path, run, "t", "--workers", "2", "--every", "3", "--die-after", "5")
    assert first.wait(120) == -signal.SIGKILL
    consumers = run.st.spool.consumers("train")
    assert "rank0-worker1" in consumers, consumers  # entries pending to a worker now gone
    again = trainer(tmp_path, run, "t", "--workers", "0", "--every", "3")
    assert again.wait(180) == 0, (tmp_path / "t.log").read_text()
    assert Counter(trained(tmp_path, "t")) == Counter(run.ids)  # each once
    run.worker_exits_0()
    assert not run.st.spool.consumers("train")  # nothing left pending anywhere


def test_a_budget_below_a_sample_pauses_the_worker_until_it_is_raised(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    run = Run(tmp_path, server, redis_url, "small", "--spool-budget", "1K")

    def cause() -> dict[str, Any]:
        infos = run.st.workers.workers_info().values()
        return next((i for i in infos if i.get("cause") == "spool_too_small"), {})

    # The first sample goes alone (its size is known only once a dump pinned the hidden
    # size); every later one is larger than 1 KiB: the worker pauses, says the number.
    try:
        wait_until(lambda: bool(cause()), 60, interval=0.1)
    except AssertionError:
        raise AssertionError((run.st.workers.workers_info(), run.worker.log_tail(60))) from None
    message = str(cause()["cause_message"])
    needed = int(message.split(" needs ")[1].split()[0])
    assert needed > 1024 and "raise it to at least" in message, message
    assert not run.st.ledger.dead_reasons()  # nothing dead-lettered
    status = hsq("status", "--run", "small", "--redis", redis_url)
    assert "spool budget below a sample" in status.stdout, status.stdout
    # The first dump pinned the bytes per token: a re-enqueue with a budget still too small
    # is refused up front (one line, exit 2), naming the largest sample still to extract
    # (the first one, done alone, is not), the budget unchanged.
    done = set(run.st.iter_hash_keys(run.st.keys.done))
    tokens = {json.loads(x)["id"]: len(json.loads(x)["input_ids"])
              for x in run.dataset.read_text().splitlines() if x}  # fmt: skip
    longest = max(set(tokens) - done, key=lambda k: tokens[k])
    args = ["enqueue", str(run.dataset), "--run", "small", "--out", str(run.out), "--redis",
            redis_url, "--no-progress", "--spool-budget", "2K"]  # fmt: skip
    refused = hsq(*args)
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    said = refused.stderr.strip()
    assert said.count("\n") == 0 and f"{longest} ({tokens[longest]} tokens) needs " in said, said
    assert int(said.split(" needs ")[1].split()[0]) >= needed, said
    assert run.st.require_config().spool_budget == 1024
    enqueue(run.dataset, "small", run.out, redis_url, "--spool-budget", "1M")
    assert run.st.require_config().spool_budget == 1024 * 1024
    assert Counter(consume(run.ds())) == Counter(run.ids)
    run.worker_exits_0()
    assert not run.st.ledger.dead_reasons()
    # Every sample done: a budget below them all holds nothing back, so it is accepted.
    said = enqueue(run.dataset, "small", run.out, redis_url, "--spool-budget", "2K")
    assert f"every sample left fits; the {SAMPLES} larger are done or dead already" in said


def test_status_shows_each_group_and_the_files_consumed_once_every_group_committed(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    run = Run(tmp_path, server, redis_url, "watch", "--spool-budget", "1M",
              "--consumers", "a,b")  # fmt: skip

    def stream() -> dict[str, Any]:
        out = hsq("status", "--run", "watch", "--redis", redis_url, "--json", check=True)
        return json.loads(out.stdout)["stream"]  # type: ignore[no-any-return]

    def groups(s: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
        return {g["name"]: (g["delivered"], g["committed"], g["pending"]) for g in s["groups"]}

    # Group a reads half and commits a quarter: delivered, committed and pending differ.
    a = run.ds("a")
    loader = iter(DataLoader(a, batch_size=None))
    for _ in range(SAMPLES // 4):
        next(loader)
    a.commit(a.state_dict())
    for _ in range(SAMPLES // 4):
        next(loader)
    s = stream()
    delivered = groups(s)["a"][0]  # (the dataset reads ahead of the trainer)
    assert delivered >= 4 and groups(s) == {"a": (delivered, 2, delivered - 2), "b": (0, 0, 0)}, s
    assert s["budget"] == 2**20 and 0 < s["spool_bytes"] <= 2**20 and s["consumed"] == 0, s
    text = hsq("status", "--run", "watch", "--redis", redis_url, check=True).stdout
    assert f"group a: delivered {delivered}  committed 2  pending {delivered - 2}" in text, text
    assert "group b: delivered 0  committed 0  pending 0" in text, text
    assert "consumed 0 (files removed once every group committed)" in text, text
    # a finishes; the files stay until b commits them too.
    for _ in loader:
        pass
    a.commit(a.state_dict())
    run.wait_published(SAMPLES)
    s = stream()
    assert groups(s)["a"] == (SAMPLES, SAMPLES, 0) and s["consumed"] == 0, s
    assert len(run.files()) == SAMPLES
    assert Counter(consume(run.ds("b"))) == Counter(run.ids)
    run.worker_exits_0()
    s = stream()
    assert groups(s) == {"a": (SAMPLES, SAMPLES, 0), "b": (SAMPLES, SAMPLES, 0)}, s
    assert s["consumed"] == SAMPLES and s["spool_bytes"] == 0 and s["published"] == SAMPLES, s
    assert not run.files()
    # `hsq run`'s stream line reads the same figures.
    line = StreamView(run.st, run.st.require_config(), run.out / "watch").line()
    n = SAMPLES
    expected = f"published {n}  consumed {n}  a: delivered {n} committed {n} pending 0  b: "
    assert expected in line, line
    # On a terminal: a line for the spool, one a group, with the same figures.
    frame = StreamView(run.st, run.st.require_config(), run.out / "watch").frame()
    assert frame[0].startswith("  stream: spool 0B/") and f"published {n}, consumed {n}" in frame[0]
    for g, text in zip("ab", frame[1:], strict=True):
        head = f"    group {g}: delivered {n}, committed {n}, pending 0, data wait "
        assert text.startswith(head), frame


def test_keep_after_commit_keeps_files_releases_reservations_and_refuses_foreign_states(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    # A budget of about two samples (a commit each item): were commits not releasing the
    # reservations of the files kept, the worker would stall.
    run = Run(tmp_path, server, redis_url, "keep", "--spool-budget", "16K",
              "--keep-after-commit")  # fmt: skip
    train = run.ds()
    assert Counter(consume(train, every=1)) == Counter(run.ids)
    assert sum(p.stat().st_size for p in run.files()) > 16 * 1024
    run.worker_exits_0()
    assert len(run.files()) == SAMPLES  # every file kept
    assert run.st.spool.reserved() == {} and run.st.spool.spool_bytes() == 0
    v = hsq("verify", "--run", "keep", "--redis", redis_url, "--deep", "--no-progress")
    assert v.returncode == 0 and f"ok {SAMPLES}, missing 0" in v.stdout, v.stdout
    # A state of another group, or another run: refused in one line.
    with pytest.raises(ConfigError, match="the state is of run 'keep' group 'ablate'"):
        train.load_state_dict({**train.state_dict(), "group": "ablate"})
    with pytest.raises(ConfigError, match="the state is of run 'other' group 'train'"):
        train.load_state_dict({**train.state_dict(), "run": "other"})
    # A plain DataLoader with worker processes: one line, naming the loader to use.
    with pytest.raises(ConfigError) as err:
        next(iter(DataLoader(run.ds(), batch_size=None, num_workers=1)))
    assert str(err.value).count("\n") == 0 and "StreamingDataLoader" in str(err.value)


def test_a_stale_entry_is_acked_and_skipped_and_the_new_one_trained_once(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    run = Run(tmp_path, server, redis_url, "stale", "--spool-budget", "1M",
              "--consumers", "a,b")  # fmt: skip
    run.wait_published(SAMPLES)
    first = sorted(run.files())[0]
    with open(first, "r+b") as f:  # same size, other bytes: the checksum tells
        f.seek(first.stat().st_size - 8)
        f.write(b"\xff" * 8)
    # Group a rejects it (re-extracted, published again); b still has the old entry unread.
    assert Counter(consume(run.ds("a"))) == Counter(run.ids)
    assert run.st.spool.published() == SAMPLES + 1
    b = run.ds("b")
    got = [str(item["id"]) for item in StreamingDataLoader(b, batch_size=None, num_workers=2)]
    b.commit(b.state_dict())
    assert Counter(got) == Counter(run.ids)  # the stale entry skipped, the new one once
    [info] = [g for g in run.st.spool.groups() if g.name == "b"]
    assert info.delivered == SAMPLES + 1 and info.pending == 0  # the stale one acked
    run.worker_exits_0()
    assert not run.files()


def test_a_file_changed_after_a_loader_worker_checked_it_is_checked_again_and_rejected(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    run = Run(tmp_path, server, redis_url, "recheck", "--spool-budget", "1M")
    run.wait_published(SAMPLES)
    ds = run.ds()
    # What a DataLoader worker hands the trainer's process: a delivery it read and checked.
    [d] = run.st.spool.read("train", "rank0-worker0", 1, None, None)
    entry = MANIFEST_CODEC.decode(d.sample_id, d.stored)
    assert entry is not None
    _, identity = read_checked(ds.run_dir, d.sample_id, entry)
    ref = CheckedFile(ds.run_dir, d, identity, ("rank0-worker0", d.entry_id), None, False)
    item = ds.opened(ref)
    assert item is not None and item["id"] == d.sample_id  # the file checked: opened
    [path] = [p for p in run.files() if p.name.startswith(d.sample_id + ".")]
    with open(path, "r+b") as f:  # same size and inode, other bytes: only the checksum tells
        f.seek(path.stat().st_size - 8)
        f.write(b"\xff" * 8)
    assert ds.opened(ref) is None  # no longer the file checked: checked again, rejected
    assert Counter(consume(ds)) == Counter(run.ids)  # extracted again, delivered once
    run.worker_exits_0()
    assert not run.st.ledger.dead_reasons()


def test_reads_ahead_hand_items_in_stream_order_and_end_with_the_trainer(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    """Files are read and checked in threads ahead of the trainer: the items still come in
    the stream's order, each once, as they do read one at a time; a trainer that stops
    leaves no read thread behind, and what it had not committed comes again."""
    run = Run(tmp_path, server, redis_url, "ahead", "--spool-budget", "1M",
              "--consumers", "a,b")  # fmt: skip
    run.wait_published(SAMPLES)
    b = run.ds("b", read_threads=0)
    one_by_one = [str(item["id"]) for item in b]
    b.commit(b.state_dict())

    def readers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("hsq-read-ahead")}

    others = readers()  # any that another test left open in this process
    it = cast(Generator[dict[str, Any]], iter(run.ds("a", read_threads=4)))
    first = [str(next(it)["id"]) for _ in range(3)]
    mine = readers() - others
    assert mine
    it.close()  # the trainer stopped: its reads are dropped, its threads gone
    assert not mine & readers()
    again = consume(run.ds("a", read_threads=4))
    assert first == one_by_one[:3] and again == one_by_one, (first, again, one_by_one)
    assert sorted(one_by_one) == sorted(run.ids)
    run.worker_exits_0()
    assert not run.files()


def test_a_trainer_that_read_the_end_of_the_stream_holds_no_connection(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    """`hsq run` keeps its Redis while a consumer is attached once all is committed (so it
    can read the stream's end): a trainer that read it and keeps its dataset (saving its
    model) held a connection, and the run waited its full linger for nothing."""
    run = Run(tmp_path, server, redis_url, "release", "--spool-budget", "1M",
              "--consumers", "a,b")  # fmt: skip
    other = connect(redis_url, name=consumer_client("another-run"))  # not this run's
    assert other.ping() and run.st.spool.attached() == 0
    a = run.ds("a")
    assert Counter(consume(a)) == Counter(run.ids)  # its last commit after the loop
    assert run.st.spool.attached() == 0
    a.commit(a.state_dict())  # the same state again: nothing to send, no connection
    assert run.st.spool.attached() == 0
    b, got = run.ds("b"), []
    for item in StreamingDataLoader(b, batch_size=None, num_workers=2):
        got.append(str(item["id"]))
        assert run.st.spool.attached() >= 1  # reading: attached
    assert run.st.spool.attached() == 0  # the workers' ends, and the trainer's process
    b.commit(b.state_dict())  # a new state after the end: sent, then let go
    assert run.st.spool.attached() == 0 and Counter(got) == Counter(run.ids)
    run.worker_exits_0()
    assert not run.files()


def test_a_stopped_or_reaped_worker_s_jobs_go_back_without_their_reservations(
    redis_url: str,
) -> None:
    """A worker killed with samples in flight leaves their byte reservations behind; its
    jobs go back to the queue (reaped, or released at its next start) and so must the
    bytes, or the worker that claims next can wait for room forever (a first sample, whose
    size is not known yet, reserves the whole budget). Done samples keep theirs."""
    from hsq.dataset.jsonl import IndexEntry
    from hsq.runconfig import RunConfig

    st = RunStore(connect(redis_url), "rw")
    st.create_config(RunConfig(run="rw", dataset="/d.jsonl", out="/o", spool_budget=1000))
    st.require_config()
    entry = IndexEntry(0, 10, 0, 3)
    st.enqueue([[("a", entry), ("b", entry)]])
    job = st.claim("dead", 0.05)
    assert job is not None
    assert st.spool.reserve("a", None)  # the whole budget: its size is not known yet
    assert not st.spool.reserve("c", 10)  # full
    assert st.release_wip("dead") == 1
    assert st.spool.reserved() == {} and st.spool.spool_bytes() == 0
    assert st.spool.reserve("c", 10)  # room again


def test_the_url_file_is_read_as_every_hsq_command_reads_it(tmp_path: Path) -> None:
    # The consumer reads OUT/.hsq/redis-url like the CLI does: mode 600, one line; a file
    # gone (its `hsq run` stopped) is said with the way to serve the run again.
    state = tmp_path / "out" / ".hsq"
    state.mkdir(parents=True)
    url_file = state / "redis-url"
    with pytest.raises(ConfigError, match="--redis-only") as gone:
        StreamingHiddenStateDataset("r", redis_url_file=url_file)
    assert f"hsq run --out {tmp_path / 'out'} --redis-only" in str(gone.value)
    url_file.write_text("redis://:secret-pw@127.0.0.1:1/0\n")
    url_file.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600") as loose:
        StreamingHiddenStateDataset("r", redis_url_file=url_file)
    assert "secret-pw" not in str(loose.value)
