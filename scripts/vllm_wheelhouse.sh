#!/usr/bin/env bash
# scripts/vllm_wheelhouse.sh [OUT]: an offline vLLM 0.26.0 + hsq runtime bundle for the lent H200
# (torch 2.11.0+cu130, triton 3.6.0, transformers 5.17, Python 3.12, no package registry),
# packed into parts of at most LIMIT_MIB (default 60) MiB, one part per device transfer.
#
# Run it on a machine that reaches PyPI (this project's CPU machine). It downloads ~330 MB
# into OUT/dl (not part of the bundle), trims, and writes:
#   OUT/units/*.tar.xz   independent units, each extracted into one site folder:
#     vllm-py      the vllm package (Python, configs, small extensions) and its dist-info
#     vllm-c       vllm/_C_stable_libtorch.abi3.so: imported at module level by
#                  vllm/platforms/cuda.py:23, so every CUDA run needs it
#     vllm-fa3     vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so: vllm_flash_attn/__init__.py
#                  raises ImportError when neither FA2 nor FA3 loads, and every model module
#                  imports it (layers/attention -> mm_encoder_attention -> fa_utils), so it
#                  is needed even with --attention-backend TRITON_ATTN
#     deps         vLLM's import-time dependencies the GPU image lacks (fastapi, pydantic,
#                  openai, msgspec, pyzmq, xgrammar, llguidance, ...)
#     hsq          hsq's runtime dependencies (redis, rq, structlog, ...) and redis-server
#     vllm-moe     vllm/_moe_C_stable_libtorch.abi3.so (optional: MoE models such as
#                  DeepSeek-V3; a dense Llama never imports it, platforms/cuda.py:228)
#   OUT/partN/           hard links to the units, grouped so each part is <= LIMIT_MIB;
#                        required units first, vllm-moe last. Send part1 in the first device
#                        call, part2 in the next (within the 30 s the machine stays warm).
#   OUT/SIZES.txt        what was measured
#   OUT/VERSION          the vLLM version
# scripts/vllm_live.sh --parts OUT/partN installs whatever units a part holds (each once).
# The hsq checkout itself is not in the bundle: the device call carries the working tree.
#
# Left out, and why (docs/vllm.md, "The GPU bundle"):
#   vllm_flash_attn/_vllm_fa2_C.abi3.so (305 MB): FA2; on sm_90 vLLM picks FA3
#     (v1/attention/backends/fa_utils.py:152-158); the import is try/except.
#   vllm/vllm-rs (43 MB): the opt-in Rust frontend binary (VLLM_RUST_FRONTEND_PATH).
#   vllm/third_party/deep_gemm (35 MB, fp8 GEMM; has_deep_gemm() then reports False) and
#     vllm/third_party/fmha_sm100 (30 MB, Blackwell-only attention for MiniMax-M3).
#   _qutlass_C (optional import, FP4 on Blackwell), _rust_tool_parser (lazy, tool calls).
#   CUDA images for other GPUs: with PRUNE_ARCH=90 (default) the fatbins of _C, _moe_C and
#     _flashmla_C keep, per compiled unit, the sm_90 SASS, else the PTX an sm_90 JIT-compiles
#     (as it would from the full file), else one placeholder image (scripts/vllm_prune_fatbin.py).
#     PRUNE_ARCH=0 keeps them whole (_C alone is then ~56 MB after xz instead of ~20).
#   flashinfer, flashinfer-cubin, tilelang, quack-kernels, nvidia-cutlass-dsl, tokenspeed-mla,
#     humming-kernels, torchcodec, PyNvVideoCodec, mistral_common, opentelemetry, mcp,
#     anthropic, compressed-tensors, outlines_core, lm-format-enforcer, lark: lazily
#     imported (kernel backends not selected on this path, multimodal, tools, tracing,
#     quantized checkpoints, grammar backends other than xgrammar/guidance).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.vllm-wheelhouse}
PY=${PY:-python3}
VLLM=${VLLM:-0.26.0}
LIMIT_MIB=${LIMIT_MIB:-60}
PRUNE_ARCH=${PRUNE_ARCH:-90}
XZ_LEVEL=${XZ_LEVEL:-6}
HERE=$PWD/scripts
mkdir -p "$OUT/dl/small" "$OUT/dl/hsq" "$OUT/units"
OUT=$(cd "$OUT" && pwd)
say() { printf '[vllm-wheelhouse] %s\n' "$*"; }

PD=("$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all:
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
    --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
    --platform manylinux1_x86_64)

