#!/usr/bin/env bash
# sglang_wheelhouse.sh [OUT]: an offline SGLang + hsq runtime bundle for a GPU machine that has
# torch 2.11 (cu130), triton, transformers and nvcc but no package registry.
#
#   SGLANG_VERSION=0.5.15 (default) or 0.5.16 / 0.5.17: the releases that pin torch 2.11.0, the
#   GPU image's torch (0.5.18+ pin 2.13 / 2.14.1: docs/sglang.md, "Versions"). The bundle
#   records the version in OUT/VERSION; scripts/sglang_live.sh --sglang-version checks it.
# The DeepSeek/Kimi model module also needs nvidia-cutlass-dsl, too big for the same
# transfer: scripts/sglang_cutlass.sh packs it for a second one.
#
# Run it on a machine that reaches PyPI and Debian's archive (this project's CPU machine).
# It downloads ~650 MB into OUT/dl (not part of the bundle), trims, and packs:
#   OUT/wheels/*.whl             sglang (trimmed), flashinfer-python (whole), SGLang's small
#                                dependencies, and what hsq needs beyond the GPU image
#                                (redis, hiredis, rq, croniter, structlog, click, ...)
#   OUT/wheels/if-missing/*.whl  pydantic v2, installed only if the GPU image lacks it
#   OUT/sgl_kernel.tar.gz        sglang-kernel (0.4.4 / 0.4.5) without FA3 / FlashMLA / sm100
#   OUT/redis/                   Debian's redis-server with liblzf and libjemalloc
# The bundle is ~48 MB: it travels with the checkout in one device call (64 MiB at most).
# scripts/sglang_live.sh installs it on the GPU machine and runs the GPU tests (tests/gpu).
#
# What is left out, and why (docs/sglang.md "Run live"):
#   flash_ops.abi3.so (FA3, 1.76 GB unpacked), flashmla_ops, sgl_kernel/sm100/: never loaded
#     with --attention-backend triton on an H200 (sm90), so FA3/FlashMLA backends are out.
#   flashinfer-cubin (447 MB): prebuilt kernels; flashinfer JIT-compiles what SGLang uses from
#     flashinfer/data/csrc with the machine's nvcc instead (first start ~2 minutes).
#   sglang/multimodal_gen/ and the Rust gRPC extension: diffusion serving and gRPC only.
# Users with a normal SGLang install need none of this: `pip install hidden-state-queue` (or
# the wheel) into SGLang's environment registers the plugin.
set -euo pipefail
OUT=${1:-.wheelhouse}
PY=${PY:-python3}
SGLANG=${SGLANG_VERSION:-0.5.15}
# What each release pins (its wheel's Requires-Dist; sglang-kernel from pip's resolver).
case "$SGLANG" in
  0.5.15) FLASHINFER=0.6.12 SGL_KERNEL=0.4.4 ;;
  0.5.16) FLASHINFER=0.6.14 SGL_KERNEL=0.4.5 ;;
  0.5.17) FLASHINFER=0.6.15.post1 SGL_KERNEL=0.4.5 ;;
  *) echo "[wheelhouse] SGLANG_VERSION=$SGLANG: only 0.5.15-0.5.17 run on torch 2.11" >&2; exit 2 ;;
esac
mkdir -p "$OUT/dl" "$OUT/wheels/if-missing" "$OUT/redis"
OUT=$(cd "$OUT" && pwd)
say() { printf '[wheelhouse] %s\n' "$*"; }

# The GPU image's interpreter is CPython 3.12 on manylinux x86_64.
PD=("$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all:
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux_2_34_x86_64)

say "SGLang's small dependencies (versions seen working with sglang $SGLANG)"
"${PD[@]}" -d "$OUT/wheels" \
  apache-tvm-ffi==0.1.11 compressed-tensors==0.20.1 dill==0.4.1 distro==1.9.0 fastapi==0.140.13 \
  gguf==0.19.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 loguru==0.7.3 \
  msgspec==0.23.0 openai==2.6.1 orjson==3.13.0 partial_json_parser==0.2.1.1.post7 \
  pybase64==1.5.1 python-multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0 \
  rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0 uvicorn==0.54.0
say "hsq's runtime dependencies the GPU image lacks"
"${PD[@]}" -d "$OUT/wheels" \
  redis==8.1.0 hiredis==3.5.0 rq==2.12.0 croniter==7.0.0 python-dateutil==2.9.0.post0 \
  structlog==26.1.0 click==8.3.1 psutil==7.2.2 xxhash==4.1.0
say "pytest, for the live GPU tests (tests/gpu)"
"${PD[@]}" -d "$OUT/wheels" \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0 pygments==2.21.0
"${PD[@]}" -d "$OUT/wheels/if-missing" \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
say "sglang $SGLANG, flashinfer-python $FLASHINFER, sglang-kernel $SGL_KERNEL (~650 MB)"
"${PD[@]}" -d "$OUT/dl" "sglang==$SGLANG" "flashinfer-python==$FLASHINFER" \
  "sglang-kernel==$SGL_KERNEL"

"$PY" - "$OUT" "$SGLANG" "$FLASHINFER" "$SGL_KERNEL" <<'EOF'
"""Trim the three big wheels. A wheel's RECORD is rewritten for what is kept."""
import base64
import csv
import hashlib
import io
import os
import shutil
import sys
import tarfile
import zipfile

out, sglang, flashinfer, kernel = sys.argv[1:5]
dl = os.path.join(out, "dl")


