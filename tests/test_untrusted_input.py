"""Input read from outside (meta.json, tensor headers, Redis
manifest entries, dataset lines, URLs) is type-checked and bounded."""

from __future__ import annotations

import json
import os
import re
import struct
import tomllib
from pathlib import Path
from typing import Any

import pytest

from hsq.dataset.jsonl import scan_dataset
from hsq.dataset.read import read_sample
from hsq.dump.format import DONE_FILE, META_FILE, DumpMeta, ModelIdentity
from hsq.dump.read import read_meta
from hsq.errors import CorruptDumpError
from hsq.producer.synthetic import write_synthetic
from hsq.redisurl import redact
from hsq.stfile.header import FormatError, read_header
from tests.helpers import enqueue, hsq, store

ROOT = Path(__file__).resolve().parent.parent


def good_meta() -> dict[str, Any]:
    model = ModelIdentity("tiny", "LlamaForCausalLM", 4, 8, "ab" * 16)
    meta = DumpMeta("r1", 3, "blake2b128:00", [1, 2], 8, "bfloat16", model, {}, 0)
    return json.loads(meta.to_json())  # type: ignore[no-any-return]


def with_(path: str, value: Any) -> dict[str, Any]:
    meta = good_meta()
    target = meta
    *parents, leaf = path.split(".")
    for p in parents:
        target = target[p]
    target[leaf] = value
    return meta


BAD_META: dict[str, bytes] = {
    "invalid_utf8": b'{"rid": "\xff\xfe"}',
    "dtype_list": json.dumps(with_("dtype", ["bfloat16"])).encode(),
    "config_digest_int": json.dumps(with_("model.config_digest", 7)).encode(),
    "num_tokens_str": json.dumps(with_("num_tokens", "3")).encode(),
    "num_tokens_bool": json.dumps(with_("num_tokens", True)).encode(),
    "layer_ids_strs": json.dumps(with_("layer_ids", ["1"])).encode(),
    "tensors_not_lists": json.dumps(with_("tensors", {"a": 1})).encode(),
    "model_list": json.dumps(with_("model", [])).encode(),
    "unknown_field": json.dumps({**good_meta(), "extra": 1}).encode(),
    "not_object": b"[1, 2]",
    "too_large": json.dumps(with_("rid", "x" * (2 * 2**20))).encode(),
}


@pytest.mark.parametrize("case", sorted(BAD_META))
def test_malformed_meta_json_is_a_corrupt_dump_not_a_crash(tmp_path: Path, case: str) -> None:
    """Invalid UTF-8, wrong types or an oversized meta.json raised TypeError/
    UnicodeDecodeError (a worker crash loop); now CorruptDumpError, a sample-level failure."""
    (tmp_path / META_FILE).write_bytes(BAD_META[case])
    (tmp_path / DONE_FILE).write_bytes(b"")
    with pytest.raises(CorruptDumpError):
        read_meta(tmp_path)


def test_well_formed_meta_json_still_parses(tmp_path: Path) -> None:
    (tmp_path / META_FILE).write_text(json.dumps(good_meta()))
    (tmp_path / DONE_FILE).write_bytes(b"")
    assert read_meta(tmp_path).model.num_layers == 4


def header_file(tmp_path: Path, header: Any, data: bytes = b"\0" * 8) -> int:
    raw = json.dumps(header).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return os.open(path, os.O_RDONLY)