say "vllm $VLLM (~300 MB)"
"${PD[@]}" -d "$OUT/dl" "vllm==$VLLM"
# Resolved on 2026-12-01 against vllm 0.26.0's Requires-Dist, less what the GPU image has
# (KINDS.md "Python packages already there"). pydantic and typing-extensions are carried
# because the image has no pydantic and pydantic 2.14 needs a recent typing-extensions.
say "vLLM's import-time dependencies the GPU image lacks"
"${PD[@]}" -d "$OUT/dl/small" \
  fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 \
  openai==2.54.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 openai-harmony==0.0.8 \
  model-hosting-container-standards==0.1.16 supervisor==4.3.0 jmespath==1.1.0 \
  prometheus-fastapi-instrumentator==8.1.0 partial-json-parser==0.2.1.1.post7 \
  watchfiles==1.3.0 msgspec==0.23.0 pyzmq==27.3.0 cachetools==8.0.2 cbor2==6.3.0 \
  pybase64==1.5.1 setproctitle==1.3.8 blake3==1.0.11 python-json-logger==4.2.0 \
  llguidance==1.7.6 xgrammar==0.2.9 apache-tvm-ffi==0.1.11 \
  depyf==0.20.0 astor==0.8.1 dill==0.4.1
say "hsq's runtime dependencies (as scripts/sglang_wheelhouse.sh)"
"${PD[@]}" -d "$OUT/dl/hsq" \
  redis==8.1.0 hiredis==3.5.0 rq==2.12.0 croniter==7.0.0 python-dateutil==2.9.0.post0 \
  structlog==26.1.0 click==8.3.1 psutil==7.2.2 xxhash==4.1.0

