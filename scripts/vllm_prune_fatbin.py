"""Prune a shared library's CUDA fatbins to what an sm_90 GPU can load (for
scripts/vllm_wheelhouse.sh), writing a copy.

For each fatbin blob in .nv_fatbin (one per compiled translation unit):
  - if it has ELF (SASS) images for sm_90, keep those only (the driver prefers SASS for
    the device's own arch over JIT-compiling PTX);
  - else keep its PTX images for sm <= 90 (the driver JIT-compiles those on sm_90, as it
    does with the unpruned library);
  - else (nothing sm_90 can run, e.g. sm_100-only kernels) keep its smallest image, so the
    blob stays non-empty and sm_90 sees exactly what it saw before: no compatible image.
Kept entries are packed from the blob's start (its offset, which .nvFatBinSegment points
to, does not move), the blob header's size is updated, and the freed tail is zero-filled,
so the file keeps its size and layout and the zeros compress to almost nothing.
Usage: vllm_prune_fatbin.py IN OUT [ARCH]   (ARCH defaults to 90)
"""

import struct
import subprocess
import sys
from pathlib import Path

MAGIC = 0xBA55ED50


def fatbin_section(path):
    out = subprocess.run(
        ["readelf", "-SW", path], capture_output=True, text=True, check=True
    ).stdout
    for line in out.splitlines():
        parts = line.replace("[ ", "[").split()
        if len(parts) > 5 and parts[1] == ".nv_fatbin":
            return int(parts[4], 16), int(parts[5], 16)
    return None


def prune(src, dst, arch=90):
    data = bytearray(Path(src).read_bytes())
    sec = fatbin_section(src)
    stats = {"blobs": 0, "kept": 0, "dropped": 0, "bytes_before": 0, "bytes_after": 0}
    if sec is None:
        Path(dst).write_bytes(data)
        return stats
    off, size = sec
    pos = off
    while pos + 16 <= off + size:
        magic, ver, hsz, fsz = struct.unpack_from("<IHHQ", data, pos)
        if magic != MAGIC:
            pos += 8
            continue
        if ver != 1 or hsz != 16:
            raise SystemExit(f"unknown fatbin header at {pos:#x}: version {ver}, size {hsz}")
        start, end = pos + hsz, pos + hsz + fsz
        ents, e = [], start
        while e < end:
            kind, _v, ehsz, padded = struct.unpack_from("<HHII", data, e)
            sm = struct.unpack_from("<I", data, e + 28)[0]
            if kind not in (1, 2) or e + ehsz + padded > end:
                raise SystemExit(f"bad fatbin entry at {e:#x}")
            ents.append((kind, sm, bytes(data[e : e + ehsz + padded])))
            e += ehsz + padded
        sass = [x for x in ents if x[0] == 2 and x[1] == arch]
        ptx = [x for x in ents if x[0] == 1 and x[1] <= arch]
        keep = sass or ptx or [min(ents, key=lambda x: len(x[2]))]
        body = b"".join(x[2] for x in keep)
        data[start : start + len(body)] = body
        data[start + len(body) : end] = bytes(end - start - len(body))
        struct.pack_into("<Q", data, pos + 8, len(body))
        stats["blobs"] += 1
        stats["kept"] += len(keep)
        stats["dropped"] += len(ents) - len(keep)
        stats["bytes_before"] += fsz
        stats["bytes_after"] += len(body)
        pos = end
    Path(dst).write_bytes(data)
    return stats


if __name__ == "__main__":
    s = prune(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 90)
    print(
        f"{sys.argv[1]}: {s['blobs']} blobs, {s['kept']} images kept, {s['dropped']} dropped, "
        f"fatbin {s['bytes_before'] / 1e6:.1f} -> {s['bytes_after'] / 1e6:.1f} MB"
    )
