"""FP8 storage: quantization, both formats end to end on disk, verify, and a real fp8 run."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hsq import quant
from hsq.dataset.jsonl import Sample
from hsq.dump.format import DumpMeta, expected_shapes, fingerprint
from hsq.dump.read import open_dump_tensors
from hsq.dump.write import write_dump
from hsq.engines.reference.model import load_model
from hsq.errors import ConfigError, MetaMismatchError, NonFiniteDumpError
from hsq.outputs.check import check_output, file_checksum
from hsq.outputs.manifest import ManifestEntry
from hsq.outputs.transcode import write_output
from hsq.producer.synthetic import write_synthetic
from hsq.runconfig import RunConfig
from hsq.states import AUX_TENSOR, FP8, LAST_TENSOR
from hsq.stfile.engine import WriteEngine
from hsq.stfile.header import read_header
from tests.helpers import enqueue, hsq, start_worker, store
from tests.support.fakedump import IDENT, LAYERS
from tests.support.fakeoutput import H, states, written
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]


# ------------------------------------------------------------------------ quantization


def test_quantize_bounds_the_error_and_keeps_zero_rows_exact() -> None:
    x = states(64)[AUX_TENSOR]
    q, scale = quant.quantize(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 3)
    y = quant.dequantize(q, scale)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y[1], x[1]) and torch.equal(y[2, H : 2 * H], x[2, H : 2 * H])
    assert float(scale[1].abs().max()) == 0.0
    err = (y.float() - x.float()).reshape(64, 3, H).norm(dim=-1)
    ref = x.float().reshape(64, 3, H).norm(dim=-1)
    rel = err[ref > 0] / ref[ref > 0]
    assert float(rel.max()) < 0.06  # e4m3 has 3 mantissa bits: at most 2^-4 relative per value
    assert quant.quantized_problems(q, scale) == []
    # Each row's absmax lands on 448, so the largest magnitude is kept exactly.
    nz = ref > 0
    xmax = x.float().reshape(64, 3, H).abs().amax(-1)
    ymax = y.float().reshape(64, 3, H).abs().amax(-1)
    assert torch.equal(xmax[nz], ymax[nz])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused_before_quantizing(bad: float) -> None:
    x = states(8)[LAST_TENSOR]
    x[5, 3] = bad
    with pytest.raises(NonFiniteDumpError):
        quant.quantize(x, 1)


def test_logical_tensors_dequantize_by_default_and_hand_back_raw_when_asked() -> None:
    x = states(8)
    q, s = quant.quantize(x[AUX_TENSOR], 3)
    ql, sl = quant.quantize(x[LAST_TENSOR], 1)
    stored = {
        "input_ids": torch.arange(8),
        AUX_TENSOR: q,
        "aux_hidden_states_scale": s,
        LAST_TENSOR: ql,
        "last_hidden_state_scale": sl,
    }
    meta = {quant.META_KEY: FP8}
    out = quant.logical_tensors(stored, meta)
    assert set(out) == {"input_ids", AUX_TENSOR, LAST_TENSOR}
    assert out[AUX_TENSOR].dtype == torch.bfloat16
    assert torch.equal(out[AUX_TENSOR], quant.dequantize(q, s))
    assert quant.logical_tensors(stored, meta, raw=True) == stored
    f32 = quant.logical_tensors(stored, meta, dtype=torch.float32)
    assert f32[LAST_TENSOR].dtype == torch.float32
    old = {AUX_TENSOR: x[AUX_TENSOR], LAST_TENSOR: x[LAST_TENSOR]}  # a file from before fp8
    assert quant.logical_tensors(old, {}) == old


# ------------------------------------------------------------------------ files on disk


@pytest.mark.parametrize("store_dtype", ["bf16", "fp8-e4m3"])
def test_round_trip_through_a_file(tmp_path: Path, store_dtype: str) -> None:
    path, entry, src = written(tmp_path, store_dtype)
    assert entry.checksum == file_checksum(path) and entry.bytes == path.stat().st_size
    stored = load_file(str(path))  # safetensors' own loader opens both formats
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta[quant.META_KEY] == store_dtype
    assert stored["input_ids"].tolist() == list(range(100, 109))
    t = quant.logical_tensors(stored, meta)
    assert set(t) == {"input_ids", "loss_mask", AUX_TENSOR, LAST_TENSOR}
    if store_dtype == "bf16":
        assert torch.equal(t[AUX_TENSOR], src[AUX_TENSOR])
        assert torch.equal(t[LAST_TENSOR], src[LAST_TENSOR])
    else:
        assert stored[AUX_TENSOR].dtype == torch.float8_e4m3fn
        assert stored["aux_hidden_states_scale"].shape == (9, 3)
        assert stored["last_hidden_state_scale"].shape == (9, 1)
        q, s = quant.quantize(src[AUX_TENSOR], 3)
        assert torch.equal(stored[AUX_TENSOR].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(t[AUX_TENSOR], quant.dequantize(q, s))
        assert torch.equal(t[LAST_TENSOR][3], src[LAST_TENSOR][3])  # the zero row
    assert check_output(path, "s1", entry, deep=True, store_dtype=store_dtype) == []


def test_fp8_file_is_about_half_the_bytes(tmp_path: Path) -> None:
    bf16, _, _ = written(tmp_path, "bf16", n=64)
    fp8, _, _ = written(tmp_path, "fp8-e4m3", n=64)
    sizes = {}
    for path in (bf16, fp8):
        fd = os.open(path, os.O_RDONLY)
        try:
            h = read_header(fd)
        finally:
            os.close(fd)
        sizes[path] = {n: t.nbytes for n, t in h.tensors.items()}
    n, values = 64, 64 * 4 * H  # 3 aux layers + the last state
    assert sum(sizes[bf16].values()) == 2 * 8 * n + 2 * values
    # One byte a value instead of two, plus 4 bytes of scale per token per layer.
    assert sum(sizes[fp8].values()) == 2 * 8 * n + values + 4 * 4 * n


def _rewrite_scale(
    path: Path, entry: ManifestEntry, fn: Callable[[torch.Tensor], None]
) -> ManifestEntry:
    """Damage the scale tensor in place and record the damaged file's checksum, as if the
    writer had produced it: only the content checks can catch it then."""
    fd = os.open(path, os.O_RDWR)
    try:
        info = read_header(fd).tensors["aux_hidden_states_scale"]
        raw = bytearray(os.pread(fd, info.nbytes, info.start))
        scale = torch.frombuffer(raw, dtype=torch.float32)
        fn(scale)
        os.pwrite(fd, bytes(raw), info.start)
    finally:
        os.close(fd)
    return ManifestEntry(**{**entry.__dict__, "checksum": file_checksum(path)})


@pytest.mark.parametrize(
    ("damage", "expect"),
    [
        (lambda s: s.__setitem__(4, float("nan")), "NaN or Inf"),
        (lambda s: s.__setitem__(0, -s[0]), "negative"),
        (lambda s: s.__setitem__(0, 0.0), "zero scale"),
        (lambda s: s.__setitem__(3, 1.0), "448"),  # token 1 is all zero: its scales are 0
        # Finite, but 448 * 1e38 is not: the file read back +Inf
        (lambda s: s.__setitem__(0, 1e38), "scale * 448 overflows"),
    ],
)
def test_verify_catches_a_corrupted_scale_tensor(
    tmp_path: Path, damage: Callable[[torch.Tensor], None], expect: str
) -> None:
    path, entry, _ = written(tmp_path, "fp8-e4m3")
    # Any flipped byte fails the checksum first.
    data = bytearray(path.read_bytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        info = read_header(fd).tensors["aux_hidden_states_scale"]
    finally:
        os.close(fd)
    data[info.start + 1] ^= 0x40
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(bytes(data))
    assert check_output(copy, "s1", entry, deep=True) == ["checksum mismatch"]
    # A scale the writer got wrong (checksum of the bad file recorded) fails the content checks.
    bad = _rewrite_scale(path, entry, damage)
    problems = check_output(path, "s1", bad, deep=True, store_dtype="fp8-e4m3")
    assert problems and expect in " ".join(problems), problems


def test_files_and_entries_from_before_fp8_still_read_as_bf16(tmp_path: Path) -> None:
    path, entry, src = written(tmp_path, "bf16")
    with safe_open(str(path), "pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k != quant.META_KEY}
    save_file(load_file(str(path)), str(path), metadata=meta)  # as hsq wrote it before
    raw = json.loads(entry.to_json())
    del raw["store_dtype"]
    old = ManifestEntry.from_json(json.dumps(raw))
    old = ManifestEntry(**{**old.__dict__, "bytes": path.stat().st_size})
    old = ManifestEntry(**{**old.__dict__, "checksum": file_checksum(path)})
    assert old.store_dtype == "bf16"
    assert check_output(path, "s1", old, deep=True, store_dtype="bf16") == []
    t = quant.logical_tensors(load_file(str(path)), meta)
    assert torch.equal(t[AUX_TENSOR], src[AUX_TENSOR])


def test_a_file_in_another_format_than_the_runs_is_refused(tmp_path: Path) -> None:
    path, entry, _ = written(tmp_path, "fp8-e4m3")
    problems = check_output(path, "s1", entry, store_dtype="bf16")
    assert problems == ["stored as fp8-e4m3, the run stores bf16"]
    bf, bentry, _ = written(tmp_path, "bf16")
    assert "stored as bf16, the run stores fp8-e4m3" in check_output(
        bf, "s1", bentry, store_dtype="fp8-e4m3"
    )
    # A manifest entry that disagrees with the file is caught too.
    wrong = ManifestEntry(**{**entry.__dict__, "store_dtype": "bf16"})
    assert check_output(path, "s1", wrong) == ["stored as fp8-e4m3, manifest says bf16"]


# ------------------------------------------------------------------------ a real run


@pytest.fixture(scope="module")
def server(server_factory: Factory) -> ReferenceServer:
    return server_factory("--warmup", "2", name="fp8srv").wait_ready()


def test_fp8_run_end_to_end_with_real_processes(
    tmp_path: Path, server: ReferenceServer, redis_url: str
) -> None:
    httpx.delete(server.url + "/admin/faults").raise_for_status()
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 12, seed=5, min_len=4, max_len=300)
    out = tmp_path / "out"
    enqueue(ds, "f8", out, redis_url, "--store-dtype", "fp8-e4m3", "--chunk-size", "4")
    st = store(redis_url, "f8")
    assert st.require_config().store_dtype == "fp8-e4m3"
    w = start_worker(tmp_path, "f8", server, redis_url, "--burst")
    assert w.proc.wait(120) == 0, w.log_tail()
    assert st.count(st.keys.done) == 12 and st.count(st.keys.dead) == 0

    torch.set_num_threads(2)
    model = load_model(
        "tiny", device="cpu", dtype=torch.float32, dump_dtype=torch.bfloat16, layers=None
    )
    samples = [json.loads(line) for line in ds.read_text().splitlines()]
    for sample in samples:
        entry = st.get_manifest(sample["id"])
        assert entry is not None and entry.store_dtype == "fp8-e4m3"
        path = out / "f8" / entry.path
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        assert meta[quant.META_KEY] == "fp8-e4m3"
        direct = model.forward(sample["input_ids"])
        q, s = quant.quantize(direct.aux, 3)
        # The worker's bytes are exactly the quantization of the model's states ...
        assert torch.equal(stored[AUX_TENSOR].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(stored["aux_hidden_states_scale"], s)
        # ... and read back transparently as bf16 close to them.
        t = quant.logical_tensors(stored, meta)
        cos = torch.nn.functional.cosine_similarity(
            t[LAST_TENSOR].float(), direct.last.float(), dim=-1
        )
        assert float(cos.min()) > 0.99
        assert t["input_ids"].tolist() == sample["input_ids"]

    assert (
        "ok 12" in hsq("verify", "--run", "f8", "--redis", redis_url, "--deep", check=True).stdout
    )

    # Re-enqueueing without the flag keeps the run's format; another format is refused.
    enqueue(ds, "f8", out, redis_url)
    assert st.require_config().store_dtype == "fp8-e4m3"
    proc = hsq(
        "enqueue",
        str(ds),
        "--run",
        "f8",
        "--out",
        str(out),
        "--redis",
        redis_url,
        "--store-dtype",
        "bf16",
        "--no-progress",
    )
    assert proc.returncode == 2 and "store_dtype" in proc.stderr

    # One file replaced by a bf16 copy (as if copied from another run): a mixed run fails verify.
    sid = samples[0]["id"]
    entry = st.get_manifest(sid)
    assert entry is not None
    path = out / "f8" / entry.path
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        logical = quant.logical_tensors({k: f.get_tensor(k) for k in f.keys()}, meta)  # noqa: SIM118
    save_file(logical, str(path), metadata={**meta, quant.META_KEY: "bf16"})
    mixed = ManifestEntry(
        **{
            **entry.__dict__,
            "bytes": path.stat().st_size,
            "checksum": file_checksum(path),
            "store_dtype": "bf16",
        }
    )
    st.client.hset(st.keys.done, sid, mixed.to_json())
    proc = hsq("verify", "--run", "f8", "--redis", redis_url, "--deep")
    assert proc.returncode == 1
    assert f"corrupt  {sid}: stored as bf16, the run stores fp8-e4m3" in proc.stdout


def test_run_config_store_dtype_defaults_to_bf16_and_is_checked() -> None:
    old = {b"run": b'"r"', b"dataset": b'"/d"', b"out": b'"/o"'}  # recorded before fp8
    assert RunConfig.from_redis(old).store_dtype == "bf16"
    fp8 = RunConfig("r", "/d", "/o", store_dtype="fp8-e4m3")
    assert RunConfig.from_redis({k.encode(): v.encode() for k, v in fp8.to_redis().items()}) == fp8
    assert RunConfig.from_redis(old).conflicts(fp8) == [
        "store_dtype: recorded 'bf16', given 'fp8-e4m3'"
    ]
    with pytest.raises(ConfigError):
        RunConfig("r", "/d", "/o", store_dtype="fp16").validate()


def test_open_output_dequantizes_fp8_and_hands_back_raw_when_asked(tmp_path: Path) -> None:
    """The training reader (hsq.data, hsq export) sees bf16 states for both formats."""
    from hsq.outputs.format import open_output

    bf16_path, _, _ = written(tmp_path, "bf16")
    fp8_path, _, tensors = written(tmp_path, "fp8-e4m3")
    plain, deq = open_output(bf16_path), open_output(fp8_path)
    assert deq.aux_hidden_states.dtype == torch.bfloat16 and not deq.scales
    assert torch.equal(plain.aux_hidden_states, tensors[AUX_TENSOR])
    for name, got in ((AUX_TENSOR, deq.aux_hidden_states), (LAST_TENSOR, deq.last_hidden_state)):
        want = tensors[name].float()
        err = (got.float() - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-6)
        assert float(err.max()) < 0.06
    assert torch.equal(deq.input_ids, plain.input_ids)
    raw = open_output(fp8_path, raw=True)
    assert raw.aux_hidden_states.dtype == torch.float8_e4m3fn
    assert sorted(raw.scales) == [AUX_TENSOR + "_scale", LAST_TENSOR + "_scale"]
    assert list(raw.scales[AUX_TENSOR + "_scale"].shape) == [9, 3]


# ------------------------------------------------------------------------ fp8 made by a server


def test_device_quantizer_is_bit_identical_to_the_workers() -> None:
    """quantize_on_device (the servers') and quantize (the worker's) make the same bytes,
    so outputs of one run are the same whoever quantized them; chunking changes nothing."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(700, 3 * H, generator=gen) * torch.rand(700, 1, generator=gen) * 80).to(
        torch.bfloat16
    )
    x[4] = 0
    x[9, H : 2 * H] = 0
    x[11, 2] = 1e-30
    q, s = quant.quantize(x, 3)
    for chunk in (64, 1024):
        q2, s2 = quant.quantize_on_device(x, 3, chunk_tokens=chunk)
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
        assert q2.device == x.device and quant.quantized_problems(q2, s2) == []
    y = x.float()
    y[5, 7] = float("nan")  # no exception (that would sync a GPU): it travels as NaN
    y0 = y.clone()
    _q, s3 = quant.quantize_on_device(y, 3)
    assert bool(s3[5].isnan().any())
    assert torch.equal(y.nan_to_num(), y0.nan_to_num())  # the input is never scaled in place


