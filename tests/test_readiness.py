"""The readiness marker: its strict format, the worker's start-up wait, and real processes.

A server whose dump hook is not active answers every request and writes nothing; the
worker must refuse to start against it instead of timing out sample after sample.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from hsq.dump.find import clear_dump_dir
from hsq.dump.format import FORMAT_VERSION, ModelIdentity
from hsq.dump.ready import READY_FILE, READY_MAX_BYTES, ReadyMarker, read_ready, write_ready
from hsq.errors import HookInactiveError
from hsq.node.spawn import FRESH
from hsq.producer.synthetic import write_synthetic
from hsq.workers.readiness import await_hook, check_marker
from tests.helpers import enqueue, start_worker, store
from tests.support.procs import ReferenceServer

Factory = Callable[..., ReferenceServer]
IDENT = ModelIdentity("Kimi-K2.5", "KimiK25ForConditionalGeneration", 61, 7168, "ab" * 32)
MARKER = ReadyMarker(
    layer_ids=(2, 30, 58),
    model=IDENT,
    server="sglang",
    server_version="0.5.23",
    hook_version="0.1.0",
    pid=4242,
    created_unix=1.5e9,
)


# ---------------------------------------------------------------------------- format


def test_marker_round_trips_and_survives_clearing(tmp_path: Path) -> None:
    assert read_ready(tmp_path) is None
    path = write_ready(tmp_path, MARKER)
    assert path.name == READY_FILE
    assert read_ready(tmp_path) == MARKER
    assert [p.name for p in tmp_path.iterdir()] == [READY_FILE]  # no temp file left
    (tmp_path / "req_0").mkdir()
    assert clear_dump_dir(tmp_path) == 1  # the worker's clear keeps the marker
    assert read_ready(tmp_path) == MARKER
    write_ready(tmp_path, replace(MARKER, layer_ids=(3, 31, 59)))  # replaced atomically
    marker = read_ready(tmp_path)
    assert marker is not None and marker.layer_ids == (3, 31, 59)


def _mutate(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(data))
    *parents, key = path.split(".")
    target = out
    for p in parents:
        target = target[p]
    if value is KeyError:
        del target[key]
    else:
        target[key] = value
    return cast(dict[str, Any], out)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("layer_ids", KeyError),  # missing
        ("extra", 1),  # unknown key
        ("layer_ids", "2,30,58"),
        ("layer_ids", []),
        ("layer_ids", [2, True]),
        ("layer_ids", [2, -1]),
        ("layer_ids", list(range(2000))),
        ("pid", "4242"),
        ("pid", True),
        ("pid", 1.5),
        ("created_unix", "now"),
        ("created_unix", float("inf")),
        ("server", ""),
        ("server", "x" * 5000),
        ("hook_version", None),
        ("model", "Kimi"),
        ("model.num_layers", "61"),
        ("model.config_digest", KeyError),
        ("model.extra", 1),
        ("format_version", FORMAT_VERSION + 1),
    ],
)
def test_marker_is_parsed_strictly(path: str, value: Any) -> None:
    good = json.loads(MARKER.to_json())
    assert ReadyMarker.from_json(json.dumps(good)) == MARKER
    with pytest.raises(HookInactiveError, match=READY_FILE + "|format"):
        ReadyMarker.from_json(json.dumps(_mutate(good, path, value)))


@pytest.mark.parametrize(
    "text", ["", "not json", "[]", "null", b"\xff\xfe", " " * (READY_MAX_BYTES + 1)]
)
def test_marker_that_is_not_an_object_or_too_large(tmp_path: Path, text: str | bytes) -> None:
    (tmp_path / READY_FILE).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(HookInactiveError):
        read_ready(tmp_path)


# ---------------------------------------------------------------------------- worker wait


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_check_marker_against_what_the_run_pins() -> None:
    check_marker(MARKER)
    check_marker(MARKER, layer_ids=[2, 30, 58], model_id=IDENT.model_id)
    with pytest.raises(HookInactiveError, match=r"captures layers \[2, 30, 58\].*\[3, 31, 59\]"):
        check_marker(MARKER, layer_ids=[3, 31, 59])
    with pytest.raises(HookInactiveError, match="runs model"):
        check_marker(MARKER, model_id="other@0123456789abcdef")


def test_await_returns_a_present_marker(tmp_path: Path) -> None:
    write_ready(tmp_path, MARKER)
    assert await_hook(tmp_path, lambda: True, layer_ids=[2, 30, 58]) == MARKER
    with pytest.raises(HookInactiveError, match="captures layers"):
        await_hook(tmp_path, lambda: True, layer_ids=[2, 31, 58])


def test_await_refuses_a_healthy_server_without_marker(tmp_path: Path) -> None:
    with pytest.raises(HookInactiveError, match="hook is not active"):
        await_hook(tmp_path, lambda: True)


def test_await_waits_while_the_server_starts(tmp_path: Path) -> None:
    calls = []

    def healthy() -> bool:
        calls.append(1)
        if len(calls) == 3:  # the model loaded: the hook announces itself
            write_ready(tmp_path, MARKER)
        return False

    assert await_hook(tmp_path, healthy, poll_s=0.001) == MARKER
    assert len(calls) == 3


def test_await_gives_up_after_the_timeout(tmp_path: Path) -> None:
    clock = FakeClock()

    def healthy() -> bool:
        clock.now += 10
        return False

    with pytest.raises(HookInactiveError, match="after 30s"):
        await_hook(tmp_path, healthy, timeout_s=30, poll_s=0.001, clock=clock)


def test_await_returns_none_when_stopped(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    assert await_hook(tmp_path, lambda: False, stop=stop) is None


# ---------------------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def plain(server_factory: Factory) -> ReferenceServer:
    """One default server for the tests that only read its marker (a worker refusing it
    at start-up sends it nothing). A fresh exec: the marker as `hsq serve-reference`
    writes it from a process start of its own."""
    srv = server_factory(name="plain", spawner=FRESH).wait_ready()
    assert srv.spawned_by == "fresh"
    return srv


@pytest.mark.realproc
def test_reference_server_writes_the_marker_before_it_is_healthy(plain: ReferenceServer) -> None:
    srv = plain
    marker = read_ready(srv.dump_dir)
    assert marker is not None and marker.server == "hsq-reference"
    info = httpx.get(srv.url + "/model_info", timeout=10).json()["hsq"]
    assert list(marker.layer_ids) == info["layer_ids"]
    assert marker.model.model_id == info["model_id"]


@pytest.mark.realproc
def test_worker_refuses_a_server_without_an_active_hook(
    tmp_path: Path, server_factory: Factory, redis_url: str
) -> None:
    """A real worker against a real server that writes no marker: exit 2 with the reason,
    no sample touched (all still queued, none dead-lettered)."""
    srv = server_factory("--no-ready-marker", name="hookless").wait_ready()
    assert read_ready(srv.dump_dir) is None
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 6, seed=5, min_len=4, max_len=16)
    enqueue(ds, "hookless", tmp_path / "out", redis_url)
    w = start_worker(tmp_path, "hookless", srv, redis_url, "--burst")
    assert w.proc.wait(60) == 2, w.log_tail()
    assert "hook is not active" in w.log_path.read_text()
    st = store(redis_url, "hookless")
    assert st.count(st.keys.done) == 0 and st.count(st.keys.dead) == 0
    assert len(st.outstanding_samples()) == 6


@pytest.mark.realproc
def test_worker_refuses_a_server_capturing_other_layers(
    tmp_path: Path, plain: ReferenceServer, redis_url: str
) -> None:
    srv = plain
    marker = read_ready(srv.dump_dir)
    assert marker is not None
    other = ",".join(str(i + 1) for i in marker.layer_ids)
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 4, seed=6, min_len=4, max_len=16)
    enqueue(ds, "pinned", tmp_path / "out", redis_url, "--layers", other)
    w = start_worker(tmp_path, "pinned", srv, redis_url, "--burst")
    assert w.proc.wait(60) == 2, w.log_tail()
    assert "the run pins" in w.log_path.read_text()
    st = store(redis_url, "pinned")
    assert st.count(st.keys.dead) == 0 and len(st.outstanding_samples()) == 4