say "Debian's redis-server with liblzf1 and libjemalloc2"
rm -rf "$OUT/dl/redis" && mkdir -p "$OUT/dl/redis/root"
if (cd "$OUT/dl/redis" && apt-get download -q redis-tools liblzf1 libjemalloc2 >/dev/null 2>&1); then
  for deb in "$OUT"/dl/redis/*.deb; do dpkg-deb -x "$deb" "$OUT/dl/redis/root"; done
  mkdir -p "$OUT/dl/redis/bin"
  cp "$OUT/dl/redis/root/usr/bin/redis-check-rdb" "$OUT/dl/redis/bin/redis-server"
  cp -L "$OUT"/dl/redis/root/usr/lib/x86_64-linux-gnu/{liblzf.so.1,libjemalloc.so.2} "$OUT/dl/redis/bin/"
else
  say "apt-get download failed: copying this machine's redis-server and libraries"
  mkdir -p "$OUT/dl/redis/bin"
  cp -L "$(command -v redis-server)" "$OUT/dl/redis/bin/redis-server"
  cp -L /usr/lib/x86_64-linux-gnu/{liblzf.so.1,libjemalloc.so.2} "$OUT/dl/redis/bin/"
fi
chmod 755 "$OUT/dl/redis/bin/redis-server"

"$PY" - "$OUT" "$VLLM" "$PRUNE_ARCH" "$HERE" <<'EOF'
"""Stage the units: OUT/stage/UNIT/ holds the files that UNIT extracts into the site folder."""
import base64, csv, hashlib, io, os, shutil, sys, zipfile

out, vllm, prune_arch, tools = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, tools)
from vllm_prune_fatbin import prune  # noqa: E402

stage = os.path.join(out, "stage")
shutil.rmtree(stage, ignore_errors=True)
DROP = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/deep_gemm/",
        "vllm/third_party/fmha_sm100/", "vllm/_qutlass_C.abi3.so", "vllm/_rust_tool_parser.abi3.so")
UNIT_OF = {"vllm/_C_stable_libtorch.abi3.so": "vllm-c",
           "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": "vllm-fa3",
           "vllm/_moe_C_stable_libtorch.abi3.so": "vllm-moe"}
PRUNE = {"vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so",
         "vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so"}


def write(unit, name, data, mode):
    path = os.path.join(stage, unit, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def extract_wheel(whl, unit):
    """Install a wheel by unpacking it: purelib/platlib .data folders go to the root."""
    z = zipfile.ZipFile(whl)
    for i in z.infolist():
        name = i.filename
        if name.endswith("/"):
            continue
        parts = name.split("/")
        if parts[0].endswith(".data"):
            if len(parts) > 2 and parts[1] in ("purelib", "platlib"):
                name = "/".join(parts[2:])
            else:
                continue  # scripts, headers, data: not needed on a PYTHONPATH install
        mode = (i.external_attr >> 16) & 0o777 or 0o644
        write(unit, name, z.read(i), mode | 0o644)


whl = next(os.path.join(out, "dl", f) for f in sorted(os.listdir(os.path.join(out, "dl")))
           if f.startswith(f"vllm-{vllm}-") and f.endswith(".whl"))
z = zipfile.ZipFile(whl)
record = f"vllm-{vllm}.dist-info/RECORD"
rows, dropped, pruned = [], [], []
tmp = os.path.join(out, "prune.tmp")
for i in z.infolist():
    name = i.filename
    if name.endswith("/") or name == record:
        continue
    if name.startswith(DROP):
        dropped.append((name, i.file_size))
        continue
    data = z.read(i)
    if prune_arch and name in PRUNE:
        with open(tmp, "wb") as f:
            f.write(data)
        st = prune(tmp, tmp + ".out", prune_arch)
        data = open(tmp + ".out", "rb").read()
        pruned.append((name, st))
    mode = 0o755 if name.endswith(".so") else 0o644
    write(UNIT_OF.get(name, "vllm-py"), name, data, mode)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    rows.append((name, f"sha256={digest}", str(len(data))))
for p in (tmp, tmp + ".out"):
    if os.path.exists(p):
        os.remove(p)
rows.append((record, "", ""))
buf = io.StringIO()
csv.writer(buf, lineterminator="\n").writerows(rows)
write("vllm-py", record, buf.getvalue().encode(), 0o644)
for name, size in dropped:
    if size > 5e6:
        print(f"[vllm-wheelhouse] dropped {name} ({size / 1e6:.1f} MB)")
print(f"[vllm-wheelhouse] dropped {len(dropped)} files, {sum(s for _, s in dropped) / 1e6:.0f} MB")
for name, st in pruned:
    print(f"[vllm-wheelhouse] pruned {name} for sm_{prune_arch}: {st['kept']} images kept, "
          f"{st['dropped']} dropped, fatbin {st['bytes_before'] / 1e6:.1f} -> {st['bytes_after'] / 1e6:.1f} MB")
for whl in sorted(os.listdir(os.path.join(out, "dl", "small"))):
    extract_wheel(os.path.join(out, "dl", "small", whl), "deps")
for whl in sorted(os.listdir(os.path.join(out, "dl", "hsq"))):
    extract_wheel(os.path.join(out, "dl", "hsq", whl), "hsq")
# redis-server and its two libraries: the install script puts them in SITE/.redis-bin/
for f in sorted(os.listdir(os.path.join(out, "dl", "redis", "bin"))):
    write("hsq", f".redis-bin/{f}", open(os.path.join(out, "dl", "redis", "bin", f), "rb").read(), 0o755)
EOF

say "packing units (xz -$XZ_LEVEL; a few minutes on 2 cores)"
rm -f "$OUT"/units/*.tar.xz
for u in vllm-py vllm-c vllm-fa3 deps hsq vllm-moe; do
  tar -C "$OUT/stage/$u" --sort=name --mtime=@1767225600 --owner=0 --group=0 --numeric-owner \
    -cf - . | xz -"$XZ_LEVEL" -T2 > "$OUT/units/$u.tar.xz"
done

# Group the units into parts of at most LIMIT_MIB, first fit in the order above (the
# optional vllm-moe last, so part1.. hold everything a dense Llama needs).
rm -rf "$OUT"/part*
"$PY" - "$OUT" "$LIMIT_MIB" <<'EOF'
import os, sys
out, limit = sys.argv[1], int(sys.argv[2]) * 1048576
order = ["vllm-py", "vllm-c", "vllm-fa3", "deps", "hsq", "vllm-moe"]
parts, sizes = [], []
for u in order:
    s = os.path.getsize(os.path.join(out, "units", f"{u}.tar.xz"))
    if s > limit:
        sys.exit(f"unit {u} alone is {s / 1048576:.1f} MiB > {limit // 1048576} MiB")
    for k, p in enumerate(parts):
        # vllm-moe never joins a part before the last, so the required units stay first
        if sizes[k] + s <= limit and (u != "vllm-moe" or k == len(parts) - 1):
            p.append(u); sizes[k] += s
            break
    else:
        parts.append([u]); sizes.append(s)
lines = []
for k, (p, s) in enumerate(zip(parts, sizes), 1):
    d = os.path.join(out, f"part{k}")
    os.makedirs(d)
    for u in p:
        os.link(os.path.join(out, "units", f"{u}.tar.xz"), os.path.join(d, f"{u}.tar.xz"))
    lines.append(f"part{k}: {s / 1048576:.1f} MiB = " + " + ".join(
        f"{u} {os.path.getsize(os.path.join(out, 'units', u + '.tar.xz')) / 1048576:.1f}" for u in p))
stage = os.path.join(out, "stage")
for u in order:
    n = b = 0
    for root, _, files in os.walk(os.path.join(stage, u)):
        for f in files:
            n += 1; b += os.path.getsize(os.path.join(root, f))
    lines.append(f"unit {u}: {n} files, {b / 1048576:.1f} MiB unpacked, "
                 f"{os.path.getsize(os.path.join(out, 'units', u + '.tar.xz')) / 1048576:.1f} MiB xz")
open(os.path.join(out, "SIZES.txt"), "w").write("\n".join(lines) + "\n")
print("\n".join("[vllm-wheelhouse] " + x for x in lines))
EOF
echo "$VLLM" > "$OUT/VERSION"
say "bundle in $OUT/part*/ (dl/ and stage/ are not part of it; delete them to save disk)"
