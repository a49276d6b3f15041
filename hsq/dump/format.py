"""The dump format: layout, names, meta.json's schema, the tensors a dump holds.

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
what it sent (rid, fingerprint of the input ids, token count). The tensor names, dtypes
and encodings are hsq.states'; docs/dump-protocol.md is the prose version of this package.

No torch at import: a worker copying bf16 dumps never loads it (`DTYPES` loads it on use).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from hsq import jsonsafe
from hsq.errors import CorruptDumpError
from hsq.states import DUMP_DTYPES, FP8, PLAIN, SCALE_SUFFIX, scale_name, state_tensors
from hsq.stfile.header import DTYPE_CODES

if TYPE_CHECKING:
    import torch

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
LAYER_CONVENTION = "hf_hidden_states"
# meta.json is a few hundred bytes; anything near this limit is not a dump of ours.
MAX_META_BYTES = 1 * 2**20
_DUMP_RE = re.compile(r"^req_(\d+)$")
_TMP_RE = re.compile(r"^req_(\d+)\.tmp$")


def dump_index(name: str) -> int | None:
    """N of a renamed dump's directory name `req_<N>`; None for any other name."""
    m = _DUMP_RE.match(name)
    return int(m.group(1)) if m else None


def is_dump_name(name: str) -> bool:
    """A name of the protocol (`req_<N>` or `req_<N>.tmp`): only such entries are read,
    cleared or discarded; anything else in a dump dir (a lock, the marker) stays."""
    return bool(_DUMP_RE.match(name) or _TMP_RE.match(name))


if TYPE_CHECKING:
    DTYPES: dict[str, torch.dtype]


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # the torch dtypes of DUMP_DTYPES, by the same names
        import torch

        return {n: getattr(torch, n) for n in DUMP_DTYPES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DUMP_DTYPES:
        raise ValueError(f"unsupported dump dtype {dtype}")
    return name


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


def load_bounded(
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


FORMAT_2_DEFAULTS: dict[str, object] = {"encoding": PLAIN, "prenorm": False}
"""The keys format 2 added, each with the value a format 1 record means."""


class Versioned:
    """A record of the dump format (meta.json, the readiness marker): `format_version` 0
    becomes the oldest version that describes its encoding and pre-norm state."""

    format_version: int
    encoding: str
    prenorm: bool

    def __post_init__(self) -> None:
        if not self.format_version:
            version = format_version_for(self.encoding, self.prenorm)
            object.__setattr__(self, "format_version", version)

    @staticmethod
    def dumps(data: dict[str, Any]) -> str:
        """A record's fields as its file's JSON, keys sorted. A format 1 record keeps the
        exact format 1 layout, without format 2's keys: a reader of format 1 only refuses
        keys it does not know."""
        for key, default in FORMAT_2_DEFAULTS.items():
            if data[key] == default:
                del data[key]
        return json.dumps(data, sort_keys=True)


@dataclass(frozen=True)
class DumpMeta(Versioned):
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

    def to_json(self) -> str:
        # Field by field, not dataclasses.asdict (its deep copy was 2/3 of the 88 us this
        # cost the worker a sample); the same text, as json.dumps writes a list
        # and a tuple alike and nothing here is changed.
        data: dict[str, Any] = {f: getattr(self, f) for f in _META_FIELDS}
        data["model"] = {f: getattr(self.model, f) for f in _MODEL_FIELDS}
        return self.dumps(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> DumpMeta:
        """Parse and type-check meta.json (written by a server: untrusted)."""
        raw = load_bounded(text, MAX_META_BYTES, META_FILE, CorruptDumpError)
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


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_int_list(v: object) -> bool:
    return isinstance(v, list) and all(is_int(x) for x in v)


def _is_str(v: object) -> bool:
    return isinstance(v, str) and len(v) <= 4096


_META_TYPES: dict[str, Callable[[object], bool]] = {
    "rid": _is_str,
    "num_tokens": is_int,
    "input_fingerprint": _is_str,
    "layer_ids": _is_int_list,
    "hidden_size": is_int,
    "dtype": _is_str,
    "model": lambda v: isinstance(v, dict),
    "tensors": lambda v: (
        isinstance(v, dict) and all(_is_str(k) and _is_int_list(x) for k, x in v.items())
    ),
    "request_index": is_int,
}
_META_OPTIONAL: dict[str, Callable[[object], bool]] = {
    "layer_convention": _is_str,
    "format_version": is_int,
    "created_unix": lambda v: is_int(v) or isinstance(v, float),
    "encoding": _is_str,
    "prenorm": lambda v: isinstance(v, bool),
}
_MODEL_TYPES: dict[str, Callable[[object], bool]] = {
    "name": _is_str,
    "architecture": _is_str,
    "num_layers": is_int,
    "hidden_size": is_int,
    "config_digest": _is_str,
}

_META_FIELDS = tuple(f.name for f in fields(DumpMeta))
_MODEL_FIELDS = tuple(f.name for f in fields(ModelIdentity))


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
        scale = name.endswith(SCALE_SUFFIX)
        return DTYPE_CODES["float32" if scale else "float8_e4m3fn"]
    return DTYPE_CODES[meta.dtype]  # no torch: a bf16 worker never loads it
