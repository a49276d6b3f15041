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
