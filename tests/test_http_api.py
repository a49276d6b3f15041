"""hsq/engines/http_api.py over real HTTP, in process: what no server test pins alone."""

from __future__ import annotations

import threading

import httpx

from hsq.engines.http_api import ApiServer, Reply


def test_a_replys_work_runs_once_its_answer_is_written() -> None:
    """`then` waits (10 s at most, a guard) until the client holds the answer: had it run
    before the answer was written, the client could not have said so, and it records
    False."""
    answered = threading.Event()
    seen: list[bool] = []
    ran = threading.Semaphore(0)

    def then() -> None:
        seen.append(answered.wait(10))
        ran.release()

    srv = ApiServer(("127.0.0.1", 0), {("POST", "/save"): lambda _body: Reply({"ok": 1}, then)})
    srv.serve_in_thread()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            assert client.post("/save", json={}).json() == {"ok": 1}
            answered.set()
            assert ran.acquire(timeout=30)
            # the connection stays usable after the work
            assert client.post("/save", json={}).json() == {"ok": 1}
            assert ran.acquire(timeout=30)
    finally:
        srv.shutdown()
        srv.server_close()
    assert seen == [True, True]


def test_a_plain_answer_is_sent_as_it_is() -> None:
    srv = ApiServer(("127.0.0.1", 0), {("GET", "/x"): lambda _body: {"a": [1, 2]}})
    srv.serve_in_thread()
    try:
        assert httpx.get(srv.url + "/x", timeout=30).json() == {"a": [1, 2]}
    finally:
        srv.shutdown()
        srv.server_close()