BAD_HEADERS: dict[str, Any] = {
    "entry_not_dict": {"a": [1, 2]},
    "entry_is_string": {"a": "x"},
    "offsets_strings": {"a": {"dtype": "U8", "shape": [8], "data_offsets": ["0", "8"]}},
    "offsets_floats": {"a": {"dtype": "U8", "shape": [8], "data_offsets": [0.0, 8.0]}},
    "offsets_three": {"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8, 9]}},
    "shape_not_list": {"a": {"dtype": "U8", "shape": 8, "data_offsets": [0, 8]}},
    "shape_bool": {"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 8]}},
    "dtype_list": {"a": {"dtype": ["U8"], "shape": [8], "data_offsets": [0, 8]}},
    "metadata_not_strings": {
        "__metadata__": {"k": 1},
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
    },
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_malformed_tensor_headers_raise_format_error(tmp_path: Path, case: str) -> None:
    """Header side: entries that are not dicts or offsets that are strings raised
    AttributeError/TypeError outside the handled exceptions (a sample silently dropped)."""
    fd = header_file(tmp_path, BAD_HEADERS[case])
    try:
        with pytest.raises(FormatError):
            read_header(fd)
    finally:
        os.close(fd)


def test_verify_requeue_never_touches_a_path_taken_from_redis(
    tmp_path: Path, redis_url: str
) -> None:
    """A manifest `path` from Redis (`../../..` or absolute) was used unchecked by
    `verify --requeue`, which deleted the target. Now such entries are refused, reported
    and left alone; the files survive."""
    ds = tmp_path / "d.jsonl"
    write_synthetic(ds, 3, seed=3)
    out = tmp_path / "out"
    enqueue(ds, "evil", out, redis_url)
    victims = [tmp_path / "victim-rel", tmp_path / "victim-abs"]
    for v in victims:
        v.write_text("precious")
    st = store(redis_url, "evil")
    paths = {"s000000": "../../victim-rel", "s000001": str(victims[1])}
    for sid, path in paths.items():
        entry = {"path": path, "num_tokens": 1, "bytes": 1, "checksum": "x", "worker": "w"}
        st.client.hset(st.keys.done, sid, json.dumps({**entry, "time": 0, "attempt": 0}))
    st.client.hset(st.keys.done, "s000002", b"\xff not json")
    res = hsq("verify", "--run", "evil", "--redis", redis_url, "--requeue", "--no-progress")
    assert res.returncode == 1, res.stderr
    assert all(v.read_text() == "precious" for v in victims)
    assert "refused 3" in res.stdout, res.stdout
    assert st.count(st.keys.done) == 3  # nothing un-done on the strength of an untrusted entry


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("redis://:hunter@2x@127.0.0.1:6379/0", "2x"),
        ("redis://user:p@ss@host:6379/0", "ss"),
        ("redis://127.0.0.1:6379/0?password=s3cr3t", "s3cr3t"),
        ("rediss://hsq:pw@host:6380/0?ssl_ca_certs=/ca.pem&password=zz", "zz"),
    ],
)
def test_redact_hides_every_form_of_password(url: str, secret: str) -> None:
    """Minor: `_redact` printed a `?password=` and the part of a password after an `@`."""
    shown = redact(url)
    assert secret not in shown.replace("***", ""), shown
    assert "6379" in shown or "6380" in shown


def test_an_overlong_dataset_line_is_refused_without_losing_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Minor: no per-line size limit (a 42 MB line cost 713 MB of RSS). A line over
    MAX_LINE_BYTES is an invalid line (`too_long`), never read whole, and the index offsets
    of the lines after it stay right."""
    monkeypatch.setattr("hsq.dataset.jsonl.MAX_LINE_BYTES", 200)
    ds = tmp_path / "d.jsonl"
    long_line = json.dumps({"id": "big", "input_ids": list(range(500))})
    ds.write_text(
        json.dumps({"id": "a", "input_ids": [1, 2]})
        + "\n"
        + long_line
        + "\n"
        + json.dumps({"id": "b", "input_ids": [3]})
        + "\n"
    )
    lines = list(scan_dataset(ds))
    assert [(x.sample_id, x.error.reason if x.error else None) for x in lines] == [
        ("a", None),
        (None, "too_long"),
        ("b", None),
    ]
    entry = lines[2].entry
    assert entry is not None and read_sample(ds, "b", entry).input_ids == [3]


def test_a_fixed_dataset_prunes_index_and_dead_line_entries(tmp_path: Path, redis_url: str) -> None:
    """Minor: the index and `line:N` dead entries were never pruned after the dataset was
    fixed, so status kept counting removed samples and long-fixed lines as dead."""
    ds = tmp_path / "d.jsonl"
    good = [json.dumps({"id": f"s{i}", "input_ids": [1, 2, i]}) for i in range(3)]
    ds.write_text("\n".join([*good, "{broken"]) + "\n")
    enqueue(ds, "prune", tmp_path / "o", redis_url)
    st = store(redis_url, "prune")
    assert "line:4" in st.dead_entries()
    ds.write_text("\n".join(good[:2]) + "\n")  # s2 removed, the broken line removed
    enqueue(ds, "prune", tmp_path / "o", redis_url)
    status = json.loads(
        hsq("status", "--run", "prune", "--redis", redis_url, "--json", check=True).stdout
    )
    assert st.dead_entries() == {}
    assert sorted(st.iter_hash_keys(st.keys.index)) == ["s0", "s1"]
    assert (status["total"], status["dead"], status["queued"]) == (2, 0, 2)


def test_docs_name_the_checksum_the_code_writes(tmp_path: Path) -> None:
    """Minor: docs said the manifest checksum is sha256; the code writes xxh3 (crc32 in older
    runs, still read)."""
    from hsq.outputs.check import file_checksum

    p = tmp_path / "f"
    p.write_bytes(b"x")
    algo = file_checksum(p).split(":")[0]
    for doc in ("docs/outputs.md", "docs/operations.md"):
        text = (ROOT / doc).read_text()
        assert "sha256 checksum" not in text and "`sha256:` of the file" not in text, doc
    outputs = (ROOT / "docs/outputs.md").read_text()
    assert algo == "xxh3" and "`xxh3:`" in outputs and "`crc32:`" in outputs


def test_python_floor_matches_the_code() -> None:
    """Minor: logging.getLevelNamesMapping needs 3.11, but pyproject said >=3.10."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floor = re.search(r">=\s*3\.(\d+)", project["project"]["requires-python"])
    assert floor is not None and int(floor.group(1)) >= 11
    assert project["tool"]["mypy"]["python_version"] == "3.11"


def test_reliability_doc_cites_only_tests_that_exist() -> None:
    """docs/reliability.md pairs each guarantee with a test: every cited test must exist."""
    text = (ROOT / "docs/reliability.md").read_text()
    cited = set(re.findall(r"`?(test_\w+\.py)::(test_\w+)", text))
    assert len(cited) > 20
    for file, name in sorted(cited):
        source = (ROOT / "tests" / file).read_text()
        assert f"def {name}(" in source, f"{file}::{name}"
