"""The dump protocol: the one contract between an inference server and a worker.

Every server implementation (the reference server, the SGLang hook) writes dumps with
:func:`write_dump`. The worker finds its dumps by rid with :class:`RidMatcher` (several
requests in flight), checks them with :func:`check_meta` and maps the tensors with
:func:`open_dump_tensors`; :func:`wait_for_dump` and :func:`read_dump` serve tools and tests
that send one request at a time. docs/dump-protocol.md is the prose version of this module.

Layout of a dump directory owned by exactly one worker::

    <dump_dir>/req_<N>.tmp/      being written (never read)
    <dump_dir>/req_<N>/          complete once it holds `done`
        hidden_states.safetensors   aux_hidden_states [T, k*H], last_hidden_state [T, H]
                                    (+ last_hidden_state_prenorm [T, H] with `prenorm`;
                                    fp8-e4m3 encoding: values in float8 plus a float32
                                    `<name>_scale` per tensor, as fp8 outputs store them)
        meta.json                   DumpMeta
        done                        written and fsynced last

N is the server's own counter. A client never predicts it: it names each request with a
rid of its own, finds the dump whose meta.json carries that rid, and validates it against
what it sent (rid, fingerprint of the input ids, token count).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
import shutil
import stat
import sys
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsq import jsonsafe, stfile
from hsq.errors import (
    CorruptDumpError,
    DumpDirError,
    HookInactiveError,
    IncompleteDumpError,
    MetaMismatchError,
    MultipleDumpsError,
    NoDumpError,
    NonFiniteDumpError,
    ServerUnavailableError,
    StaleDumpError,
    WrongLengthError,
)

FORMAT_VERSION = 2
"""The newest dump format. A server writes the oldest version that describes its dumps
(1 for plain dumps without the pre-norm state), so a worker that reads only version 1 keeps
working with a server that does not use what version 2 added."""
READ_VERSIONS = (1, 2)
DUMP_PREFIX = "req_"
TMP_SUFFIX = ".tmp"
TENSOR_FILE = "hidden_states.safetensors"
META_FILE = "meta.json"
DONE_FILE = "done"
AUX_TENSOR = "aux_hidden_states"
LAST_TENSOR = "last_hidden_state"
PRENORM_TENSOR = "last_hidden_state_prenorm"
"""The final layer's output *before* the model's final norm (format 2, `prenorm`)."""
SCALE_SUFFIX = "_scale"
PLAIN = "plain"
"""Encoding of a dump whose states are in `dtype` as the model computed them."""
FP8 = "fp8-e4m3"
"""Encoding of a dump quantized by the server exactly as an fp8-e4m3 output stores the
states (hsq/quant.py: float8_e4m3fn values, one float32 scale = absmax/448 per token per
row of H values): the worker validates and copies it instead of quantizing."""
ENCODINGS = (PLAIN, FP8)
_FP8_CODE = "F8_E4M3"
_SCALE_CODE = "F32"
LAYER_CONVENTION = "hf_hidden_states"
DTYPE_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
"""Dump dtypes by meta.json name, with their safetensors codes. `DTYPES` (the torch dtypes
by the same names) loads torch on first use: a worker copying bf16 dumps never needs it."""
# meta.json is a few hundred bytes; anything near this limit is not a dump of ours.
MAX_META_BYTES = 1 * 2**20
_DUMP_RE = re.compile(r"^req_(\d+)$")
_TMP_RE = re.compile(r"^req_(\d+)\.tmp$")
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


def open_regular(path: Path) -> int:
    """Open a file that a server (or anyone who can write the dump dir) made, for reading.

    Only a regular file is opened: a FIFO would block open() (and with it the dispatcher's
    lock, the heartbeat and SIGTERM), a device may act on open, a symlink may lead out of
    the dump dir. So: lstat first, then open with O_NONBLOCK | O_NOFOLLOW, then fstat the
    descriptor and check it is the same regular file (nothing swapped in between).
    CorruptDumpError if it is not a regular file; OSError if it cannot be opened.
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise CorruptDumpError(f"{path} is not a regular file ({_kind(st.st_mode)})")
    fd = os.open(path, _OPEN_FLAGS)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise CorruptDumpError(f"{path} was replaced while it was opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_regular(path: Path, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of a regular file (open_regular): never a whole file of
    a server's choosing."""
    fd = open_regular(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return f"mode {mode:o}"


def remove_entry(path: Path) -> bool:
    """Remove a dump dir entry of any kind without following a link: a real directory
    with its contents, anything else (a symlink, a file, a FIFO) by unlink. True when
    nothing is left at ``path`` (also when it was already gone)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    try:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=True)  # rmtree never follows links inside
        else:
            os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        pass
    return not os.path.lexists(path)


if TYPE_CHECKING:
    import torch

    DTYPES: dict[str, torch.dtype]


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        import torch

        return {n: getattr(torch, n) for n in DTYPE_CODES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    for name in DTYPE_CODES:
        if str(dtype).removeprefix("torch.") == name:
            return name
    raise ValueError(f"unsupported dump dtype {dtype}")


def fingerprint(input_ids: Sequence[int] | torch.Tensor) -> str:
    """A hash of the input token ids as little-endian int32 bytes.

    int32 because every tokenizer in use fits and SGLang keeps ids as int32 on device.
    A list is hashed without torch (the worker's hot path); a tensor is read as a tensor.
    """
    if hasattr(input_ids, "detach"):  # a torch tensor, on any device
        ids = input_ids.detach().reshape(-1).cpu().tolist()
    else:
        ids = input_ids
    try:
        arr = array("i", ids)
    except OverflowError as exc:
        raise ValueError("token ids must fit in int32") from exc
    except TypeError as exc:
        raise ValueError(f"token ids must be integers: {exc}") from exc
    if arr.itemsize != 4:  # pragma: no cover - no such platform in use
        raise ValueError("C int is not 32 bits here")
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return "blake2b128:" + hashlib.blake2b(arr.tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class ModelIdentity:
    """What model produced the states; the worker checks it against the run's config."""

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    config_digest: str

    @property
    def model_id(self) -> str:
        return f"{self.name}@{self.config_digest[:16]}"


def _load_bounded(
    text: str | bytes, limit: int, what: str, error: Callable[[str], Exception]
) -> Any:
    """json.loads of a file a server wrote (untrusted): size-checked first; anything
    malformed raises `error` naming `what`."""
    if len(text) > limit:
        raise error(f"{what} is {len(text)} bytes, over {limit}")
    try:
        return jsonsafe.loads(text)  # deep nesting: a ValueError, not a crash
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{what} is malformed: {exc}") from exc


@dataclass(frozen=True)
class DumpMeta:
    rid: str
    num_tokens: int
    input_fingerprint: str
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    """The dtype the states were computed in; an fp8-e4m3 dump was quantized from it."""
    model: ModelIdentity
    tensors: dict[str, list[int]]
    request_index: int
    layer_convention: str = LAYER_CONVENTION
    format_version: int = 0
    """0 (the default): the oldest version that describes this dump (format_version_for)."""
    created_unix: float = field(default_factory=time.time)
    encoding: str = PLAIN
    """`plain` or `fp8-e4m3` (format 2)."""
    prenorm: bool = False
    """Whether the dump holds last_hidden_state_prenorm (format 2)."""

    def __post_init__(self) -> None:
        if not self.format_version:
            version = format_version_for(self.encoding, self.prenorm)
            object.__setattr__(self, "format_version", version)

    def to_json(self) -> str:
        data = asdict(self)
        # Format 1 dumps keep the exact format 1 layout: a reader of version 1 only would
        # refuse unknown keys.
        for key, default in (("encoding", PLAIN), ("prenorm", False)):
            if data[key] == default:
                del data[key]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> DumpMeta:
        """Parse and type-check meta.json (written by a server: untrusted)."""
        raw = _load_bounded(text, MAX_META_BYTES, META_FILE, CorruptDumpError)
        if not isinstance(raw, dict):
            raise CorruptDumpError("meta.json is malformed: not an object")
        _check_fields("meta.json", raw, _META_TYPES, _META_OPTIONAL)
        _check_fields("meta.json model", raw["model"], _MODEL_TYPES)
        try:
            meta = cls(**{**raw, "model": ModelIdentity(**raw["model"])})
        except TypeError as exc:  # an unknown field
            raise CorruptDumpError(f"meta.json is malformed: {exc}") from exc
        if meta.format_version not in READ_VERSIONS:
            raise CorruptDumpError(
                f"dump format_version {meta.format_version}, this hsq reads "
                f"{' and '.join(map(str, READ_VERSIONS))}"
            )
        if meta.format_version < format_version_for(meta.encoding, meta.prenorm):
            raise CorruptDumpError(
                f"meta.json of format {meta.format_version} uses encoding/prenorm of format "
                f"{format_version_for(meta.encoding, meta.prenorm)}"
            )
        return meta


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_int_list(v: object) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


def _is_str(v: object) -> bool:
    return isinstance(v, str) and len(v) <= 4096


_META_TYPES: dict[str, Callable[[object], bool]] = {
    "rid": _is_str,
    "num_tokens": _is_int,
    "input_fingerprint": _is_str,
    "layer_ids": _is_int_list,
    "hidden_size": _is_int,
    "dtype": _is_str,
    "model": lambda v: isinstance(v, dict),
    "tensors": lambda v: (
        isinstance(v, dict) and all(_is_str(k) and _is_int_list(x) for k, x in v.items())
    ),
    "request_index": _is_int,
}
_META_OPTIONAL: dict[str, Callable[[object], bool]] = {
    "layer_convention": _is_str,
    "format_version": _is_int,
    "created_unix": lambda v: _is_int(v) or isinstance(v, float),
    "encoding": _is_str,
    "prenorm": lambda v: isinstance(v, bool),
}
_MODEL_TYPES: dict[str, Callable[[object], bool]] = {
    "name": _is_str,
    "architecture": _is_str,
    "num_layers": _is_int,
    "hidden_size": _is_int,
    "config_digest": _is_str,
}


def _check_fields(
    what: str,
    raw: object,
    required: Mapping[str, Callable[[object], bool]],
    optional: Mapping[str, Callable[[object], bool]] | None = None,
) -> None:
    if not isinstance(raw, dict):
        raise CorruptDumpError(f"{what} is not an object")
    for name, ok in required.items():
        if name not in raw:
            raise CorruptDumpError(f"{what}: `{name}` is missing")
        if not ok(raw[name]):
            raise CorruptDumpError(f"{what}: `{name}` has the wrong type: {raw[name]!r:.80}")
    for name, ok in (optional or {}).items():
        if name in raw and not ok(raw[name]):
            raise CorruptDumpError(f"{what}: `{name}` has the wrong type: {raw[name]!r:.80}")


def format_version_for(encoding: str, prenorm: bool) -> int:
    """The oldest format that describes a dump: 1 unless it uses what format 2 added."""
    return 1 if encoding == PLAIN and not prenorm else 2


def state_tensors(num_layers: int, prenorm: bool = False) -> list[tuple[str, int]]:
    """The hidden-state tensors of a dump in file order, each with its rows of H values
    per token (the groups an fp8 encoding scales separately)."""
    out = [(AUX_TENSOR, num_layers), (LAST_TENSOR, 1)]
    if prenorm:
        out.append((PRENORM_TENSOR, 1))
    return out


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def expected_shapes(
    num_tokens: int,
    num_layers: int,
    hidden_size: int,
    *,
    encoding: str = PLAIN,
    prenorm: bool = False,
) -> dict[str, list[int]]:
    """{name: shape} of every tensor a dump holds, in file order."""
    shapes: dict[str, list[int]] = {}
    for name, groups in state_tensors(num_layers, prenorm):
        shapes[name] = [num_tokens, groups * hidden_size]
        if encoding == FP8:
            shapes[scale_name(name)] = [num_tokens, groups]
    return shapes


def tensor_dtype_code(name: str, meta: DumpMeta) -> str:
    """The safetensors dtype a dump's tensor must have."""
    if meta.encoding == FP8:
        return _SCALE_CODE if name.endswith(SCALE_SUFFIX) else _FP8_CODE
    return DTYPE_CODES[meta.dtype]  # no torch: a bf16 worker never loads it


# ---------------------------------------------------------------------------- writing


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_small(path: Path, data: bytes, fsync: bool = True) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def write_dump(
    dump_dir: Path,
    index: int,
    meta: DumpMeta,
    tensors: Mapping[str, torch.Tensor],
    *,
    mark_done: bool = True,
    fsync: bool = True,
    before_done: Callable[[Path], None] | None = None,
) -> Path:
    """Write one dump atomically: req_<N>.tmp/ -> files -> done -> rename to req_<N>/.

    ``mark_done=False`` leaves a dump without its marker and ``before_done`` may alter the
    files first: both exist for fault injection, so readers are tested against them.
    """
    tmp = dump_dir / f"{DUMP_PREFIX}{index}{TMP_SUFFIX}"
    final = dump_dir / f"{DUMP_PREFIX}{index}"
    tmp.mkdir(parents=False, exist_ok=False)
    entries = [
        (k, stfile.dtype_code(v.dtype), list(v.shape), v.numel() * v.element_size())
        for k, v in tensors.items()
    ]
    fd = os.open(tmp / TENSOR_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # os.write from the tensors' memory: no extra copy, and the GIL stays free for the
        # forward pass that shares this process.
        stfile.write(
            fd,
            stfile.build_header(entries, None),
            [stfile.tensor_bytes(v) for v in tensors.values()],
            crc=False,
            direct=False,  # the worker reads it back at once: keep it in the page cache
        )
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    _write_small(tmp / META_FILE, meta.to_json().encode(), fsync)
    if before_done is not None:
        before_done(tmp)
    if mark_done:
        _write_small(tmp / DONE_FILE, b"", fsync)
    if fsync:
        _fsync_path(tmp)
    os.rename(tmp, final)
    if fsync:
        _fsync_path(dump_dir)
    return final


# ---------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Scan:
    complete: list[Path]
    """req_<N>/ directories holding `done`, sorted by N."""
    pending: list[Path]
    """req_<N>.tmp/ and req_<N>/ without `done`: something is (or was) being written."""


def scan(dump_dir: Path) -> Scan:
    complete: list[tuple[int, Path]] = []
    pending: list[Path] = []
    with os.scandir(dump_dir) as it:
        for entry in it:
            m = _DUMP_RE.match(entry.name)
            if m:
                path = Path(entry.path)
                if (path / DONE_FILE).exists():
                    complete.append((int(m.group(1)), path))
                else:
                    pending.append(path)
            elif _TMP_RE.match(entry.name):
                pending.append(Path(entry.path))
    complete.sort()
    return Scan(complete=[p for _, p in complete], pending=sorted(pending))


def clear_dump_dir(dump_dir: Path) -> int:
    """Remove every dump and partial dump; returns how many were removed.

    Only names of the protocol are touched, so a lock file or anything else stays.
    """
    removed = 0
    with os.scandir(dump_dir) as it:
        names = [e.name for e in it if _DUMP_RE.match(e.name) or _TMP_RE.match(e.name)]
    for name in names:
        removed += remove_entry(dump_dir / name)  # links and files unlinked, never followed
    return removed


def wait_for_dump(
    dump_dir: Path,
    timeout: float,
    poll_interval: float = 0.002,
    *,
    server_alive: Callable[[], bool] | None = None,
    alive_check_s: float = 1.0,
) -> Path:
    """Wait until exactly one complete dump exists and nothing else is being written.

    Raises MultipleDumpsError as soon as two complete dumps exist, and after ``timeout``
    IncompleteDumpError (a dump without `done`), MultipleDumpsError (one complete plus
    another one started) or NoDumpError (nothing at all). While waiting longer than
    ``alive_check_s``, ``server_alive`` is asked now and then: a server that died after
    answering never finishes its dump, and that is not the sample's fault
    (ServerUnavailableError).
    """
    start = time.monotonic()
    deadline = start + timeout
    next_check = start + alive_check_s
    delay = poll_interval
    while True:
        s = scan(dump_dir)
        if len(s.complete) > 1:
            raise MultipleDumpsError(
                f"{len(s.complete)} dumps appeared for one request: "
                + ", ".join(p.name for p in s.complete)
            )
        if len(s.complete) == 1 and not s.pending:
            return s.complete[0]
        if time.monotonic() >= deadline:
            names = ", ".join(p.name for p in s.complete + s.pending)
            if s.complete and s.pending:
                raise MultipleDumpsError(f"one complete dump and more being written: {names}")
            if s.pending:
                raise IncompleteDumpError(f"no `done` marker after {timeout:.1f}s: {names}")
            raise NoDumpError(f"no dump appeared in {dump_dir} within {timeout:.1f}s")
        if server_alive is not None and time.monotonic() >= next_check:
            if not server_alive():
                raise ServerUnavailableError("the server went away before its dump was complete")
            next_check = time.monotonic() + alive_check_s
        time.sleep(delay)
        # Capped low: a dump usually lands within milliseconds of the answer, and every
        # millisecond between the dump and the next request is idle GPU time.
        delay = min(delay * 1.5, 0.005)


@dataclass(frozen=True)
class Expected:
    """What the client sent and what the run expects; None means "don't check"."""

    rid: str
    input_fingerprint: str
    num_tokens: int
    layer_ids: list[int] | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    model_id: str | None = None
    store_dtype: str | None = None
    """The run's storage format: an fp8-e4m3 dump is usable only by an fp8-e4m3 run."""
    prenorm: bool = False
    """The run stores the pre-norm final state: a dump without it cannot serve."""


@dataclass(frozen=True)
class Dump:
    path: Path
    meta: DumpMeta
    aux_hidden_states: torch.Tensor
    last_hidden_state: torch.Tensor
    """For an fp8-e4m3 dump, these are the stored float8 values (scales in `tensors`)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every tensor of the file by name (prenorm state, scales, and the two above)."""


def check_meta(meta: DumpMeta, exp: Expected) -> None:
    if meta.rid != exp.rid:
        raise StaleDumpError(f"dump rid {meta.rid!r} is not the request's rid {exp.rid!r}")
    if meta.input_fingerprint != exp.input_fingerprint:
        raise StaleDumpError("dump input fingerprint does not match the request's input ids")
    if meta.num_tokens != exp.num_tokens:
        raise WrongLengthError(f"dump has {meta.num_tokens} tokens, request had {exp.num_tokens}")
    checks: list[tuple[str, object, object]] = [
        ("layer_ids", meta.layer_ids, exp.layer_ids),
        ("hidden_size", meta.hidden_size, exp.hidden_size),
        ("dtype", meta.dtype, exp.dtype),
        ("model", meta.model.model_id, exp.model_id),
    ]
    for name, got, want in checks:
        if want is not None and got != want:
            raise MetaMismatchError(f"dump {name} is {got!r}, the run expects {want!r}")
    if meta.dtype not in DTYPE_CODES:
        raise CorruptDumpError(f"unknown dtype {meta.dtype!r} in meta.json")
    if meta.encoding not in ENCODINGS:
        raise CorruptDumpError(f"unknown encoding {meta.encoding!r} in meta.json")
    if meta.encoding == FP8 and exp.store_dtype not in (None, FP8):
        raise MetaMismatchError(
            f"the server quantized this dump to {FP8} and the run stores {exp.store_dtype}: "
            f"a run takes such dumps only with `hsq enqueue --store-dtype {FP8}`; otherwise "
            "start the server without --dump-encoding fp8-e4m3 / SGLANG_HS_DUMP_ENCODING"
        )
    if exp.prenorm and not meta.prenorm:
        raise MetaMismatchError(
            "the run stores the pre-norm final state (hsq enqueue --prenorm) and this dump "
            "has none: start the server with --prenorm (SGLang: SGLANG_HS_PRENORM=1)"
        )
    want_shapes = expected_shapes(
        meta.num_tokens,
        len(meta.layer_ids),
        meta.hidden_size,
        encoding=meta.encoding,
        prenorm=meta.prenorm,
    )
    if meta.tensors != want_shapes:
        raise CorruptDumpError(f"meta tensors {meta.tensors} disagree with {want_shapes}")


def read_meta(path: Path) -> DumpMeta:
    if not os.path.lexists(path / DONE_FILE):
        raise IncompleteDumpError(f"{path.name} has no `done` marker")
    try:
        data = _read_regular(path / META_FILE, MAX_META_BYTES)
    except OSError as exc:
        raise CorruptDumpError(f"{path.name}: cannot read meta.json: {exc}") from exc
    return DumpMeta.from_json(data)


@dataclass
class DumpTensors:
    """A dump tensor file whose header agrees with its meta: open, not read. `mm` is a
    private mapping when asked for (readers of tensors); the worker reads the bytes once
    with pread instead (stfile.Range), checks them and writes them."""

    fd: int
    mm: mmap.mmap | None
    header: stfile.Header

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
        os.close(self.fd)


def open_dump_tensors(
    path: Path, meta: DumpMeta, *, check_finite: bool = True, mapped: bool = True
) -> DumpTensors:
    """Open the tensor file of a dump whose meta passed check_meta, and check that its
    header agrees with the meta (names, shapes, dtype, size) and, with `check_finite`, that
    the values are finite (which needs `mapped`)."""
    try:
        fd = open_regular(path / TENSOR_FILE)  # a FIFO here blocked the persist thread
    except FileNotFoundError as exc:
        if not os.path.lexists(path):
            # The whole dump is gone, not its tensor file: its directory (the worker's
            # staging dir) was removed or moved away. The environment's fault.
            raise DumpDirError(f"{path} vanished: its directory was removed or moved") from exc
        raise CorruptDumpError(f"{path.name}: cannot open tensors: {exc}") from exc
    except OSError as exc:
        raise CorruptDumpError(f"{path.name}: cannot open tensors: {exc}") from exc
    try:
        header = stfile.read_header(fd)
        mm = stfile.map_file(fd) if mapped else None
    except (stfile.FormatError, OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        # Untrusted header JSON: entries that are not objects, offsets that are strings...
        os.close(fd)
        raise CorruptDumpError(f"{path.name}: unreadable tensors: {exc!r}") from exc
    dt = DumpTensors(fd, mm, header)
    try:
        if set(header.tensors) != set(meta.tensors):
            raise CorruptDumpError(
                f"{path.name}: tensors {sorted(header.tensors)}, meta {sorted(meta.tensors)}"
            )
        for name, shape in meta.tensors.items():
            info = header.tensors[name]
            code = tensor_dtype_code(name, meta)
            if info.shape != shape:
                raise CorruptDumpError(f"{path.name}: {name} has shape {info.shape}, meta {shape}")
            if info.dtype != code:
                raise CorruptDumpError(
                    f"{path.name}: {name} is {info.dtype}, meta says {meta.dtype} "
                    f"({meta.encoding}): {code}"
                )
            if check_finite and mm is not None and not stfile.all_finite(mm, info):
                raise NonFiniteDumpError(f"{path.name}: {name} holds NaN or Inf")
            if name.endswith(SCALE_SUFFIX) and _has_negative(fd, mm, info):
                raise CorruptDumpError(f"{path.name}: {name} holds negative scales")
    except BaseException:
        dt.close()
        raise
    return dt


def read_dump(path: Path, expected: Expected, *, check_finite: bool = True) -> Dump:
    """Load and validate one dump against what was sent. Cheap checks run first."""
    meta = read_meta(path)
    check_meta(meta, expected)
    open_dump_tensors(path, meta, check_finite=check_finite).close()
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path / TENSOR_FILE))  # an independent parser, as a check
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CorruptDumpError(f"{path.name}: unreadable tensors: {exc}") from exc
    return Dump(
        path=path,
        meta=meta,
        aux_hidden_states=tensors[AUX_TENSOR],
        last_hidden_state=tensors[LAST_TENSOR],
        tensors=tensors,
    )


def _has_negative(fd: int, mm: mmap.mmap | None, info: stfile.TensorInfo) -> bool:
    """A float32 scale tensor (small: [T, groups]) holding a value below zero."""
    if info.dtype != _SCALE_CODE or not info.nbytes:
        return False
    import numpy as np

    raw = mm[info.start : info.start + info.nbytes] if mm is not None else None
    if raw is None:
        raw = os.pread(fd, info.nbytes, info.start)
    return bool((np.frombuffer(raw, dtype="<f4") < 0).any())


# ---------------------------------------------------------------------------- readiness marker

READY_FILE = "hsq-ready.json"
"""Written by a server once its dump hook is active; not a req_* name, so never cleared."""
READY_MAX_BYTES = 64 * 1024
_READY_MAX_STR = 4096
_READY_MAX_LAYERS = 1024


@dataclass(frozen=True)
class ReadyMarker:
    """What a server with an active dump hook announces in its dump dir.

    A worker reads it before its first request: without it every sample would time out
    with no_dump (a hook that never loaded), so the worker refuses to start instead.
    """

    layer_ids: tuple[int, ...]
    """Effective HF hidden_states indices, as every dump's meta.json will record them."""
    model: ModelIdentity
    server: str
    """"sglang" or "hsq-reference"."""
    server_version: str
    hook_version: str
    """hsq's version (hsq.__version__) in the server's environment."""
    pid: int
    created_unix: float
    format_version: int = 0
    """The dump format the server writes (0, the default: derived from encoding and
    prenorm, as for DumpMeta); a worker refuses formats it cannot read."""
    encoding: str = PLAIN
    """How the server encodes its dumps: `plain` or `fp8-e4m3` (format 2)."""
    prenorm: bool = False
    """Whether every dump holds last_hidden_state_prenorm (format 2)."""

    def __post_init__(self) -> None:
        if not self.format_version:
            version = format_version_for(self.encoding, self.prenorm)
            object.__setattr__(self, "format_version", version)

    def to_json(self) -> str:
        data = asdict(self)
        data["layer_ids"] = list(self.layer_ids)
        for key, default in _READY_OPTIONAL.items():  # format 1 markers stay format 1
            if data[key] == default:
                del data[key]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ReadyMarker:
        """Strict: exact keys, exact types, bounded sizes; HookInactiveError otherwise."""
        raw = _load_bounded(text, READY_MAX_BYTES, READY_FILE, HookInactiveError)
        required = {f.name for f in fields(cls)} - set(_READY_OPTIONAL)
        obj = _ready_obj(raw, required, READY_FILE, optional=set(_READY_OPTIONAL))
        model = _ready_obj(obj["model"], {f.name for f in fields(ModelIdentity)}, "model")
        layers = obj["layer_ids"]
        if (
            not isinstance(layers, list)
            or not 0 < len(layers) <= _READY_MAX_LAYERS
            or not all(_is_int(i) and i >= 0 for i in layers)
        ):
            raise HookInactiveError(f"{READY_FILE}: layer_ids must be a list of ints >= 0")
        marker = cls(
            layer_ids=tuple(layers),
            model=ModelIdentity(
                name=_ready_str(model, "name"),
                architecture=_ready_str(model, "architecture"),
                num_layers=_ready_int(model, "num_layers"),
                hidden_size=_ready_int(model, "hidden_size"),
                config_digest=_ready_str(model, "config_digest"),
            ),
            server=_ready_str(obj, "server"),
            server_version=_ready_str(obj, "server_version"),
            hook_version=_ready_str(obj, "hook_version"),
            pid=_ready_int(obj, "pid"),
            created_unix=_ready_float(obj, "created_unix"),
            format_version=_ready_int(obj, "format_version"),
            encoding=_ready_str(obj, "encoding") if "encoding" in obj else PLAIN,
            prenorm=_ready_bool(obj, "prenorm") if "prenorm" in obj else False,
        )
        if marker.format_version not in READ_VERSIONS:
            raise HookInactiveError(
                f"the server writes dump format {marker.format_version}, this hsq reads "
                f"{' and '.join(map(str, READ_VERSIONS))}"
            )
        if marker.encoding not in ENCODINGS:
            raise HookInactiveError(f"{READY_FILE}: unknown encoding {marker.encoding!r}")
        if marker.format_version < format_version_for(marker.encoding, marker.prenorm):
            raise HookInactiveError(
                f"{READY_FILE}: format {marker.format_version} cannot describe encoding "
                f"{marker.encoding!r} with prenorm={marker.prenorm}"
            )
        return marker


_READY_OPTIONAL: dict[str, object] = {"encoding": PLAIN, "prenorm": False}
"""Marker keys of format 2, left out of a format 1 marker (a strict reader of format 1
refuses keys it does not know)."""


def _ready_obj(
    raw: object, keys: set[str], what: str, optional: set[str] | None = None
) -> dict[str, object]:
    if not isinstance(raw, dict):
        raise HookInactiveError(f"{READY_FILE}: {what} is not an object")
    if set(raw) - (optional or set()) != keys:
        raise HookInactiveError(f"{READY_FILE}: {what} keys {sorted(raw)}, expected {sorted(keys)}")
    return raw


def _ready_bool(obj: Mapping[str, object], key: str) -> bool:
    v = obj[key]
    if not isinstance(v, bool):
        raise HookInactiveError(f"{READY_FILE}: {key} must be true or false")
    return v


def _ready_str(obj: Mapping[str, object], key: str) -> str:
    v = obj[key]
    if not isinstance(v, str) or not v or len(v) > _READY_MAX_STR:
        raise HookInactiveError(f"{READY_FILE}: {key} must be a non-empty string")
    return v


def _ready_int(obj: Mapping[str, object], key: str) -> int:
    v = obj[key]
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**63:
        raise HookInactiveError(f"{READY_FILE}: {key} must be an integer >= 0")
    return v


def _ready_float(obj: Mapping[str, object], key: str) -> float:
    v = obj[key]
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise HookInactiveError(f"{READY_FILE}: {key} must be a finite number")
    return float(v)


def write_ready(dump_dir: Path, marker: ReadyMarker, *, fsync: bool = True) -> Path:
    """Write the marker atomically (temp file, fsync, rename): a reader sees all or none."""
    final = dump_dir / READY_FILE
    tmp = dump_dir / f".{READY_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, marker.to_json().encode())
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    if fsync:
        _fsync_path(dump_dir)
    return final


def read_ready(dump_dir: Path) -> ReadyMarker | None:
    """The server's marker; None while there is none. HookInactiveError if unusable."""
    try:
        data = _read_regular(dump_dir / READY_FILE, READY_MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, CorruptDumpError) as exc:
        raise HookInactiveError(f"cannot read {dump_dir / READY_FILE}: {exc}") from exc
    return ReadyMarker.from_json(data)


# ---------------------------------------------------------------------------- v2: by rid
#
# Protocol v2 lets a worker keep several requests in flight on one server. A dump is
# attributed *only* by the rid in its meta.json (then validated as in v1); the server's
# req_<N> counter is never predicted nor used. See docs/dump-protocol.md.


@dataclass(frozen=True)
class FoundDump:
    path: Path
    meta: DumpMeta


@dataclass(frozen=True)
class RidScan:
    complete: dict[str, list[FoundDump]]
    """Dumps holding `done`, by the rid in their meta.json (sorted by N)."""
    final_incomplete: dict[str, list[FoundDump]]
    """req_<N>/ without `done`: renamed without the marker, so it never gets one."""
    unreadable: list[tuple[Path, str]]
    """Renamed dumps whose meta.json cannot be read: no rid, so never attributable."""
    writing: int
    """req_<N>.tmp/ directories: a server is (or was) writing them."""
    strays: list[tuple[Path, str]] = field(default_factory=list)
    """Protocol names that are not real directories (a symlink, a file, a FIFO): no writer
    of the protocol makes them, so they are never dumps."""

    @property
    def activity(self) -> bool:
        """Something a dump writer makes appeared (strays do not count)."""
        return bool(self.complete or self.final_incomplete or self.unreadable or self.writing)


def _read_meta_limited(path: Path) -> DumpMeta:
    data = _read_regular(path / META_FILE, MAX_META_BYTES)
    if len(data) > MAX_META_BYTES:
        raise CorruptDumpError(f"{path.name}: meta.json is larger than {MAX_META_BYTES} bytes")
    meta = DumpMeta.from_json(data.decode("utf-8"))
    if not isinstance(meta.rid, str) or not isinstance(meta.num_tokens, int):
        raise CorruptDumpError(f"{path.name}: rid or num_tokens has the wrong type")
    return meta


def scan_by_rid(dump_dir: Path, skip: Mapping[str, tuple[int, int]] | None = None) -> RidScan:
    """One pass over the dump dir: every renamed dump with its meta read and typed.

    ``skip`` maps names to :func:`entry_id` of entries to pass over (ones that could not be
    removed): the same name as another (or a changed) entry is looked at again.
    """
    complete: dict[str, list[tuple[int, FoundDump]]] = {}
    final_incomplete: dict[str, list[FoundDump]] = {}
    unreadable: list[tuple[Path, str]] = []
    strays: list[tuple[Path, str]] = []
    writing = 0
    listed: list[tuple[str, str, bool]] = []
    with os.scandir(dump_dir) as it:
        for e in it:
            if not (_DUMP_RE.match(e.name) or _TMP_RE.match(e.name)):
                continue
            try:
                if (
                    skip
                    and e.name in skip
                    and skip[e.name] == _entry_id(e.stat(follow_symlinks=False))
                ):
                    continue
                listed.append((e.name, e.path, e.is_dir(follow_symlinks=False)))
            except OSError:
                continue  # gone since the listing
    for name, raw_path, is_dir in listed:
        path = Path(raw_path)
        if not is_dir:
            strays.append((path, _stray_kind(path)))
            continue
        m = _DUMP_RE.match(name)
        if not m:
            writing += 1
            continue
        done = os.path.lexists(path / DONE_FILE)  # any kind of entry: it is never opened
        try:
            meta = _read_meta_limited(path)
        except FileNotFoundError:
            if not os.path.lexists(path):
                continue  # removed between listing and reading (by us, after attribution)
            unreadable.append((path, "meta.json is missing"))
            continue
        except Exception as exc:  # untrusted bytes: any failure means "no usable rid"
            unreadable.append((path, f"{type(exc).__name__}: {exc}"))
            continue
        found = FoundDump(path, meta)
        if done:
            complete.setdefault(meta.rid, []).append((int(m.group(1)), found))
        else:
            final_incomplete.setdefault(meta.rid, []).append(found)
    return RidScan(
        complete={
            rid: [f for _, f in sorted(v, key=lambda x: x[0])] for rid, v in complete.items()
        },
        final_incomplete=final_incomplete,
        unreadable=unreadable,
        writing=writing,
        strays=strays,
    )


def _entry_id(st: os.stat_result) -> tuple[int, int]:
    # The inode alone is not enough: a removed entry's number is soon reused.
    return st.st_ino, st.st_ctime_ns


def _stray_kind(path: Path) -> str:
    try:
        return f"{_kind(os.lstat(path).st_mode)}, not a dump directory"
    except OSError as exc:
        return f"not a dump directory ({exc.strerror})"


def remove_dump(path: Path) -> bool:
    """Remove a dump (or anything else under a protocol name) without following links;
    True when it is gone."""
    return remove_entry(path)


@dataclass
class Wanted:
    """One request in flight, as the matcher sees it."""

    rid: str
    num_tokens: int
    added_at: float
    answered_at: float | None = None
    discards_at_add: int = 0
    held: FoundDump | None = None
    held_at: float = 0.0

    def hold_until(self, grace: float) -> float | None:
        """When a held short dump is given up waiting for its other part (None: not yet
        answered). Counted from the later of the answer and the sighting: a server may
        write its dumps after it answers."""
        if self.answered_at is None:
            return None
        return max(self.answered_at, self.held_at) + grace


@dataclass(frozen=True)
class Match:
    """The matcher's word on one in-flight rid: its dump, or why there is none."""

    rid: str
    dump: FoundDump | None = None
    error: Exception | None = None


UNREMOVABLE = "unremovable"
"""The `why` of a discarded entry that could not be removed: reported once, then skipped."""


class RidMatcher:
    """Attributes dumps to in-flight requests by rid; pure logic over one directory.

    Not thread-safe: the worker's dispatcher calls it under one lock. Rules
    (docs/dump-protocol.md): a dump whose rid is not in flight is removed and counted
    (``discarded[why]``); two dumps for one rid fail it (multiple_dumps), also when the
    second lands after the first was handed out but before it is used
    (:meth:`confirm_single`); a renamed dump without `done` fails its rid (incomplete_dump); a dump
    shorter than the request is held until ``split_grace_s`` after the answer, because a
    server that split the prefill writes the rest next (then multiple_dumps); no dump within
    ``timeout_s`` of the answer fails the rid (no_dump, or stale_dump when foreign dumps
    arrived meanwhile). A rid that gave up (``abandon``) is remembered for a while, so its
    late dump is discarded as "late". An attributed dump is moved into ``staging`` (same
    filesystem) before it is returned. An entry under a protocol name that is not a real
    directory (a symlink, a file, a FIFO) is unlinked, never followed; one that cannot be
    removed is counted once as ``unremovable`` and skipped from then on.
    """

    def __init__(
        self,
        dump_dir: Path,
        staging: Path,
        *,
        timeout_s: float,
        split_grace_s: float = 0.25,
        remember_late: int = 4096,
    ) -> None:
        self.dump_dir = dump_dir
        self.staging = staging
        self.timeout_s = timeout_s
        self.split_grace_s = split_grace_s
        self.wanted: dict[str, Wanted] = {}
        self._gone: dict[str, None] = {}  # insertion-ordered set of finished/abandoned rids
        # Rids whose dump was handed out and not used yet -> whether another dump carrying
        # the rid came since (then confirm_single() fails the attempt).
        self._delivered: dict[str, bool] = {}
        self._remember = remember_late
        self._stuck: dict[str, tuple[int, int]] = {}  # entries that cannot be removed
        self.discarded: dict[str, int] = {}
        self._discards = 0
        self.proven = False
        """A dump writer made something in the dump dir since the last reset_proof()."""

    def add(self, rid: str, num_tokens: int, now: float) -> None:
        if rid in self.wanted or rid in self._gone:
            raise ValueError(f"rid {rid!r} was used before: every attempt needs a fresh rid")
        self.wanted[rid] = Wanted(rid, num_tokens, now, discards_at_add=self._discards)

    def answered(self, rid: str, now: float) -> None:
        w = self.wanted.get(rid)
        if w is not None:
            w.answered_at = now

    def abandon(self, rid: str) -> None:
        """The request failed or timed out: whatever dump it still gets is late."""
        if self.wanted.pop(rid, None) is not None:
            self._forget(rid)

    def confirm_single(self, rid: str) -> None:
        """The dump handed out for ``rid`` is about to be used (validated, pinned, written).
        MultipleDumpsError if another dump carrying the rid came after it; from then on a
        dump carrying the rid is "late"."""
        if self._delivered.pop(rid, False):
            raise MultipleDumpsError(
                f"a second dump carrying rid {rid!r} arrived after the first was taken"
            )

    def release(self, rid: str) -> None:
        """The handed-out dump of ``rid`` failed validation: it will not be used."""
        self._delivered.pop(rid, None)

    def reset_proof(self) -> None:
        self.proven = False

    def retarget(self, staging: Path) -> None:
        """The dump dir was taken again (re-created, or another directory under its path)."""
        self.staging = staging
        self._stuck.clear()
        self.proven = False

    def _forget(self, rid: str) -> None:
        self._gone[rid] = None
        while len(self._gone) > self._remember:
            del self._gone[next(iter(self._gone))]

    def _discard(self, path: Path, why: str) -> str:
        """Remove an entry; returns the `why` it is counted under."""
        if not remove_dump(path):
            try:
                ident = _entry_id(os.lstat(path))  # after the attempt: what is left
            except OSError:
                ident = None
            if ident is not None:
                if len(self._stuck) >= 1024:  # keep only names that still exist
                    self._stuck = {
                        n: i for n, i in self._stuck.items() if os.path.lexists(self.dump_dir / n)
                    }
                self._stuck[path.name] = ident
                why = UNREMOVABLE
        self.discarded[why] = self.discarded.get(why, 0) + 1
        self._discards += 1
        return why

    def poll(self, now: float) -> tuple[list[Match], list[tuple[str, Path, str]]]:
        """One scan. Returns the decided rids and the discarded dumps (why, path, rid).

        A decided dump has been moved into ``staging`` already, so no later scan sees it.
        """
        s = scan_by_rid(self.dump_dir, self._stuck)
        self.proven = self.proven or s.activity
        decided: list[Match] = []
        dropped: list[tuple[str, Path, str]] = []
        for path, why in s.strays:
            self._drop(dropped, path, "not_a_dump", why)
        for path, why in s.unreadable:
            self._drop(dropped, path, "unreadable", why)
        for rid, found in s.final_incomplete.items():
            w = self.wanted.get(rid)
            if w is not None and w.held is None and rid not in s.complete:
                for f in found:
                    remove_dump(f.path)
                msg = f"{found[0].path.name} (rid {rid!r}) was renamed without its `done` marker"
                decided.append(self._decide(rid, error=IncompleteDumpError(msg)))
            else:
                for f in found:
                    self._drop(dropped, f.path, self._unwanted(rid), rid)
        for rid, dumps in s.complete.items():
            match = self._complete(rid, dumps, now, dropped)
            if match is not None:
                decided.append(match)
        decided.extend(self._expired(now, s))
        return decided, dropped

    def _unwanted(self, rid: str) -> str:
        """Why a dump carrying ``rid`` (not in flight) is discarded."""
        if rid in self._delivered:
            self._delivered[rid] = True  # confirm_single() fails the attempt
            return "duplicate"
        return "late" if rid in self._gone else "unknown_rid"

    def _drop(self, dropped: list[tuple[str, Path, str]], path: Path, why: str, rid: str) -> None:
        dropped.append((self._discard(path, why), path, rid))

    def _complete(
        self, rid: str, dumps: list[FoundDump], now: float, dropped: list[tuple[str, Path, str]]
    ) -> Match | None:
        w = self.wanted.get(rid)
        if w is None:
            why = self._unwanted(rid)
            for f in dumps:
                self._drop(dropped, f.path, why, rid)
            return None
        paths = {f.path for f in dumps}
        if w.held is not None:
            paths.add(w.held.path)
        if len(paths) > 1:
            for p in paths:
                remove_dump(p)
            names = ", ".join(sorted(p.name for p in paths))
            msg = f"{len(paths)} dumps carry rid {rid!r}: {names}"
            return self._decide(rid, error=MultipleDumpsError(msg))
        found = dumps[0]
        if found.meta.num_tokens < w.num_tokens:
            if w.held is None:  # maybe the first part of a split prefill: wait for the rest
                w.held, w.held_at = found, now
            until = w.hold_until(self.split_grace_s)
            if until is None or now < until:
                return None
        return self._decide(rid, dump=found)

    def _expired(self, now: float, s: RidScan) -> list[Match]:
        out = []
        for w in list(self.wanted.values()):
            if w.answered_at is None:
                continue  # the HTTP request itself has its own timeout
            until = w.hold_until(self.split_grace_s)
            if w.held is not None and until is not None and now >= until:
                out.append(self._decide(w.rid, dump=w.held))
                continue
            if now < w.answered_at + self.timeout_s:
                continue
            foreign = self._discards - w.discards_at_add
            err: Exception
            if foreign:
                err = StaleDumpError(
                    f"no dump carried rid {w.rid!r} within {self.timeout_s:.1f}s; {foreign} "
                    "dump(s) with other rids appeared meanwhile"
                )
            elif s.writing:
                err = IncompleteDumpError(
                    f"no complete dump for rid {w.rid!r} within {self.timeout_s:.1f}s "
                    f"({s.writing} still being written)"
                )
            else:
                err = NoDumpError(
                    f"no dump for rid {w.rid!r} appeared in {self.dump_dir} "
                    f"within {self.timeout_s:.1f}s"
                )
            out.append(self._decide(w.rid, error=err))
        return out

    def _decide(
        self, rid: str, *, dump: FoundDump | None = None, error: Exception | None = None
    ) -> Match:
        self.wanted.pop(rid, None)
        self._forget(rid)
        if dump is not None:
            # The rid is one we created (in flight), so it is safe as a file name.
            staged = self.staging / rid
            try:
                os.rename(dump.path, staged)
            except OSError as exc:
                if not _is_real_dir(self.staging):
                    # The dump dir was removed or replaced under us: the environment's
                    # fault, not the sample's (the dispatcher sees it too and pauses).
                    return Match(rid, None, DumpDirError(f"cannot stage {rid!r}: {exc}"))
                remove_dump(dump.path)
                return Match(rid, None, CorruptDumpError(f"cannot stage {dump.path.name}: {exc}"))
            dump = FoundDump(staged, dump.meta)
            self._delivered[rid] = False
            while len(self._delivered) > self._remember:
                del self._delivered[next(iter(self._delivered))]
        return Match(rid, dump, error)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
