"""The dump protocol: round trip, every typed error, and a reader racing a writer."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from hsq import errors
from hsq.dump.find import clear_dump_dir, scan, wait_for_dump
from hsq.dump.format import (
    META_FILE,
    TENSOR_FILE,
    DumpMeta,
    expected_shapes,
    fingerprint,
)
from hsq.dump.read import read_dump
from hsq.dump.write import write_dump
from hsq.states import AUX_TENSOR, LAST_TENSOR
from tests.conftest import expected_for
from tests.support.fakedump import IDENT, IDS, LAYERS, make


def test_round_trip(dump_dir: Path) -> None:
    path = make(dump_dir, 7, IDS, "r1")
    assert path.name == "req_7" and not list(dump_dir.glob("*.tmp"))
    assert wait_for_dump(dump_dir, timeout=1) == path
    exp = expected_for(
        IDS, "r1", layer_ids=LAYERS, hidden_size=16, dtype="bfloat16", model_id=IDENT.model_id
    )
    dump = read_dump(path, exp)
    assert dump.aux_hidden_states.shape == (12, 48)
    assert dump.last_hidden_state.dtype == torch.bfloat16
    assert dump.meta.layer_convention == "hf_hidden_states"
    assert clear_dump_dir(dump_dir) == 1 and scan(dump_dir).complete == []


def test_fingerprint_is_int32_bytes_and_order_sensitive() -> None:
    assert fingerprint([1, 2, 3]) == fingerprint(torch.tensor([1, 2, 3], dtype=torch.int32))
    assert fingerprint([1, 2, 3]) != fingerprint([3, 2, 1])
    with pytest.raises(ValueError):
        fingerprint([2**31])


def test_no_dump(dump_dir: Path) -> None:
    with pytest.raises(errors.NoDumpError):
        wait_for_dump(dump_dir, timeout=0.05)


def test_multiple_dumps(dump_dir: Path) -> None:
    make(dump_dir, 1, IDS[:6], "r")
    make(dump_dir, 2, IDS[6:], "r")
    with pytest.raises(errors.MultipleDumpsError) as info:
        wait_for_dump(dump_dir, timeout=1)
    assert info.value.reason == "multiple_dumps"


def test_complete_plus_pending_is_multiple(dump_dir: Path) -> None:
    make(dump_dir, 1, IDS, "r")
    (dump_dir / "req_2.tmp").mkdir()
    with pytest.raises(errors.MultipleDumpsError):
        wait_for_dump(dump_dir, timeout=0.05)


def test_incomplete_without_done(dump_dir: Path) -> None:
    make(dump_dir, 3, IDS, "r", mark_done=False)
    with pytest.raises(errors.IncompleteDumpError):
        wait_for_dump(dump_dir, timeout=0.05)
    with pytest.raises(errors.IncompleteDumpError):
        read_dump(dump_dir / "req_3", expected_for(IDS, "r"))


def test_leftover_tmp_is_incomplete_and_cleared(dump_dir: Path) -> None:
    (dump_dir / "req_9.tmp").mkdir()
    (dump_dir / "req_9.tmp" / TENSOR_FILE).write_bytes(b"partial")
    (dump_dir / "worker.lock").write_text("keep me")
    with pytest.raises(errors.IncompleteDumpError):
        wait_for_dump(dump_dir, timeout=0.05)
    assert clear_dump_dir(dump_dir) == 1
    assert [p.name for p in dump_dir.iterdir()] == ["worker.lock"]


def test_stale_rid_and_fingerprint(dump_dir: Path) -> None:
    path = make(dump_dir, 1, IDS, "other-request")
    with pytest.raises(errors.StaleDumpError, match="rid"):
        read_dump(path, expected_for(IDS, "mine"))
    with pytest.raises(errors.StaleDumpError, match="fingerprint"):
        read_dump(path, expected_for([*IDS[:-1], 5], "other-request"))


def test_wrong_length(dump_dir: Path) -> None:
    path = make(dump_dir, 1, IDS[:-1], "r", input_fingerprint=fingerprint(IDS))
    with pytest.raises(errors.WrongLengthError):
        read_dump(path, expected_for(IDS, "r"))


@pytest.mark.parametrize(
    "field,value",
    [("layer_ids", [3, 4, 5]), ("hidden_size", 32), ("dtype", "float16"), ("model_id", "x@1")],
)
def test_meta_mismatch(dump_dir: Path, field: str, value: object) -> None:
    path = make(dump_dir, 1, IDS, "r")
    with pytest.raises(errors.MetaMismatchError, match=field.removesuffix("_id")):
        read_dump(path, expected_for(IDS, "r", **{field: value}))


def test_corrupt_tensor_file(dump_dir: Path) -> None:
    path = make(dump_dir, 1, IDS, "r")
    (path / TENSOR_FILE).write_bytes(b"\x00not safetensors")
    with pytest.raises(errors.CorruptDumpError, match="unreadable"):
        read_dump(path, expected_for(IDS, "r"))


def test_truncated_tensor_file(dump_dir: Path) -> None:
    path = make(dump_dir, 1, IDS, "r")
    data = (path / TENSOR_FILE).read_bytes()
    (path / TENSOR_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(errors.CorruptDumpError):
        read_dump(path, expected_for(IDS, "r"))


def test_corrupt_meta(dump_dir: Path) -> None:
    path = make(dump_dir, 1, IDS, "r")
    (path / META_FILE).write_text("{not json")
    with pytest.raises(errors.CorruptDumpError, match=r"meta\.json"):
        read_dump(path, expected_for(IDS, "r"))
    (path / META_FILE).write_text(json.dumps({"rid": "r"}))
    with pytest.raises(errors.CorruptDumpError):
        read_dump(path, expected_for(IDS, "r"))


def test_shapes_disagree_with_meta(dump_dir: Path) -> None:
    path = make(dump_dir, 1, IDS, "r", tensors={AUX_TENSOR: [12, 48], LAST_TENSOR: [12, 17]})
    with pytest.raises(errors.CorruptDumpError, match="disagree"):
        read_dump(path, expected_for(IDS, "r"))


def test_tensor_dtype_disagrees_with_meta(dump_dir: Path) -> None:
    path = make(dump_dir, 1, IDS, "r", dtype="float16")
    with pytest.raises(errors.CorruptDumpError, match="is BF16, meta says float16"):
        read_dump(path, expected_for(IDS, "r"))


def test_non_finite(dump_dir: Path) -> None:
    n = len(IDS)
    tensors = {
        AUX_TENSOR: torch.zeros(n, 48, dtype=torch.bfloat16),
        LAST_TENSOR: torch.zeros(n, 16, dtype=torch.bfloat16),
    }
    tensors[LAST_TENSOR][3, 1] = float("inf")
    meta = DumpMeta(
        "r", n, fingerprint(IDS), LAYERS, 16, "bfloat16", IDENT, expected_shapes(n, 3, 16), 0
    )
    path = write_dump(dump_dir, 0, meta, tensors)
    with pytest.raises(errors.NonFiniteDumpError) as info:
        read_dump(path, expected_for(IDS, "r"))
    assert info.value.reason == "non_finite"
    assert isinstance(info.value, errors.CorruptDumpError)
    read_dump(path, expected_for(IDS, "r"), check_finite=False)


def test_wait_sees_a_dump_written_later(dump_dir: Path) -> None:
    t = threading.Timer(0.1, lambda: make(dump_dir, 4, IDS, "late"))
    t.start()
    path = wait_for_dump(dump_dir, timeout=5)
    t.join()
    assert read_dump(path, expected_for(IDS, "late")).meta.request_index == 4


def test_reader_racing_writer_never_sees_half_a_dump(dump_dir: Path) -> None:
    """A writer thread writes 150 dumps of varied size; a reader polls as fast as it can.

    Every dump the reader considers complete must validate in full.
    """
    inputs = {i: list(range(i, i + 5 + (i * 37) % 400)) for i in range(150)}
    stop = threading.Event()
    seen: set[int] = set()
    failures: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            for path in scan(dump_dir).complete:
                i = int(path.name.removeprefix("req_"))
                try:
                    read_dump(path, expected_for(inputs[i], f"r{i}"))
                    seen.add(i)
                except errors.DumpError as exc:
                    failures.append(f"{path.name}: {exc!r}")

    th = threading.Thread(target=reader)
    th.start()
    try:
        for i, ids in inputs.items():
            make(dump_dir, i, ids, f"r{i}")
            time.sleep(0.001)
    finally:
        stop.set()
        th.join()
    assert failures == []
    assert len(seen) > 10


# ---------------------------------------------------------------------------- format 2


def make_v2(
    dump_dir: Path, ids: list[int], rid: str, *, encoding: str, prenorm: bool, **over: object
) -> Path:
    """A format 2 dump as the servers write it (fp8: hsq.quant.quantize_on_device)."""
    from hsq import quant
    from hsq.states import FP8, PRENORM_TENSOR, scale_name, state_tensors

    n = len(ids)
    gen = torch.Generator().manual_seed(n)
    states = {
        AUX_TENSOR: torch.randn(n, len(LAYERS) * 16, generator=gen).to(torch.bfloat16),
        LAST_TENSOR: torch.randn(n, 16, generator=gen).to(torch.bfloat16),
        PRENORM_TENSOR: (torch.randn(n, 16, generator=gen) * 30).to(torch.bfloat16),
    }
    tensors: dict[str, torch.Tensor] = {}
    for name, groups in state_tensors(len(LAYERS), prenorm):
        if encoding == FP8:
            tensors[name], tensors[scale_name(name)] = quant.quantize_on_device(
                states[name], groups
            )
        else:
            tensors[name] = states[name]
    meta = DumpMeta(
        **{  # type: ignore[arg-type]
            "rid": rid,
            "num_tokens": n,
            "input_fingerprint": fingerprint(ids),
            "layer_ids": LAYERS,
            "hidden_size": 16,
            "dtype": "bfloat16",
            "model": IDENT,
            "tensors": expected_shapes(n, 3, 16, encoding=encoding, prenorm=prenorm),
            "request_index": 0,
            "encoding": encoding,
            "prenorm": prenorm,
            **over,
        }
    )
    return write_dump(dump_dir, len(list(dump_dir.iterdir())), meta, tensors)


@pytest.mark.parametrize(
    ("encoding", "prenorm"), [("fp8-e4m3", False), ("fp8-e4m3", True), ("plain", True)]
)
def test_format_2_round_trip(dump_dir: Path, encoding: str, prenorm: bool) -> None:
    path = make_v2(dump_dir, IDS, "v2", encoding=encoding, prenorm=prenorm)
    raw = json.loads((path / META_FILE).read_text())
    assert raw["format_version"] == 2
    exp = expected_for(IDS, "v2", store_dtype="fp8-e4m3", prenorm=prenorm)
    dump = read_dump(path, exp)
    assert dump.meta.encoding == encoding and dump.meta.prenorm == prenorm
    assert ("last_hidden_state_prenorm" in dump.tensors) == prenorm
    if encoding == "fp8-e4m3":
        assert dump.aux_hidden_states.dtype == torch.float8_e4m3fn
        assert dump.tensors["aux_hidden_states_scale"].shape == (len(IDS), 3)


def test_plain_dumps_keep_format_1_byte_for_byte(dump_dir: Path) -> None:
    """What a worker that reads format 1 only would refuse is never in a plain dump."""
    raw = json.loads((make(dump_dir, 0, IDS, "v1") / META_FILE).read_text())
    assert raw["format_version"] == 1 and "encoding" not in raw and "prenorm" not in raw


def test_fp8_dump_is_refused_for_a_bf16_run(dump_dir: Path) -> None:
    path = make_v2(dump_dir, IDS, "f", encoding="fp8-e4m3", prenorm=False)
    with pytest.raises(errors.MetaMismatchError, match="--store-dtype fp8-e4m3"):
        read_dump(path, expected_for(IDS, "f", store_dtype="bf16"))


def test_dump_without_prenorm_is_refused_for_a_prenorm_run(dump_dir: Path) -> None:
    path = make(dump_dir, 0, IDS, "p")
    with pytest.raises(errors.MetaMismatchError, match="--prenorm"):
        read_dump(path, expected_for(IDS, "p", prenorm=True))
    # The other way round is fine: a run without prenorm leaves the extra tensor out.
    extra = make_v2(dump_dir, IDS, "q", encoding="plain", prenorm=True)
    read_dump(extra, expected_for(IDS, "q", prenorm=False))


@pytest.mark.parametrize(
    ("over", "error", "says"),
    [
        ({"encoding": "fp4"}, errors.CorruptDumpError, "unknown encoding"),
        ({"format_version": 1}, errors.CorruptDumpError, "format 2"),
        ({"format_version": 3}, errors.CorruptDumpError, "reads 1 and 2"),
        ({"prenorm": "yes"}, errors.CorruptDumpError, "wrong type"),
    ],
)
def test_bad_format_2_meta(
    dump_dir: Path, over: dict[str, object], error: type[Exception], says: str
) -> None:
    path = make_v2(dump_dir, IDS, "b", encoding="fp8-e4m3", prenorm=True)
    raw = json.loads((path / META_FILE).read_text())
    (path / META_FILE).write_text(json.dumps({**raw, **over}))
    with pytest.raises(error, match=says):
        read_dump(path, expected_for(IDS, "b"))


def test_fp8_dump_with_a_nan_or_negative_scale_is_refused(dump_dir: Path) -> None:
    from hsq.stfile.header import read_header

    for bad, error in ((float("nan"), errors.NonFiniteDumpError), (-1.0, errors.CorruptDumpError)):
        path = make_v2(dump_dir, IDS, f"s{bad}", encoding="fp8-e4m3", prenorm=False)
        with open(path / TENSOR_FILE, "r+b") as f:
            info = read_header(f.fileno()).tensors["last_hidden_state_scale"]
            f.seek(info.start)
            f.write(torch.tensor([bad], dtype=torch.float32).numpy().tobytes())
        with pytest.raises(error):
            read_dump(path, expected_for(IDS, f"s{bad}"))


def test_fp8_dump_with_bf16_values_is_refused(dump_dir: Path) -> None:
    """meta says fp8-e4m3, the file holds the states in bf16: corrupt, never copied."""
    from hsq.states import scale_name

    path = make(
        dump_dir,
        0,
        IDS,
        "x",
        encoding="fp8-e4m3",
        tensors={
            **expected_shapes(len(IDS), 3, 16),
            scale_name(AUX_TENSOR): [len(IDS), 3],
            scale_name(LAST_TENSOR): [len(IDS), 1],
        },
    )
    with pytest.raises(errors.CorruptDumpError):
        read_dump(path, expected_for(IDS, "x"))


def test_ready_marker_formats() -> None:
    from hsq.dump.ready import ReadyMarker

    plain = ReadyMarker((2, 4, 5), IDENT, "hsq-reference", "1", "1", 7, 1.0)
    raw = json.loads(plain.to_json())
    assert raw["format_version"] == 1 and "encoding" not in raw and "prenorm" not in raw
    assert ReadyMarker.from_json(plain.to_json()) == plain
    v2 = ReadyMarker(
        (2, 4, 5), IDENT, "sglang", "1", "1", 7, 1.0, encoding="fp8-e4m3", prenorm=True
    )
    assert ReadyMarker.from_json(v2.to_json()) == v2 and v2.format_version == 2
    with pytest.raises(errors.HookInactiveError, match="unknown encoding"):
        ReadyMarker.from_json(json.dumps({**json.loads(v2.to_json()), "encoding": "fp4"}))
    with pytest.raises(errors.HookInactiveError, match="cannot describe"):
        ReadyMarker.from_json(json.dumps({**json.loads(v2.to_json()), "format_version": 1}))
    with pytest.raises(errors.HookInactiveError, match="reads 1 and 2"):
        ReadyMarker.from_json(json.dumps({**raw, "format_version": 3}))
    with pytest.raises(errors.HookInactiveError, match="true or false"):
        ReadyMarker.from_json(json.dumps({**json.loads(v2.to_json()), "prenorm": 1}))
