"""Raw safetensors I/O: files safetensors reads back, strict parsing, finite checks, copies
(hsq.stfile: header, integrity, the write engine)."""

from __future__ import annotations

import os
import random
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open

from hsq.stfile import engine as engine_module
from hsq.stfile.engine import (
    DIRECT_CHUNK,
    DIRECT_MIN_BYTES,
    Produced,
    Range,
    SourceError,
    WriteEngine,
)
from hsq.stfile.header import (
    FormatError,
    build_header,
    dtype_code,
    map_file,
    read_header,
    tensor_bytes,
    torch_dtype,
)
from hsq.stfile.integrity import (
    Digest,
    FiniteCheck,
    NonFiniteError,
    all_finite,
    checksum_algo,
)


def xxh3(data: bytes) -> str:
    return f"xxh3:{xxhash.xxh3_64_intdigest(data):016x}"


def write_file(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> int:
    entries = [
        (k, dtype_code(v.dtype), list(v.shape), v.numel() * v.element_size())
        for k, v in tensors.items()
    ]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with WriteEngine() as engine:
            n, crc = engine.write(
                fd,
                build_header(entries, meta),
                [tensor_bytes(v) for v in tensors.values()],
            )
    finally:
        os.close(fd)
    assert crc == xxh3(path.read_bytes())
    return n


def test_files_are_read_back_by_safetensors(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7),
        "c": torch.randn(2, 2, 2),
    }
    path = tmp_path / "x.safetensors"
    n = write_file(path, tensors, {"k": "v"})
    assert n == path.stat().st_size
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"k": "v"}
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v)
    fd = os.open(path, os.O_RDONLY)
    header = read_header(fd)
    os.close(fd)
    assert header.tensors["a"].shape == [3, 5] and header.tensors["a"].dtype == "BF16"


@pytest.mark.parametrize("damage", ["truncate", "extend", "garbage", "bad_offsets"])
def test_damaged_files_are_format_errors(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "x.safetensors"
    write_file(path, {"a": torch.zeros(4, 4)}, {})
    data = path.read_bytes()
    if damage == "truncate":
        data = data[:-5]
    elif damage == "extend":
        data += b"\0"
    elif damage == "garbage":
        data = b"\xff" * 64
    else:
        data = data.replace(b"[0,64]", b"[0,60]")
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(FormatError):
            read_header(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_all_finite(tmp_path: Path, dtype: torch.dtype, bad: float | None) -> None:
    t = torch.randn(64, 33).to(dtype)
    if bad is not None:
        t[63, 32] = bad
    path = tmp_path / "x.safetensors"
    write_file(path, {"t": t}, {})
    fd = os.open(path, os.O_RDONLY)
    mm = map_file(fd)
    header = read_header(fd)
    assert all_finite(mm, header.tensors["t"], chunk_bytes=256) is (bad is None)
    mm.close()
    os.close(fd)


def test_copy_across_filesystems(tmp_path: Path, engine: WriteEngine) -> None:
    """Dump dirs live on tmpfs and outputs on disk: a range is read from one, written to
    the other."""
    src_dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    src = src_dir / f"hsq-test-{os.getpid()}.bin"
    payload = os.urandom(300_000)
    src.write_bytes(payload)
    try:
        fd = os.open(src, os.O_RDONLY)
        out = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT)
        n, crc = engine.write(out, b"HEADER", [(fd, 1000, 200_000), b"tail"])
        os.close(out)
        os.close(fd)
    finally:
        src.unlink()
    data = (tmp_path / "out.bin").read_bytes()
    assert data == b"HEADER" + payload[1000:201_000] + b"tail"
    assert n == len(data) and crc == xxh3(data)


@pytest.mark.parametrize("direct", [True, False])
def test_large_files_same_bytes_with_and_without_direct_io(tmp_path: Path, direct: bool) -> None:
    """Files over DIRECT_MIN_BYTES go through O_DIRECT where the filesystem allows it (the
    unaligned tail through the buffered descriptor): the bytes and crc must not change."""
    engine = WriteEngine(direct_io=direct)
    n = DIRECT_MIN_BYTES + DIRECT_CHUNK + 12345  # chunks, a tail, odd size
    src_path = tmp_path / "src.bin"
    src_path.write_bytes(os.urandom(n + 100))
    small = os.urandom(777)
    header = build_header([("s", "U8", [777], 777), ("big", "U8", [n], n)], {"k": "v"})
    sfd = os.open(src_path, os.O_RDONLY)
    out = tmp_path / "out.safetensors"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        total, crc = engine.write(fd, header, [small, Range(sfd, 50, n)])
        assert os.lseek(fd, 0, os.SEEK_CUR) == total
        os.fsync(fd)
    finally:
        os.close(fd)
        os.close(sfd)
        engine.close()
    data = out.read_bytes()
    assert len(data) == total == len(header) + 777 + n
    assert data == header + small + src_path.read_bytes()[50 : 50 + n]
    assert crc == xxh3(data)
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"k": "v"}