@pytest.mark.parametrize("prenorm", [False, True])
def test_fp8_dump_is_copied_not_requantized(
    tmp_path: Path, prenorm: bool, engine: WriteEngine
) -> None:
    """write_output of a server-quantized dump: the stored tensors are the dump's bytes,
    laid out exactly as the worker's own quantization lays them out, and verify --deep's
    checks pass."""
    from hsq.states import PRENORM_TENSOR, scale_name, state_tensors

    n = 9
    ids = list(range(100, 100 + n))
    src = states(n)
    src[PRENORM_TENSOR] = (src[LAST_TENSOR].float() * 7).to(torch.bfloat16)
    coded: dict[str, torch.Tensor] = {}
    for name, groups in state_tensors(3, prenorm):
        coded[name], coded[scale_name(name)] = quant.quantize_on_device(src[name], groups)
    meta = DumpMeta(
        "r",
        n,
        fingerprint(ids),
        LAYERS,
        H,
        "bfloat16",
        IDENT,
        expected_shapes(n, 3, H, encoding=FP8, prenorm=prenorm),
        0,
        encoding=FP8,
        prenorm=prenorm,
    )
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    dump = open_dump_tensors(write_dump(dumps, 0, meta, coded), meta)
    out = tmp_path / "server.safetensors"
    try:
        nbytes, crc = write_output(
            out, Sample("s1", ids, None), meta, dump, "run", FP8, engine=engine, prenorm=prenorm
        )
        with pytest.raises(MetaMismatchError):  # never a bf16 file from an fp8 dump
            write_output(
                tmp_path / "x.safetensors", Sample("s1", ids, None), meta, dump, "run",
                engine=engine,
            )  # fmt: skip
    finally:
        dump.close()
    # The worker quantizing the same states itself writes the same file.
    plain_meta = DumpMeta(
        "r", n, fingerprint(ids), LAYERS, H, "bfloat16", IDENT,
        expected_shapes(n, 3, H, prenorm=prenorm), 0, prenorm=prenorm,
    )  # fmt: skip
    plain = {name: src[name] for name, _ in state_tensors(3, prenorm)}
    pdump = open_dump_tensors(write_dump(dumps, 1, plain_meta, plain), plain_meta)
    own = tmp_path / "worker.safetensors"
    try:
        write_output(
            own, Sample("s1", ids, None), plain_meta, pdump, "run", FP8, engine=engine,
            prenorm=prenorm,
        )  # fmt: skip
    finally:
        pdump.close()
    assert out.read_bytes() == own.read_bytes()
    entry = ManifestEntry(out.name, n, nbytes, crc, "w", 0.0, 1, FP8)
    assert check_output(out, "s1", entry, deep=True, store_dtype=FP8, prenorm=prenorm) == []
    if not prenorm:
        assert check_output(out, "s1", entry, store_dtype=FP8, prenorm=True) == [
            "last_hidden_state_prenorm shape None does not start with 9"
        ]
