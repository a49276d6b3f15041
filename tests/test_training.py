"""The README walkthrough with real processes: chat rows -> tokenize -> enqueue -> worker on
the reference server's tiny model -> export -> SpecForge 0.2.0's own reader; and hsq.data.

Uses the session redis-server without flushing it (runs here have their own names), so
the module's one extraction serves every test.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from hsq.data import HiddenStateDataset, collate
from hsq.errors import OutputError
from hsq.node.procs import RedisServer, hsq_command
from hsq.ops.export import checked_entry, ckpt_path
from hsq.outputs.format import open_output, output_relpath
from hsq.outputs.manifest import ManifestEntry
from tests.helpers import hsq, start_worker, store, wait_until
from tests.support.procs import ReferenceServer

try:
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files
except ImportError as exc:  # `make setup` installs it; say why if it is missing
    SPECFORGE_MISSING = f"specforge==0.2.0 not importable ({exc}); run `make setup`"
else:
    SPECFORGE_MISSING = ""
if SPECFORGE_MISSING and os.environ.get("CI"):  # CI must run these checks, not skip them
    raise RuntimeError(SPECFORGE_MISSING)
needs_specforge = pytest.mark.skipif(bool(SPECFORGE_MISSING), reason=SPECFORGE_MISSING)

Factory = Callable[..., ReferenceServer]
# One real extraction serves the module; on a loaded 2-core machine it takes minutes.
pytestmark = pytest.mark.timeout(600)
RUN = "walk"


def specforge(run: str, url: str, dest: Path | str) -> list[str]:
    """`hsq export` arguments for a SpecForge export of `run` to `dest`."""
    return ["export", "--run", run, "--redis", url, "--format", "specforge", "--to", str(dest)]


def chats() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(10):
        rows.append(
            {
                "id": f"s{i}",
                "conversations": [
                    {"from": "human", "value": f"Question {i}: what is {i} + {i}?"},
                    {"from": "gpt", "value": f"It is {2 * i}."},
                    {"from": "human", "value": "Thanks!"},
                    {"from": "gpt", "value": "You are welcome."},
                ],
            }
        )
    rows.append(  # OpenAI messages, no id: a stable one is derived
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy."},
            ]
        }
    )
    rows += [
        {"id": "bad-noassistant", "conversations": [{"from": "human", "value": "hello?"}]},
        {"id": "bad-role", "conversations": [{"from": "robot", "value": "beep"}]},
        {"id": "bad-empty", "conversations": [{"from": "human", "value": ""}]},
    ]
    return rows


@pytest.fixture(scope="module")
def walk(
    tmp_path_factory: pytest.TempPathFactory, server_factory: Factory, redis_server: RedisServer
) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("walk")
    url = redis_server.url
    subprocess.run([sys.executable, "-m", "tests.support.toytok", str(base / "tok")], check=True)
    src = base / "chats.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in chats()))
    tokens = base / "tokens.jsonl"
    hsq(
        "tokenize",
        str(src),
        "--tokenizer",
        str(base / "tok"),
        "-o",
        str(tokens),
        "--jobs",
        "2",
        "--no-progress",
        check=True,
    )
    out = base / "out"
    hsq(
        "enqueue",
        str(tokens),
        "--run",
        RUN,
        "--out",
        str(out),
        "--redis",
        url,
        "--chunk-size",
        "4",
        "--no-progress",
        check=True,
    )
    srv = server_factory(name="walksrv").wait_ready()
    w = start_worker(base, RUN, srv, url, "--burst")
    try:
        assert w.proc.wait(300) == 0, w.log_tail()
    finally:
        w.stop()
    export = base / "specforge"
    first = hsq(*specforge(RUN, url, export), "--write-threads", "2", "--no-progress", check=True)
    yield {
        "base": base,
        "url": url,
        "out": out / RUN,
        "export": export,
        "tokens": tokens,
        "first": first.stdout,
    }


def test_bad_chat_rows_reach_the_dead_letter_and_the_rest_is_done(walk: dict[str, Any]) -> None:
    st = store(walk["url"], RUN)
    assert st.count(st.keys.done) == 11
    dead = st.dead_entries()
    assert sorted(e["reason"] for e in dead.values()) == [
        "empty_content",
        "no_assistant",
        "unknown_role",
    ]
    assert all(k.startswith("line:chat:") and e["message"] for k, e in dead.items())
    status = json.loads(
        hsq("status", "--run", RUN, "--redis", walk["url"], "--json", check=True).stdout
    )
    assert (status["total"], status["done"], status["dead"]) == (14, 11, 3)


@needs_specforge
def test_specforge_reads_every_export_and_every_tensor_equals_hsqs(walk: dict[str, Any]) -> None:
    st = store(walk["url"], RUN)
    files = list_feature_files(str(walk["export"]))
    assert len(files) == 11
    assert "written   11 files" in walk["first"]
    for sid, entry in st.iter_manifest():
        assert entry is not None
        path = walk["export"] / Path(entry.path).parent / f"{sid}.ckpt"
        assert str(path.resolve()) in files
        raw = load_feature_file(str(path))
        ours = open_output(walk["out"] / entry.path)
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        assert torch.equal(raw["input_ids"], ours.input_ids)
        assert torch.equal(raw["loss_mask"], ours.loss_mask)
        assert torch.equal(raw["hidden_state"], ours.last_hidden_state.unsqueeze(0))
        assert torch.equal(raw["aux_hidden_state"], ours.aux_hidden_states.unsqueeze(0))
        storages = {t.untyped_storage().data_ptr() for t in raw.values()}
        assert len(storages) == 4 and all(t.is_contiguous() for t in raw.values())
        norm = normalize_offline_sample(raw, max_len=2048)
        n = ours.num_tokens
        assert torch.equal(norm["input_ids"], ours.input_ids.unsqueeze(0))
        assert torch.equal(norm["hidden_state"], ours.aux_hidden_states.unsqueeze(0))
        assert torch.equal(norm["target"], ours.last_hidden_state.unsqueeze(0))
        assert torch.equal(norm["loss_mask"][0, : n - 1], ours.loss_mask[: n - 1])


def test_export_again_writes_nothing(walk: dict[str, Any]) -> None:
    again = hsq(*specforge(RUN, walk["url"], walk["export"]), "--no-progress", check=True)
    assert "written   0 files" in again.stdout and "skipped   11" in again.stdout


@needs_specforge
def test_a_killed_export_leaves_only_valid_ckpt_files(walk: dict[str, Any]) -> None:
    dest = walk["base"] / "killed"
    argv = hsq_command(*specforge(RUN, walk["url"], dest), "--write-threads", "1", "--no-progress")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: proc.poll() is not None or any(dest.rglob("*")), timeout=60, interval=0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    # A torn file under a .ckpt name would be picked up: show the export's own guard too.
    (dest / "00").mkdir(parents=True, exist_ok=True)
    (dest / "00" / ".torn.ckpt.1.tmp").write_bytes(b"PK\x03\x04 torn")
    for f in list_feature_files(str(dest)):
        raw = load_feature_file(f)
        assert raw["input_ids"].shape[0] == raw["aux_hidden_state"].shape[1]
    hsq(*specforge(RUN, walk["url"], dest), "--no-progress", check=True)
    assert len(list_feature_files(str(dest))) == 11
    assert not list(dest.rglob("*.tmp"))


def test_export_to_a_full_disk_says_so_in_one_line_and_resumes(walk: dict[str, Any]) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    sizes = sorted(p.stat().st_size for p in walk["export"].rglob("*.ckpt"))
    assert len(sizes) == 11
    dest = walk["base"] / "fulldisk"
    dest.mkdir()
    small = max(sum(sizes[:4]) // 1024, 64)  # room for a few files, not for all eleven
    mount = ["mount", "-t", "tmpfs", "-o", f"size={small}k", "tmpfs", str(dest)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    try:
        full = hsq(*specforge(RUN, walk["url"], dest), "--write-threads", "1", "--no-progress")
        assert full.returncode == 1, full.stdout + full.stderr
        assert "Traceback" not in full.stderr and len(full.stderr.strip().splitlines()) == 1
        assert "disk full" in full.stderr and "run the same command again" in full.stderr
        kept = len(list(dest.rglob("*.ckpt")))
        assert 0 < kept < 11 and not list(dest.rglob("*.tmp"))
        # Space freed: the same command writes only what is missing.
        bigger = ["mount", "-o", f"remount,size={sum(sizes) // 1024 * 4 + 1024}k", str(dest)]
        subprocess.run(bigger, check=True, capture_output=True)
        again = hsq(*specforge(RUN, walk["url"], dest), "--no-progress", check=True)
        assert f"written   {11 - kept} files" in again.stdout, again.stdout
        assert len(list(dest.rglob("*.ckpt"))) == 11
    finally:
        subprocess.run(["umount", "-l", str(dest)], capture_output=True)


def test_export_refuses_other_layers_and_an_unfinished_run(walk: dict[str, Any]) -> None:
    url = walk["url"]
    wrong = hsq(*specforge(RUN, url, walk["base"] / "x"), "--expect-layers", "1,3,4")
    assert wrong.returncode == 2 and "captured layers [2, 4, 5]" in wrong.stderr
    ok = hsq(*specforge(RUN, url, walk["export"]), "--expect-layers", "2,4,5", "--no-progress")
    assert ok.returncode == 0, ok.stderr
    hsq(
        "enqueue",
        str(walk["tokens"]),
        "--run",
        "walk-pending",
        "--out",
        str(walk["base"] / "out2"),
        "--redis",
        url,
        "--no-progress",
        check=True,
    )
    pending = hsq(*specforge("walk-pending", url, walk["base"] / "p"))
    assert pending.returncode == 2 and "not complete: 11 of 11" in pending.stderr
    partial = hsq(*specforge("walk-pending", url, walk["base"] / "p"), "--partial", "--no-progress")
    assert partial.returncode == 0 and "samples   0" in partial.stdout


def test_train_in_place_with_a_dataloader(walk: dict[str, Any]) -> None:
    hsq("export", "--run", RUN, "--redis", walk["url"], "--format", "manifest", check=True)
    ds = HiddenStateDataset(walk["out"], max_length=24)
    assert len(ds) == 11 and all(n > 0 for n in ds.lengths)
    loader: DataLoader[dict[str, Any]] = DataLoader(
        ds,  # type: ignore[arg-type]  # a map-style dataset; torch types it as Dataset
        batch_size=4,
        num_workers=2,
        collate_fn=collate,
    )
    seen = 0
    for batch in loader:
        b, t = batch["input_ids"].shape
        assert t <= 24 and batch["aux_hidden_states"].shape == (b, t, 3 * 64)
        assert batch["last_hidden_state"].shape == (b, t, 64)
        for row, sid in enumerate(batch["id"]):
            ours = open_output(walk["out"] / store(walk["url"], RUN).get_manifest(sid).path)  # type: ignore[union-attr]
            n = min(ours.num_tokens, 24)
            assert torch.equal(batch["input_ids"][row, :n], ours.input_ids[:n])
            assert torch.equal(batch["aux_hidden_states"][row, :n], ours.aux_hidden_states[:n])
            assert int(batch["attention_mask"][row].sum()) == n
            assert not batch["loss_mask"][row, n:].any()
        seen += b
    assert seen == 11


def test_enqueue_with_tokenizer_tokenizes_and_dead_letters_in_one_step(
    walk: dict[str, Any],
) -> None:
    base, url = walk["base"], walk["url"]
    src = base / "chats.jsonl"
    args = ["enqueue", str(src), "--tokenizer", str(base / "tok"), "--run", "walk-one"]
    args += ["--out", str(base / "out3"), "--redis", url, "--jobs", "1", "--no-progress"]
    res = hsq(*args, check=True)
    assert "enqueued        11 samples" in res.stdout
    assert (base / "chats.tokens.jsonl").read_text() == walk["tokens"].read_text()
    st = store(url, "walk-one")
    assert len(st.dead_entries()) == 3
    again = hsq(*args, check=True)  # the same command again: nothing new
    assert "enqueued        0 samples" in again.stdout
    raw = hsq("enqueue", str(src), "--run", "walk-raw", "--out", str(base / "out4"), "--redis", url)
    assert raw.returncode == 1 and "pass --tokenizer DIR" in raw.stderr


def test_dataset_without_a_manifest_pickles_and_never_unpickles(walk: dict[str, Any]) -> None:
    st = store(walk["url"], RUN)
    picked = sorted(st.iter_manifest())[:2]
    scan = walk["base"] / "scan"
    for _sid, entry in picked:
        assert entry is not None
        (scan / Path(entry.path).parent).mkdir(parents=True, exist_ok=True)
        shutil.copy(walk["out"] / entry.path, scan / entry.path)
    ds = pickle.loads(pickle.dumps(HiddenStateDataset(scan)))  # what DataLoader workers get
    assert sorted(ds[i]["id"] for i in range(len(ds))) == [sid for sid, _ in picked]
    # A pickle disguised as an output is refused by the reader, never loaded.
    evil = scan / "00" / "evil.safetensors"
    evil.parent.mkdir(exist_ok=True)
    evil.write_bytes(pickle.dumps({"input_ids": [1, 2]}))
    with_evil = HiddenStateDataset(scan)
    at = next(i for i, item in enumerate(with_evil.items) if item.sample_id == "evil")
    with pytest.raises(OutputError):
        with_evil[at]
    with pytest.raises(OutputError, match="not a readable output"):
        open_output(evil)


def test_open_output_refuses_damaged_files(walk: dict[str, Any], tmp_path: Path) -> None:
    sid, entry = next(store(walk["url"], RUN).iter_manifest())
    assert entry is not None
    good = (walk["out"] / entry.path).read_bytes()
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(good[: len(good) - 7])
    with pytest.raises(OutputError, match="not a readable output"):
        open_output(torn)
    ok = open_output(walk["out"] / entry.path)
    assert ok.sample_id == sid and ok.layer_ids == [2, 4, 5]
    assert ok.aux_hidden_states.shape == (ok.num_tokens, 3 * 64)


def test_export_reports_a_damaged_output_and_exits_1(walk: dict[str, Any]) -> None:
    copy = walk["base"] / "damaged"
    shutil.copytree(walk["out"], copy / RUN)
    _, entry = next(store(walk["url"], RUN).iter_manifest())
    assert entry is not None
    victim = copy / RUN / entry.path
    victim.write_bytes(victim.read_bytes()[:100])
    dest = walk["base"] / "from-damaged"
    res = hsq(*specforge(RUN, walk["url"], dest), "--out", str(copy), "--no-progress")
    assert res.returncode == 1 and "failed    1" in res.stdout
    assert "corrupt output: size 100 != manifest" in res.stderr
    assert len(list(dest.rglob("*.ckpt"))) == 10


GOOD_ENTRY = ManifestEntry(output_relpath("s1"), 3, 10, "crc32:0", "w", 0.0, 0)


def test_a_good_manifest_entry_is_used_as_is() -> None:
    assert checked_entry("s1", GOOD_ENTRY) is GOOD_ENTRY
    want = Path("/d") / Path(GOOD_ENTRY.path).parent / "s1.ckpt"
    assert ckpt_path(Path("/d"), "s1") == want


@pytest.mark.parametrize(
    ("sid", "entry"),
    [
        ("s1", None),
        ("s1", ManifestEntry("../../../etc/s1.safetensors", 3, 10, "crc32:0", "w", 0.0, 0)),
        ("../s1", GOOD_ENTRY),
    ],
)
def test_manifest_entries_from_redis_are_not_trusted_as_paths(
    sid: str, entry: ManifestEntry | None
) -> None:
    with pytest.raises(OutputError):
        checked_entry(sid, entry)


# ------------------------------------------------------------------ re-export and corruption
# Runs derived from the walk run by rewriting its outputs (another "model": states changed,
# NaN states, an extra pre-norm tensor, float32), registered done in Redis with their real
# checksums: what a worker would have written, without another extraction.

Transform = Callable[[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def derived_run(
    walk: dict[str, Any],
    run: str,
    transform: Transform,
    store_dtype: str = "bf16",
    *,
    prenorm: bool = False,
) -> Path:
    """`run`: walk's samples, each output rewritten through `transform`; returns OUT.
    `prenorm`: the run is enqueued with --prenorm (its outputs get the pre-norm state)."""
    from safetensors.torch import save_file

    from hsq.outputs.check import file_checksum

    out: Path = walk["base"] / f"out-{run}"
    hsq("enqueue", str(walk["tokens"]), "--run", run, "--out", str(out), "--redis", walk["url"],
        "--store-dtype", store_dtype, "--no-progress", *(["--prenorm"] if prenorm else []),
        check=True)  # fmt: skip
    st = store(walk["url"], run)
    for sid, entry in store(walk["url"], RUN).iter_manifest():
        assert entry is not None
        ours = open_output(walk["out"] / entry.path)
        tensors = {
            "input_ids": ours.input_ids.clone(),
            "loss_mask": ours.loss_mask.clone(),
            "aux_hidden_states": ours.aux_hidden_states.clone(),
            "last_hidden_state": ours.last_hidden_state.clone(),
        }
        path = out / run / entry.path
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {**ours.metadata, "run": run, "store_dtype": store_dtype}
        save_file(transform(sid, tensors), str(path), metadata=meta)
        size, crc = path.stat().st_size, file_checksum(path)
        done = ManifestEntry(entry.path, entry.num_tokens, size, crc, "test", 0.0, 1, store_dtype)
        st.client.hset(st.keys.done, sid, done.to_json())
    return out


def ckpts(dest: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.stem: torch.load(p, weights_only=True) for p in dest.rglob("*.ckpt")}


def test_reexport_after_the_run_was_redone_rewrites_every_stale_file(walk: dict[str, Any]) -> None:
    """Already valid means "this run's current output", not "loads"."""
    dest = walk["base"] / "redo-dest"
    hsq(*specforge(RUN, walk["url"], dest), "--no-progress", check=True)
    doubled = derived_run(
        walk, "walk-redo", lambda _sid, t: {**t, "last_hidden_state": t["last_hidden_state"] * 2}
    )
    again = hsq(*specforge("walk-redo", walk["url"], dest), "--out", str(doubled), "--no-progress")
    assert again.returncode == 0, again.stderr
    assert "written   11 files" in again.stdout
    for sid, entry in store(walk["url"], "walk-redo").iter_manifest():
        assert entry is not None
        got = torch.load(ckpt_path(dest, sid), weights_only=True)["hidden_state"]
        want = open_output(doubled / "walk-redo" / entry.path).last_hidden_state
        assert torch.equal(got, want.unsqueeze(0))


def test_reexport_replaces_a_nan_file_and_a_symlink_to_a_foreign_file(
    walk: dict[str, Any],
) -> None:
    dest = walk["base"] / "tamper-dest"
    hsq(*specforge(RUN, walk["url"], dest), "--no-progress", check=True)
    sids = sorted(ckpts(dest))
    nan_sid, link_sid = sids[0], sids[1]
    nan_file = ckpt_path(dest, nan_sid)
    poisoned = torch.load(nan_file, weights_only=True)
    poisoned["aux_hidden_state"] = torch.full_like(poisoned["aux_hidden_state"], float("nan"))
    torch.save(poisoned, nan_file)
    foreign = walk["base"] / "foreign.ckpt"  # right keys and length, another sample's states
    shape = torch.load(ckpt_path(dest, link_sid), weights_only=True)
    torch.save({k: torch.zeros_like(v) for k, v in shape.items()}, foreign)
    link = ckpt_path(dest, link_sid)
    link.unlink()
    link.symlink_to(foreign)
    res = hsq(*specforge(RUN, walk["url"], dest), "--no-progress", check=True)
    assert "written   2 files" in res.stdout and "skipped   9" in res.stdout
    assert not link.is_symlink() and torch.load(foreign, weights_only=True)["input_ids"].eq(0).all()
    got = ckpts(dest)
    for sid in (nan_sid, link_sid):
        assert torch.isfinite(got[sid]["aux_hidden_state"].float()).all()
        assert got[sid]["aux_hidden_state"].abs().sum() > 0


def test_export_refuses_corrupt_outputs_and_fails_them(walk: dict[str, Any]) -> None:
    """An output `verify --deep` calls corrupt is never exported."""
    victims = sorted(s for s, _ in store(walk["url"], RUN).iter_manifest())[:2]

    def poison(sid: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if sid == victims[0]:
            t["aux_hidden_states"][0, 0] = float("nan")  # recorded with its checksum
        return t

    out = derived_run(walk, "walk-nan", poison)
    entry = store(walk["url"], "walk-nan").get_manifest(victims[1])
    assert entry is not None
    flipped = bytearray((out / "walk-nan" / entry.path).read_bytes())
    flipped[-1] ^= 0x01  # a flipped bit in the states: the checksum no longer matches
    (out / "walk-nan" / entry.path).write_bytes(bytes(flipped))
    dest = walk["base"] / "nan-dest"
    res = hsq(*specforge("walk-nan", walk["url"], dest), "--out", str(out), "--no-progress")
    assert res.returncode == 1 and "failed    2" in res.stdout
    assert "aux_hidden_states holds NaN or Inf" in res.stderr
    assert "checksum mismatch" in res.stderr
    assert sorted(ckpts(dest)) == sorted(
        set(s for s, _ in store(walk["url"], RUN).iter_manifest()) - set(victims)
    )


def test_a_symlinked_shard_directory_is_never_written_through(walk: dict[str, Any]) -> None:
    dest, outside = walk["base"] / "link-dest", walk["base"] / "outside"
    outside.mkdir()
    sid = sorted(s for s, _ in store(walk["url"], RUN).iter_manifest())[0]
    shard = ckpt_path(dest, sid).parent
    shard.parent.mkdir(parents=True)
    shard.symlink_to(outside, target_is_directory=True)
    res = hsq(*specforge(RUN, walk["url"], dest), "--no-progress")
    assert res.returncode == 1 and "is a symlink; hsq export never writes through one" in res.stderr
    assert not any(outside.iterdir())
    assert shard.is_symlink()


def test_stale_files_of_samples_no_longer_done_are_listed_then_pruned(
    walk: dict[str, Any],
) -> None:
    dest = walk["base"] / "stale-dest"
    hsq(*specforge(RUN, walk["url"], dest), "--no-progress", check=True)
    extra = dest / "zz" / "gone.ckpt"
    extra.parent.mkdir()
    shutil.copy(next(dest.rglob("*.ckpt")), extra)
    res = hsq(*specforge(RUN, walk["url"], dest), "--no-progress")
    assert res.returncode == 1 and "stale     1 left" in res.stdout and "zz/gone.ckpt" in res.stderr
    pruned = hsq(*specforge(RUN, walk["url"], dest), "--prune", "--no-progress")
    assert pruned.returncode == 0 and "1 removed" in pruned.stdout and not extra.exists()


@needs_specforge
def test_a_float32_run_is_exported_as_bfloat16(walk: dict[str, Any]) -> None:
    """SpecForge's LM-head step is bf16 only: float32 states would crash it."""
    out = derived_run(
        walk,
        "walk-f32",
        lambda _sid, t: {
            **t,
            "aux_hidden_states": t["aux_hidden_states"].float(),
            "last_hidden_state": t["last_hidden_state"].float(),
        },
    )
    dest = walk["base"] / "f32-dest"
    res = hsq(*specforge("walk-f32", walk["url"], dest), "--out", str(out), "--no-progress")
    assert res.returncode == 0 and "float32 states written as bfloat16" in res.stdout
    for f in list_feature_files(str(dest)):
        raw = load_feature_file(f)
        assert raw["hidden_state"].dtype == raw["aux_hidden_state"].dtype == torch.bfloat16