def test_direct_io_refused_mid_file_falls_back_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that opens O_DIRECT but refuses the writes (EINVAL) gets the same file
    through the page cache, and is not tried again."""
    import errno
    import fcntl

    real = engine_module._pwrite_all

    def refuse(fd: int, data: memoryview | bytes, at: int) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, data, at)

    monkeypatch.setattr(engine_module, "_pwrite_all", refuse)
    engine = WriteEngine(direct_io=True)
    payload = os.urandom(DIRECT_MIN_BYTES + 5)
    header = build_header([("x", "U8", [len(payload)], len(payload))], None)
    out = tmp_path / "o.safetensors"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        total, crc = engine.write(fd, header, [payload])
    finally:
        os.close(fd)
        engine.close()
    assert out.read_bytes() == header + payload and total == len(header) + len(payload)
    assert crc == xxh3(header + payload)
    assert os.stat(out).st_dev in engine.direct_refused


@pytest.mark.parametrize("code", ["BF16", "F16", "F32", "F8_E4M3"])
def test_streamed_finite_check_whatever_the_piece_boundaries(code: str) -> None:
    """The check sees whole elements even when reads end mid-element (a short read, a
    buffer boundary): one bad value is found wherever it sits, clean bytes pass."""
    dtype = torch_dtype(code)
    good = torch.randn(1000).to(dtype)
    raw = tensor_bytes(good).tobytes()
    bad_t = good.clone()
    bad_t[517] = float("nan")
    bad = tensor_bytes(bad_t).tobytes()
    for cuts in ([1, 3, 7], [5, 2, 9, 1], [len(raw) // 2 + 1]):
        for data, want in ((raw, False), (bad, True)):
            check = FiniteCheck(code, "t")
            pos, i, found = 0, 0, False
            try:
                while pos < len(data):
                    step = cuts[i % len(cuts)] if len(cuts) > 1 else cuts[0]
                    check.feed(memoryview(data)[pos : pos + step])
                    pos, i = pos + step, i + 1
                assert check.carry == b""
            except NonFiniteError:
                found = True
            assert found is want, (code, cuts, want)


def test_checked_range_refuses_nan_and_leaves_the_checksum_of_what_was_written(
    tmp_path: Path, engine: WriteEngine
) -> None:
    """A Range with a check refuses NaN bytes; the checksum returned is of the file's
    bytes; a Produced source streams its chunks in order and must make what it declared."""
    t = torch.randn(4096, 8).to(torch.bfloat16)
    src = tmp_path / "src.bin"
    src.write_bytes(tensor_bytes(t).tobytes())
    sfd = os.open(src, os.O_RDONLY)
    try:
        out = tmp_path / "ok.bin"
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        stats: dict[str, float] = {}
        chunks = Produced(lambda: iter([b"ab", b"cd"]), 4)
        n, crc = engine.write(
            fd, b"H" * 8, [Range(sfd, 0, t.numel() * 2, "BF16"), chunks], stats=stats
        )
        os.close(fd)
        assert out.read_bytes() == b"H" * 8 + src.read_bytes() + b"abcd"
        assert crc == xxh3(out.read_bytes()) and n == out.stat().st_size
        assert {"read_s", "finite_s", "checksum_s", "write_s"} <= set(stats)
        t[4000, 3] = float("inf")
        src.write_bytes(tensor_bytes(t).tobytes())
        fd = os.open(tmp_path / "bad.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with pytest.raises(NonFiniteError):
            engine.write(fd, b"H" * 8, [Range(sfd, 0, t.numel() * 2, "BF16")])
        with pytest.raises(SourceError):  # the source is shorter than the range
            engine.write(fd, b"", [Range(sfd, 0, t.numel() * 2 + 10)])
        with pytest.raises(FormatError):  # made fewer bytes than declared
            engine.write(fd, b"", [Produced(lambda: iter([b"x"]), 2)])
        os.close(fd)
    finally:
        os.close(sfd)


def test_digest_reads_both_checksums() -> None:
    data = os.urandom(1000)
    for algo, want in (("crc32", f"crc32:{zlib.crc32(data):08x}"), ("xxh3", xxh3(data))):
        d = Digest(algo)
        d.update(data[:300])
        d.update(data[300:])
        assert d.text == want and checksum_algo(want) == algo
    with pytest.raises(FormatError):
        checksum_algo("sha256:00")


def test_produced_chunks_may_reuse_one_buffer(tmp_path: Path) -> None:
    """A maker (the fp8 quantizer) refills one buffer for every chunk: each chunk is copied
    before the next is made, even where memory is otherwise written in place."""
    engine = WriteEngine(direct_io=False)
    size = 2 * 2**20
    buf = bytearray(size)
    want = b""

    def make() -> Iterator[memoryview]:
        for i in range(4):
            buf[:] = bytes([i + 1]) * size
            yield memoryview(buf)
            buf[:] = b"\xff" * size  # a maker that reuses its buffer at once

    for i in range(4):
        want += bytes([i + 1]) * size
    out = tmp_path / "p.bin"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        total, crc = engine.write(fd, b"HDR", [Produced(make, 4 * size)])
    finally:
        os.close(fd)
        engine.close()
    assert out.read_bytes() == b"HDR" + want and crc == xxh3(b"HDR" + want)
    assert total == 3 + 4 * size


def test_an_engine_ends_its_write_threads_when_closed(tmp_path: Path) -> None:
    """The write threads belong to the engine (the persist stage's), not to the process:
    they exist while it writes and are gone once it is closed."""

    def writers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("stfile-write")]

    before = writers()
    engine = WriteEngine(direct_io=False)
    payload = os.urandom(3 * DIRECT_CHUNK + 5)  # large: a pool thread writes it
    fd = os.open(tmp_path / "x.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        engine.write(fd, b"H", [payload], crc=False)
    finally:
        os.close(fd)
    assert len(writers()) > len(before)
    engine.close()
    assert writers() == before
    assert (tmp_path / "x.bin").read_bytes() == b"H" + payload


# ------------------------------------------------------------- the compiled header decoder
def _output_header_texts() -> list[tuple[bytes, int]]:
    """(header JSON, tensor bytes) of output-shaped files: bf16, fp8 with scales, the
    pre-norm state, empty tensors."""
    meta = {"format": "hsq-eagle3-v1", "sample_id": "s1", "num_tokens": "3", "x": 'é\\"/'}
    shapes = [
        [("input_ids", "I64", [3], 24), ("loss_mask", "I64", [3], 24),
         ("aux_hidden_states", "BF16", [3, 6], 36), ("last_hidden_state", "BF16", [3, 2], 12)],
        [("input_ids", "I64", [2], 16), ("loss_mask", "I64", [2], 16),
         ("aux_hidden_states", "F8_E4M3", [2, 6], 12),
         ("aux_hidden_states_scale", "F32", [2, 3], 24),
         ("last_hidden_state", "F8_E4M3", [2, 2], 4), ("last_hidden_state_scale", "F32", [2, 1], 8),
         ("last_hidden_state_prenorm", "F8_E4M3", [2, 2], 4),
         ("last_hidden_state_prenorm_scale", "F32", [2, 1], 8)],
        [("input_ids", "I64", [0], 0), ("loss_mask", "I64", [0], 0),
         ("aux_hidden_states", "BF16", [0, 6], 0), ("last_hidden_state", "BF16", [0, 2], 0)],
    ]  # fmt: skip
    out = []
    for entries in shapes:
        raw = build_header(entries, meta)
        out.append((raw[8:], sum(e[3] for e in entries)))
    out.append((build_header(shapes[0], None)[8:], 96))
    return out


def _both(text: bytes, data: int) -> tuple[object, object]:
    """(the strict parser's Header or error message, the fast path's Header or None)."""
    from hsq.outputs.format import OUTPUT_HEADER
    from hsq.stfile.header import parse_header

    base = 8 + len(text)
    try:
        strict: object = parse_header(text, base, base + data)
    except FormatError as exc:
        strict = str(exc)
    return strict, OUTPUT_HEADER.parse(text, base, base + data)


def _same(a: object, b: object) -> bool:
    """Equal Headers, the order of tensors and metadata included."""
    from hsq.stfile.header import Header

    assert isinstance(a, Header) and isinstance(b, Header)
    return a == b and list(a.tensors) == list(b.tensors) and list(a.metadata) == list(b.metadata)


def test_the_compiled_header_decoder_takes_only_what_the_parser_takes_and_builds_the_same() -> None:
    """hsq.outputs.format.OUTPUT_HEADER (msgspec) against parse_header (json.loads and
    Python checks): on output headers and on every kind of damage, the fast path either
    declines (None) or gives exactly the parser's Header."""
    texts = _output_header_texts()
    for i, (text, data) in enumerate(texts):
        strict, fast = _both(text, data)
        if i == 2:  # empty tensors tie at one offset: their order is the JSON's, declined
            assert fast is None and not isinstance(strict, str)
        else:
            assert fast is not None and _same(strict, fast)
    one = b'"input_ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}'
    for refused in (b'{%s,"loss_mask":null}' % one, b'{%s,"loss_mask":[]}' % one):
        strict, fast = _both(refused, 16)  # a null or non-object entry: refused, not absent
        assert isinstance(strict, str) and fast is None
    crafted = [
        b'{"input_ids":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},"input_ids":'
        b'{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}',  # a duplicate: the last
        b'{"__metadata__":{"k":"1","k":"2"},"input_ids":{"dtype":"I64","shape":[2],'
        b'"data_offsets":[0,16]}}',
        b'{"__metadata__":"","input_ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}',
        b'{"__metadata__":null,"input_ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}',
        b'{"input_ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16],"x":"\\ud800"}}',
        b'{"input_ids":{"dtype":"I64","shape":[true,2],"data_offsets":[0,16]}}',
        b'{"input_ids":{"dtype":"I64","shape":[2.0],"data_offsets":[0,16]}}',
        b'{"input_ids":{"dtype":"I64","shape":[-2],"data_offsets":[0,16]}}',
        b'{"input_ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16,3]}}',
        b'{"input_ids":{"dtype":"X64","shape":[2],"data_offsets":[0,16]}}',
        b'{"input_ids":{"dtype":"I64","shape":[99999999999999999999999],"data_offsets":[0,16]}}',
        b'{"input_ids":{"dtype":"I64","shape":[0],"data_offsets":[0,0]},'
        b'"loss_mask":{"dtype":"I64","shape":[0],"data_offsets":[0,0]},'
        b'"last_hidden_state":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}',  # a tie
        b'{"other":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}',
        b'{"__metadata__":{"k":"\\ud800"},"input_ids":{"dtype":"I64","shape":[2],'
        b'"data_offsets":[0,16]}}',
        b'\xef\xbb\xbf{"input_ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}',
        b"[]",
        b'{"input_ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}} x',
    ]
    for text in crafted:
        strict, fast = _both(text, 16)
        assert fast is None or _same(strict, fast), text
    rng = random.Random(35)
    alphabet = b'{}[],:"\\ 0123456789-.eEtrufalsnI64BF_\x00\xff\xc3'
    taken = 0
    for i in range(20000):
        text, data = texts[i % len(texts)]
        b = bytearray(text)
        for _ in range(rng.choice((1, 1, 2, 3))):
            at = rng.randrange(len(b))
            op = rng.randrange(3)
            if op == 0:
                b[at] = rng.choice(alphabet)
            elif op == 1:
                b.insert(at, rng.choice(alphabet))
            else:
                del b[at]
        strict, fast = _both(bytes(b), data)
        if fast is not None:
            taken += 1
            assert _same(strict, fast), bytes(b)
    assert taken > 100  # damage that leaves a valid header (in a string, a digit's place)
