"""Publishing an output file without replacing another writer's, on a real
filesystem: two writers of one sample interleaved deterministically at every step of
hsq.outputs.publish (its pause port; no sleeps, no timing). Whatever the order, and
whatever was at the name before (nothing, a valid file, an invalid one), each writer's
result, the entry it marks done, is the file left at the name, and that file is valid."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hsq import fsio
from hsq.dataset.jsonl import Sample
from hsq.dump.format import DumpMeta, ModelIdentity, expected_shapes, fingerprint
from hsq.dump.read import open_dump_tensors
from hsq.dump.write import write_dump
from hsq.outputs import publish
from hsq.outputs.adopt import adopt_output
from hsq.outputs.check import file_checksum
from hsq.outputs.format import output_relpath
from hsq.outputs.publish import Publisher
from hsq.outputs.transcode import write_output
from hsq.stfile.engine import WriteEngine
from tests.support.fakedump import IDENT, LAYERS
from tests.support.fakeoutput import H, states

N = 9
SAMPLE = Sample("s1", list(range(100, 100 + N)), None)
RUN = "run"


def meta(model: ModelIdentity = IDENT) -> DumpMeta:
    ids = SAMPLE.input_ids
    return DumpMeta(
        "r", N, fingerprint(ids), LAYERS, H, "bfloat16", model, expected_shapes(N, 3, H), 0
    )


def output_bytes(tmp: Path, seed: int, model: ModelIdentity = IDENT) -> bytes:
    """A valid output of SAMPLE (states from `seed`), written as the worker writes one."""
    base = tmp / f"made-{seed}-{model.model_id}"
    dumps = base / "dumps"
    dumps.mkdir(parents=True)
    m = meta(model)
    dump = open_dump_tensors(write_dump(dumps, 0, m, states(N, seed)), m)
    try:
        with WriteEngine() as engine:
            path = base / "out" / "s1.safetensors"
            write_output(path, SAMPLE, m, dump, RUN, "bf16", engine=engine)
    finally:
        dump.close()
    return path.read_bytes()


class Turns:
    """One writer runs at a time, between two pauses. When every live writer waits at a
    pause, the next is chosen: by `prefix` (one letter per choice), then "A"."""

    def __init__(self, prefix: str, names: tuple[str, ...]) -> None:
        self.prefix = prefix
        self.choices = 0
        self.alive = set(names)
        self.waiting: set[str] = set()
        self.running: str | None = None
        self.chosen: str | None = None
        self.cv = threading.Condition()

    def _next(self) -> str | None:
        if self.chosen is None and self.running is None and self.waiting == self.alive:
            if len(self.alive) == 1:
                self.chosen = next(iter(self.alive))
            else:
                k, self.choices = self.choices, self.choices + 1
                want = self.prefix[k] if k < len(self.prefix) else "A"
                self.chosen = want if want in self.alive else min(self.alive)
        return self.chosen

    def step(self, who: str) -> None:
        with self.cv:
            if self.running == who:
                self.running = None
            self.waiting.add(who)
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: self._next() == who, timeout=60):
                raise AssertionError(f"{who} never got its turn")
            self.waiting.discard(who)
            self.running, self.chosen = who, None
            self.cv.notify_all()

    def finish(self, who: str) -> None:
        with self.cv:
            self.alive.discard(who)
            if self.running == who:
                self.running = None
            self.cv.notify_all()


def race(
    final: Path, files: dict[str, bytes], prefix: str
) -> tuple[dict[str, tuple[int, str]], tuple[int, str], list[tuple[str, str]], int]:
    """Writers named by `files` publish their bytes at `final`, in the order `prefix`
    picks; each marks its result done (first mark wins, as the done script does).
    (each writer's result, the marked one, the trace of steps, the choices made)."""
    turns = Turns(prefix, tuple(files))
    results: dict[str, tuple[int, str]] = {}
    marks: dict[str, tuple[int, str]] = {}
    errors: dict[str, BaseException] = {}
    trace: list[tuple[str, str]] = []
    stats: dict[str, dict[str, float]] = {w: {} for w in files}

    def pause_of(who: str) -> Callable[[str], None]:
        def pause(point: str) -> None:
            trace.append((who, point))
            turns.step(who)

        return pause

    def writer(who: str, data: bytes) -> None:
        try:
            pause = pause_of(who)  # first at "publish": a temp is private till then
            tmp = fsio.temp_name(final)
            tmp.write_bytes(data)
            mine = (len(data), file_checksum(tmp))
            pub = Publisher(SAMPLE, meta(), RUN, "bf16", False, stats[who], pause=pause)
            res = pub(tmp, final, mine)
            pause("mark")
            marks.setdefault(SAMPLE.id, res)
            results[who] = res
        except BaseException as exc:
            errors[who] = exc
        finally:
            turns.finish(who)

    threads = [threading.Thread(target=writer, args=(w, d)) for w, d in files.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results, marks[SAMPLE.id], trace, turns.choices


def explore(run_one: Callable[[str], int]) -> int:
    """Run every sequence of choices once (a depth-first walk: a run with prefix p takes
    "A" past p; each later choice is then also tried as "B"). The number of runs."""
    runs = 0

    def walk(prefix: str) -> None:
        nonlocal runs
        runs += 1
        made = run_one(prefix)
        for k in range(len(prefix), made):
            walk(prefix + "A" * (k - len(prefix)) + "B")

    walk("")
    return runs


def use(naming: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Either way hsq.fsio publishes without replacing: renameat2(RENAME_NOREPLACE), or
    link(2) where the filesystem lacks it."""
    if naming == "link":
        monkeypatch.setattr(fsio, "_renameat2", None)
    else:
        assert fsio._renameat2 is not None, "this libc has no renameat2"


INVALID = ["garbage", "a truncated file", "another model's file", "a symlink"]
CASES = [
    *[("renameat2", before) for before in ["nothing", "a valid file", *INVALID]],
    # The link fallback takes the same steps; one invalid kind stands for the others (they
    # differ only in the judge's verdict, not in the steps): a full walk costs seconds.
    *[("link", before) for before in ["nothing", "a valid file", "garbage"]],
]


@pytest.mark.parametrize(("naming", "before"), CASES)
def test_two_writers_in_every_order_mark_the_file_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, naming: str, before: str
) -> None:
    use(naming, monkeypatch)
    a, b = output_bytes(tmp_path, 1), output_bytes(tmp_path, 2)
    valid_c = output_bytes(tmp_path, 3)
    other_model = output_bytes(tmp_path, 4, ModelIdentity("other", "LlamaModel", 8, 16, "1" * 64))
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(valid_c)
    out_root = tmp_path / "out"
    final = out_root / output_relpath(SAMPLE.id)
    seen: set[str] = set()

    def run_one(prefix: str) -> int:
        final.parent.mkdir(parents=True, exist_ok=True)
        for p in final.parent.iterdir():
            p.unlink()
        if before == "a valid file":
            final.write_bytes(valid_c)
        elif before == "garbage":
            final.write_bytes(b"\x00not a safetensors file")
        elif before == "a truncated file":
            final.write_bytes(valid_c[: len(valid_c) // 2])
        elif before == "another model's file":
            final.write_bytes(other_model)
        elif before == "a symlink":
            final.symlink_to(elsewhere)
        results, marked, trace, made = race(final, {"A": a, "B": b}, prefix)
        on_disk = (final.stat().st_size, file_checksum(final))
        assert not final.is_symlink()
        assert marked == on_disk, (prefix, trace)  # the marked entry is the file on disk
        assert set(results.values()) == {on_disk}, (prefix, trace)  # whoever marks first
        data = final.read_bytes()
        assert data == valid_c if before == "a valid file" else data in (a, b)
        entry, why = adopt_output(out_root, SAMPLE, RUN, "bf16")
        assert entry is not None and entry.checksum == on_disk[1], why
        assert [p.name for p in final.parent.iterdir()] == [final.name]  # no temp left
        seen.update(point for _, point in trace)
        return made

    runs = explore(run_one)
    assert runs > 1
    assert elsewhere.read_bytes() == valid_c  # a symlink's target is never touched
    if before in ("nothing", "a valid file"):
        assert "move aside" not in seen  # a valid file is never moved
    else:  # some order had both writers judge the invalid file, one moving the other's back
        assert {"move aside", "check aside", "put back"} <= seen


@pytest.mark.parametrize("naming", ["renameat2", "link"])
def test_rename_noreplace_never_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, naming: str
) -> None:
    use(naming, monkeypatch)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(b"new")
    dst.write_bytes(b"old")
    assert not fsio.rename_noreplace(src, dst)
    assert dst.read_bytes() == b"old" and src.read_bytes() == b"new"
    dst.unlink()
    dst.symlink_to(tmp_path / "nowhere")  # a dangling link is a name too
    assert not fsio.rename_noreplace(src, dst) and dst.is_symlink()
    dst.unlink()
    assert fsio.rename_noreplace(src, dst)
    assert dst.read_bytes() == b"new" and not src.exists()


def test_an_adopted_or_replaced_file_is_counted_in_the_write_stats(tmp_path: Path) -> None:
    """What the persist stage logs (`sample_name_taken`): adopted, replaced_invalid."""
    a, c = output_bytes(tmp_path, 1), output_bytes(tmp_path, 3)
    final = tmp_path / "out" / output_relpath(SAMPLE.id)
    final.parent.mkdir(parents=True)
    for before, event, kept in ((c, publish.ADOPTED, c), (b"junk", publish.REPLACED_INVALID, a)):
        final.write_bytes(before)
        tmp = fsio.temp_name(final)
        tmp.write_bytes(a)
        stats: dict[str, float] = {}
        got = Publisher(SAMPLE, meta(), RUN, "bf16", False, stats)(tmp, final, (len(a), "x"))
        assert stats == {event: 1.0} and final.read_bytes() == kept
        assert got == (len(kept), file_checksum(final) if kept is c else "x")
        assert not tmp.exists() and os.listdir(final.parent) == [final.name]
        final.unlink()


def test_the_file_at_a_taken_name_is_judged_from_one_read_of_its_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publisher._valid parses the header once for its three checks (judge_output, the
    model identity, the states' dtype and size), not once each."""
    from hsq.stfile.header import read_header

    a, c = output_bytes(tmp_path, 1), output_bytes(tmp_path, 3)
    final = tmp_path / "out" / output_relpath(SAMPLE.id)
    final.parent.mkdir(parents=True)
    final.write_bytes(c)
    tmp = fsio.temp_name(final)
    tmp.write_bytes(a)
    reads: list[int] = []

    def counted(fd: int, size: int | None = None, fast: Any = None) -> Any:
        reads.append(1)
        return read_header(fd, size, fast)

    # Every read of an output's header through hsq.outputs.format (the three checks' way).
    monkeypatch.setattr("hsq.outputs.format.read_fd_header", counted)
    got = Publisher(SAMPLE, meta(), RUN, "bf16", False, {})(tmp, final, (len(a), "x"))
    assert got == (len(c), file_checksum(final)) and final.read_bytes() == c  # adopted
    assert len(reads) == 1