def record_row(name: str, data: bytes) -> tuple[str, str, str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return name, f"sha256={digest}", str(len(data))


def record_text(rows: list[tuple[str, str, str]]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def find(prefix: str) -> str:
    return next(os.path.join(dl, f) for f in sorted(os.listdir(dl)) if f.startswith(prefix))


def repack(src: str, dst: str, drop: tuple[str, ...], patches: list[tuple[str, str, str]]) -> None:
    """Copy a wheel without the `drop` prefixes, with literal (path, old, new) patches."""
    zin = zipfile.ZipFile(src)
    record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
    todo, rows, dropped = list(patches), [], 0
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            name = info.filename
            if name == record:
                continue
            if name.startswith(drop):
                dropped += 1
                continue
            data = zin.read(name)
            for p in [p for p in todo if p[0] == name]:
                if p[1].encode() not in data:
                    sys.exit(f"patch target not found in {name}: {p[1]!r}")
                data = data.replace(p[1].encode(), p[2].encode())
                todo.remove(p)
            zi = zipfile.ZipInfo(name, date_time=info.date_time)
            zi.external_attr = info.external_attr
            zi.compress_type = zipfile.ZIP_DEFLATED  # a new ZipInfo would be stored raw
            zout.writestr(zi, data)
            if not name.endswith("/"):
                rows.append(record_row(name, data))
        rows.append((record, "", ""))
        zi = zipfile.ZipInfo(record, date_time=(2026, 1, 1, 0, 0, 0))
        zi.external_attr = 0o644 << 16
        zi.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(zi, record_text(rows))
    if todo:
        sys.exit(f"patches not applied: {todo}")
    print(f"[wheelhouse] {os.path.basename(dst)}: {dropped} files dropped, "
          f"{os.path.getsize(dst) / 1e6:.1f} MB")


# sglang: drop diffusion serving and the gRPC extension; sglang registers a "qwen3_asr"
# config that transformers >= 5.13 already has (ValueError at import): exist_ok=True.
src = find(f"sglang-{sglang}-")
asr = "sglang/srt/configs/qwen3_asr.py"
repack(src, os.path.join(out, "wheels", os.path.basename(src)),
       drop=("sglang/multimodal_gen/", "sglang/srt/grpc/_core.cpython-312-x86_64-linux-gnu.so"),
       patches=[(asr, f'AutoConfig.register("{n}", {c})',
                 f'AutoConfig.register("{n}", {c}, exist_ok=True)')
                for n, c in (("qwen3_asr", "Qwen3ASRConfig"),
                             ("qwen3_asr_thinker", "Qwen3ASRThinkerConfig"))])
# flashinfer-python whole: SGLang's norm/activation kernels JIT-compile from its csrc.
src = find(f"flashinfer_python-{flashinfer}-")
shutil.copy(src, os.path.join(out, "wheels", os.path.basename(src)))
# sglang-kernel: keep sm90 common_ops, spatial_ops, python, triton kernels and the
# dist-info (sglang checks its version); drop FA3, FlashMLA and the sm100 build.
zk = zipfile.ZipFile(find(f"sglang_kernel-{kernel}-"))
drop = ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/flashmla_ops.abi3.so", "sgl_kernel/sm100/")
keep = [i for i in zk.infolist() if not i.filename.endswith("/") and not i.filename.startswith(drop)]
rname = f"sglang_kernel-{kernel}.dist-info/RECORD"
rows = [record_row(i.filename, zk.read(i.filename)) for i in keep if i.filename != rname]
record = record_text([*rows, (rname, "", "")]).encode()
tgz = os.path.join(out, "sgl_kernel.tar.gz")
with tarfile.open(tgz, "w:gz", compresslevel=9) as tf:
    for i in keep:
        data = record if i.filename == rname else zk.read(i.filename)
        ti = tarfile.TarInfo(i.filename)
        ti.size, ti.mtime = len(data), 1767225600
        ti.mode = 0o755 if i.filename.endswith(".so") else 0o644
        tf.addfile(ti, io.BytesIO(data))
print(f"[wheelhouse] sgl_kernel.tar.gz: {len(keep)} files kept, {os.path.getsize(tgz) / 1e6:.1f} MB")
EOF

say "Debian's redis-server (redis-tools) with liblzf1 and libjemalloc2"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if (cd "$tmp" && apt-get download -q redis-tools liblzf1 libjemalloc2 >/dev/null 2>&1); then
  for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
  cp "$tmp/root/usr/bin/redis-check-rdb" "$OUT/redis/redis-server"
  cp -L "$tmp"/root/usr/lib/x86_64-linux-gnu/{liblzf.so.1,libjemalloc.so.2} "$OUT/redis/"
else
  say "apt-get download failed: copying this machine's redis-server and libraries"
  cp -L "$(command -v redis-server)" "$OUT/redis/redis-server"
  cp -L /usr/lib/x86_64-linux-gnu/{liblzf.so.1,libjemalloc.so.2} "$OUT/redis/"
fi
chmod 755 "$OUT/redis/redis-server"
echo "$SGLANG" >"$OUT/VERSION"

size=$(du -cb "$OUT"/wheels/*.whl "$OUT"/wheels/if-missing/*.whl "$OUT"/sgl_kernel.tar.gz \
  "$OUT"/redis/* | tail -1 | cut -f1)
say "bundle: $((size / 1048576)) MiB in $OUT (without dl/; delete it to save disk)"
if ((size > 56 * 1048576)); then
  say "warning: over 56 MiB; with the checkout it may not fit one 64 MiB device call"
fi
