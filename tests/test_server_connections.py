"""A real `hsq worker` (with a real redis-server) against a server whose connections
misbehave over real sockets (tests/hostile.py's Wire): kept-alive connections closed under
a request or right after each answer, never with `Connection: close`; answers cut short of
their Content-Length; answers trickled a byte at a time (issue 42, D4-D6).

What holds in each: every sample ends done, once, with its own states; nothing is dead; a
request that met a connection the server had just closed is sent again and charged to
nothing (no hand-back, no pause); a cut or trickled answer is a failure mid-request (the
sample handed back and done later), never a stored answer nor `server_error`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hsq.dump.format import fingerprint
from hsq.outputs.format import open_output
from hsq.producer.synthetic import write_synthetic
from hsq.states import AUX_TENSOR, LAST_TENSOR
from hsq.workers.startup import STAGING
from tests.helpers import enqueue, hsq, log_events, spawn_worker, store
from tests.hostile import CUT, CUT_PARSABLE, TRICKLE, WHOLE, HostileServer, Wire, tensors_for


def first_time(
    how: str, only: Callable[[list[int]], bool] = lambda _ids: True
) -> Callable[[list[int]], str]:
    """The answer goes out as ``how`` the first time each input (for which ``only`` holds)
    is seen, whole after that."""
    seen: set[str] = set()
    lock = threading.Lock()

    def answer(ids: list[int]) -> str:
        fp = fingerprint(ids)
        with lock:
            first = fp not in seen and only(ids)
            seen.add(fp)
        return how if first else WHOLE

    return answer


def run_worker(
    tmp_path: Path, redis_url: str, wire: Wire, n: int, *extra: str, seed: int = 42
) -> tuple[HostileServer, Path]:
    """Enqueue n samples, run one burst worker against a HostileServer with ``wire`` to the
    end; the server and the worker's log. Every sample is then done, none dead, every file
    is the sample's own (its states those of a good dump), verify --deep holds, and no
    dump is left in the dump dir or its staging dir."""
    run = "wire"
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, n, seed=seed, min_len=4, max_len=24)
    out = tmp_path / "out"
    enqueue(ds, run, out, redis_url)
    srv = HostileServer(tmp_path / "dumps", wire=wire)
    log = tmp_path / "w.log"
    try:
        w = spawn_worker(run, srv.url, srv.dump_dir, redis_url, log, "--burst", *extra)
        assert w.proc.wait(240) == 0, w.log_tail()
    finally:
        srv.stop()
    st = store(redis_url, run)
    assert st.count(st.keys.done) == n and st.count(st.keys.dead) == 0, w.log_tail()
    files = sorted(out.rglob("*.safetensors"))
    assert len(files) == n
    for path in files:
        stored = open_output(path)
        good = tensors_for(stored.input_ids.tolist())
        assert torch.equal(stored.aux_hidden_states, good[AUX_TENSOR]), path
        assert torch.equal(stored.last_hidden_state, good[LAST_TENSOR]), path
    res = hsq("verify", "--run", run, "--deep", "--redis", redis_url)
    assert res.returncode == 0, res.stdout + res.stderr
    assert list((srv.dump_dir / STAGING).iterdir()) == []
    assert list(srv.dump_dir.glob("req_*")) == []
    return srv, log


def events(log: Path, event: str) -> list[dict[str, object]]:
    return log_events(log, event)


@pytest.mark.timeout(300)
def test_requests_the_server_closed_kept_alive_connections_under_are_sent_again_unharmed(
    tmp_path: Path, redis_url: str
) -> None:
    """D4, made certain: each connection answers once and closes under the next request,
    after the server read that request and wrote its dump (with other values). Each such
    request goes again under a new rid on a fresh connection; no sample and no pause is
    charged for it, and the first try's dump is never stored for the second."""
    wire = Wire(answers_per_connection=1, dump_unanswered=True)
    srv, log = run_worker(tmp_path, redis_url, wire, 16, "--inflight", "2")
    again = events(log, "request_sent_again")
    assert again and {e["rid"] for e in again} == set(srv.unanswered_rids)
    assert all(e["new_rid"] not in srv.unanswered_rids for e in again)
    for quiet in ("sample_handed_back", "pausing", "sample_retry", "sample_dead"):
        assert not events(log, quiet), quiet


@pytest.mark.timeout(300)
def test_a_server_that_closes_each_connection_right_after_its_answer_costs_nothing(
    tmp_path: Path, redis_url: str
) -> None:
    """D4 as it was seen: a healthy server closing each kept-alive connection right after
    its answer (an idle timeout of zero) had 33 of 200 samples handed back as server
    crashes, 24 pauses and a dead sample. The race is the wire's: the worker sends its
    next request before the close reaches it, or sees the close first and drops the
    connection."""
    wire = Wire(close_after_answer=True, close_delay_s=0.001)
    srv, log = run_worker(tmp_path, redis_url, wire, 60, "--inflight", "4")
    for quiet in ("sample_handed_back", "pausing", "sample_retry", "sample_dead"):
        assert not events(log, quiet), quiet
    assert srv.closed_under == 0  # every request the server read, it answered


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", [CUT, CUT_PARSABLE])
def test_an_answer_cut_short_of_its_content_length_is_handed_back_never_stored(
    tmp_path: Path, redis_url: str, how: str
) -> None:
    """D6: the first answer to each sample stops short of its Content-Length, then the
    connection closes; in half of the cases what came still parses as JSON. Each is a
    failure mid-request: the sample is handed back and done on its next try, never taken
    from the cut answer, never `server_error`."""
    n = 6
    _, log = run_worker(tmp_path, redis_url, Wire(answer=first_time(how)), n, "--inflight", "1")
    back = events(log, "sample_handed_back")
    assert len(back) == n and {e["reason"] for e in back} == {"server_crash"}, back
    assert not [e for e in events(log, "sample_retry") if e.get("reason") == "server_error"]
    assert not events(log, "request_sent_again")  # answer bytes came: never a stale connection


@pytest.mark.timeout(300)
def test_a_trickled_answer_fails_at_the_request_timeout_not_per_byte(
    tmp_path: Path, redis_url: str
) -> None:
    """D5: a server trickling an answer a byte every 0.3 s held a request 37.9 s under
    --request-timeout 3. Here one sample's first answer comes a byte every 0.2 s (about a
    minute for all of it, each byte well within the timeout): it fails at the request's
    deadline, is handed back and done on its next try, and the trickle never ends."""
    wire = Wire(answer=first_time(TRICKLE, only=lambda ids: len(ids) % 2 == 0), trickle_s=0.2)
    srv, log = run_worker(tmp_path, redis_url, wire, 4, "--inflight", "1", "--request-timeout", "3")
    back = events(log, "sample_handed_back")
    assert back and {e["reason"] for e in back} == {"server_crash"}, back
    assert all("timed out" in str(e["error"]) for e in back), back
    assert srv.trickled_whole == 0
