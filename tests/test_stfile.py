"""Raw safetensors I/O: files safetensors reads back, strict parsing, finite checks, copies."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hsq import stfile


def write_file(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> int:
    entries = [
        (k, stfile.dtype_code(v.dtype), list(v.shape), v.numel() * v.element_size())
        for k, v in tensors.items()
    ]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        n, crc = stfile.write(
            fd,
            stfile.build_header(entries, meta),
            [stfile.tensor_bytes(v) for v in tensors.values()],
        )
    finally:
        os.close(fd)
    assert crc == zlib.crc32(path.read_bytes())
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
    header = stfile.read_header(fd)
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
        with pytest.raises(stfile.FormatError):
            stfile.read_header(fd)
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
    mm = stfile.map_file(fd)
    header = stfile.read_header(fd)
    assert stfile.all_finite(mm, header.tensors["t"], chunk_bytes=256) is (bad is None)
    mm.close()
    os.close(fd)


def test_kernel_copy_across_filesystems(tmp_path: Path) -> None:
    """Dump dirs live on tmpfs and outputs on disk: copy_file_range may refuse (EXDEV)."""
    src_dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    src = src_dir / f"hsq-test-{os.getpid()}.bin"
    payload = os.urandom(300_000)
    src.write_bytes(payload)
    try:
        fd = os.open(src, os.O_RDONLY)
        mm = stfile.map_file(fd)
        out = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT)
        n, crc = stfile.write(out, b"HEADER", [(fd, 1000, 200_000), b"tail"], crc_of=mm)
        os.close(out)
        mm.close()
        os.close(fd)
    finally:
        src.unlink()
    data = (tmp_path / "out.bin").read_bytes()
    assert data == b"HEADER" + payload[1000:201_000] + b"tail"
    assert n == len(data) and crc == zlib.crc32(data)


@pytest.mark.parametrize("direct", ["1", "0"])
def test_large_files_same_bytes_with_and_without_direct_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    """Files over DIRECT_MIN_BYTES go through O_DIRECT where the filesystem allows it (the
    unaligned tail through the buffered descriptor): the bytes and crc must not change."""
    import mmap

    monkeypatch.setenv("HSQ_DIRECT_IO", direct)
    n = stfile.DIRECT_MIN_BYTES + stfile.DIRECT_CHUNK + 12345  # chunks, a tail, odd size
    src_path = tmp_path / "src.bin"
    src_path.write_bytes(os.urandom(n + 100))
    small = os.urandom(777)
    header = stfile.build_header([("s", "U8", [777], 777), ("big", "U8", [n], n)], {"k": "v"})
    sfd = os.open(src_path, os.O_RDONLY)
    out = tmp_path / "out.safetensors"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        mm = mmap.mmap(sfd, 0, access=mmap.ACCESS_READ)
        total, crc = stfile.write(fd, header, [small, (sfd, 50, n)], crc_of=mm)
        assert os.lseek(fd, 0, os.SEEK_CUR) == total
        os.fsync(fd)
        mm.close()
    finally:
        os.close(fd)
        os.close(sfd)
    data = out.read_bytes()
    assert len(data) == total == len(header) + 777 + n
    assert data == header + small + src_path.read_bytes()[50 : 50 + n]
    assert crc == zlib.crc32(data)
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"k": "v"}


def test_direct_io_refused_mid_file_falls_back_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that opens O_DIRECT but refuses the writes (EINVAL) gets the same file
    through the page cache, and is not tried again."""
    import errno

    def refuse(_fd: int, _data: memoryview | bytes, _at: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setenv("HSQ_DIRECT_IO", "1")
    monkeypatch.setattr(stfile, "_pwrite_all", refuse)
    monkeypatch.setattr(stfile, "_direct_refused", set())
    payload = os.urandom(stfile.DIRECT_MIN_BYTES + 5)
    header = stfile.build_header([("x", "U8", [len(payload)], len(payload))], None)
    out = tmp_path / "o.safetensors"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        total, crc = stfile.write(fd, header, [payload])
    finally:
        os.close(fd)
    assert out.read_bytes() == header + payload and total == len(header) + len(payload)
    assert crc == zlib.crc32(header + payload)
    assert os.stat(out).st_dev in stfile._direct_refused