# ------------------------------------------------------------------------- speculators
# Only speculators' loader is run, not its trainer: speculators 0.9.0's Trainer picks its
# device as `torch.accelerator.current_accelerator()` or else "cuda" (train/trainer.py), so on
# a CPU it moves the model to CUDA and fails; unlike SpecForge there is no one-kernel swap
# that makes it run, and its CLI also needs the verifier's HF config and flex attention.
try:
    from speculators.train.data import ArrowDataset
except ImportError as exc:
    SPECULATORS_MISSING = f"speculators==0.9.0 not importable ({exc}); run `make setup`"
else:
    SPECULATORS_MISSING = ""
if SPECULATORS_MISSING and os.environ.get("CI"):
    raise RuntimeError(SPECULATORS_MISSING)
needs_speculators = pytest.mark.skipif(bool(SPECULATORS_MISSING), reason=SPECULATORS_MISSING)


def with_prenorm(_sid: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # A stand-in for the pre-norm state (what the format carries is what is checked).
    return {**t, "last_hidden_state_prenorm": t["last_hidden_state"] * 3 + 1}


def speculators(run: str, url: str, dest: Path) -> list[str]:
    return ["export", "--run", run, "--redis", url, "--format", "speculators", "--to", str(dest)]


def test_speculators_export_refuses_a_run_without_the_prenorm_state(walk: dict[str, Any]) -> None:
    res = hsq(*speculators(RUN, walk["url"], walk["base"] / "spec-refused"))
    assert res.returncode == 2 and "no pre-norm final state" in res.stderr
    assert "hsq run DATASET --out OUT --prenorm" in res.stderr
    # Refused from the run's record, before any progress bar or file.
    assert "exporting" not in res.stderr and not (walk["base"] / "spec-refused").exists()


@needs_speculators
def test_speculators_own_loader_reads_the_export(walk: dict[str, Any]) -> None:
    out = derived_run(walk, "walk-prenorm", with_prenorm, prenorm=True)
    dest = walk["base"] / "spec"
    res = hsq(*speculators("walk-prenorm", walk["url"], dest), "--out", str(out), "--no-progress")
    assert res.returncode == 0 and "written   11 files" in res.stdout, res.stderr
    ds = ArrowDataset(max_len=2048, datapath=dest, on_missing="raise")
    assert len(ds) == 11
    ids = sorted(s for s, _ in store(walk["url"], "walk-prenorm").iter_manifest())
    counts: dict[int, int] = {}
    for i, sid in enumerate(ids):
        item = ds[i]
        assert isinstance(item, dict), item  # not SampleUnavailable
        entry = store(walk["url"], "walk-prenorm").get_manifest(sid)
        assert entry is not None
        ours = open_output(out / "walk-prenorm" / entry.path)
        assert torch.equal(item["input_ids"], ours.input_ids)
        assert torch.equal(item["loss_mask"], ours.loss_mask)
        assert torch.equal(item["hidden_states"], ours.aux_hidden_states)  # [T, 3H]
        want = with_prenorm(sid, {"last_hidden_state": ours.last_hidden_state})
        assert torch.equal(item["verifier_last_hidden_states"], want["last_hidden_state_prenorm"])
        for t in ours.input_ids[ours.loss_mask.bool()].tolist():
            counts[t] = counts.get(t, 0) + 1
    assert torch.load(dest / "token_freq.pt", weights_only=True) == counts
    again = hsq(*speculators("walk-prenorm", walk["url"], dest), "--out", str(out), "--no-progress")
    assert "written   0 files" in again.stdout and "skipped   11" in again.stdout


@needs_speculators
def test_a_failed_sample_leaves_no_gap_between_rows_and_files(walk: dict[str, Any]) -> None:
    victim = sorted(s for s, _ in store(walk["url"], RUN).iter_manifest())[3]

    def poison(sid: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t = with_prenorm(sid, t)
        if sid == victim:
            t["last_hidden_state_prenorm"][0, 0] = float("inf")
        return t

    out = derived_run(walk, "walk-gap", poison, prenorm=True)
    dest = walk["base"] / "spec-gap"
    res = hsq(*speculators("walk-gap", walk["url"], dest), "--out", str(out), "--no-progress")
    assert res.returncode == 1 and "last_hidden_state_prenorm holds NaN or Inf" in res.stderr
    ds = ArrowDataset(max_len=2048, datapath=dest, on_missing="raise")
    assert len(ds) == 10 and victim not in ds.data["id"]
    for i in range(len(ds)):
        assert isinstance(ds[i], dict)  # token ids of hs_i equal row i's: no SampleUnavailable
    assert sorted(p.name for p in (dest / "hidden_states").iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(10)
    )


@needs_speculators
@needs_specforge
def test_an_fp8_run_with_the_prenorm_state_exports_dequantized(walk: dict[str, Any]) -> None:
    """fp8 outputs (states and the pre-norm state per-token scaled) reach both trainers as
    bf16 within fp8's error."""
    from hsq import quant
    from hsq.states import scale_name

    def fp8(sid: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t = with_prenorm(sid, t)
        out = {"input_ids": t["input_ids"], "loss_mask": t["loss_mask"]}
        for name, groups in (
            ("aux_hidden_states", 3),
            ("last_hidden_state", 1),
            ("last_hidden_state_prenorm", 1),
        ):
            out[name], out[scale_name(name)] = quant.quantize(t[name], groups)
        return out

    out = derived_run(walk, "walk-fp8", fp8, store_dtype="fp8-e4m3", prenorm=True)
    spec, sf = walk["base"] / "spec-fp8", walk["base"] / "sf-fp8"
    res = hsq(*speculators("walk-fp8", walk["url"], spec), "--out", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr
    hsq(*specforge("walk-fp8", walk["url"], sf), "--out", str(out), "--no-progress", check=True)
    ds = ArrowDataset(max_len=2048, datapath=spec, on_missing="raise")
    st = store(walk["url"], RUN)
    for i, sid in enumerate(sorted(ds.data["id"])):
        item = ds[i]
        assert isinstance(item, dict)
        entry = st.get_manifest(sid)
        assert entry is not None
        last = open_output(walk["out"] / entry.path).last_hidden_state.float()
        for got, want in (
            (item["verifier_last_hidden_states"], last * 3 + 1),
            (load_feature_file(str(ckpt_path(sf, sid)))["hidden_state"][0], last),
        ):
            assert got.dtype == torch.bfloat16
            err = (got.float() - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-6)
            assert float(err.max()) < 0.06
