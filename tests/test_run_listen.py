"""`hsq run --listen` and `hsq run --join` between two hosts: node 1 in the root network
namespace serves its Redis over TLS on its link to node 2, a second network namespace on
the same filesystem (tests/test_multinode.py's Netns), which joins with OUT/.hsq/join-url
alone. Both do work; node 2 is killed with kill -9 mid-run and node 1 reaps its jobs and
finishes the run, all done and verified. No password crosses the link in clear text (a
packet capture on node 2's interface), and a user of node 2 listening on its loopback at
the Redis's port gets nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from hsq.producer.synthetic import write_synthetic
from tests.helpers import wait_until
from tests.run_helpers import Node, done_events, no_node_left, run_store, worker_logs
from tests.support.listener import LISTENER
from tests.support.netns import Netns, netns

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="network namespaces"),
    # Two `hsq run`s whose servers import torch, a heartbeat expiry: 25 s on a busy 2-core
    # machine, so in `make test`.
    pytest.mark.timeout(600),
    pytest.mark.usefixtures(no_node_left.__name__, netns.__name__),
]
SAMPLES = 40
SNIFF = r"""
import socket, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
s.bind(("eth0", 0))
s.settimeout(0.5)
with open(sys.argv[1], "wb") as f:
    print("sniffing", flush=True)
    while True:
        try:
            f.write(s.recv(65536)); f.flush()
        except TimeoutError:
            pass
"""


def test_a_second_host_joins_over_tls_is_killed_and_its_work_is_reaped(
    tmp_path: Path, netns: Netns
) -> None:
    _ns, root_ip, _host_ip = netns.hosts["B"]
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, SAMPLES, seed=6, min_len=4, max_len=48)
    out_1, out_2 = tmp_path / "n1", tmp_path / "n2"
    first = Node(tmp_path, "n1", str(ds), "--out", str(out_1), "--listen", root_ip,
                 "--node-name", "first", "--chunk-size", "2", "--inflight", "1", "--json",
                 "--verify", "--", "--fault", "slow:seconds=0.5")  # fmt: skip
    join_file = out_1 / ".hsq" / "join-url"
    wait_until(join_file.exists, 120, interval=0.1)
    join = urlsplit(join_file.read_text().strip())
    assert join.scheme == "rediss" and join.hostname == root_ip and join.password
    password = join.password

    # On node 2: a capture of its link, and another user on its loopback at the port.
    capture = tmp_path / "capture.bin"
    sniffed = tmp_path / "sniffer.out"
    with open(sniffed, "wb") as f:
        sniffer = subprocess.Popen([*netns.exec("B"), sys.executable, "-c", SNIFF, str(capture)],
                                   stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    listened = tmp_path / "listener.out"
    with open(listened, "wb") as f:
        listener = subprocess.Popen(
            [*netns.exec("B"), "runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c",
             LISTENER, "tcp", str(join.port)], stdout=f, stderr=subprocess.STDOUT, cwd="/",
            start_new_session=True,  # runuser's child too: the group is killed below
        )  # fmt: skip
    try:
        wait_until(lambda: "sniffing" in sniffed.read_text(), 30, interval=0.05)
        wait_until(lambda: "listening" in listened.read_text(), 30, interval=0.05)
        second = Node(tmp_path, "n2", "--join", "--run", "data", "--out", str(out_2),
                      "--redis-url-file", str(join_file), "--node-name", "joiner",
                      "--", "--fault", "slow:seconds=0.3", prefix=netns.exec("B"))  # fmt: skip
        wait_until(lambda: len(done_events(worker_logs(out_2))) >= 3, 240, interval=0.1)
        st = run_store(out_1, "data")

        def held_by_second() -> list[str]:
            return [s for s, place in st.outstanding_samples().items() if "joiner" in place]

        wait_until(lambda: bool(held_by_second()), 60, interval=0.02)
        os.killpg(second.proc.pid, signal.SIGKILL)  # node 2, its servers and workers
        held = held_by_second()
        second.wait(30)
        assert first.wait(400) == 0, first.output()
    finally:
        sniffer.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(listener.pid, signal.SIGKILL)
        sniffer.wait(10)
        listener.wait(10)
    summary = first.summary()
    status = summary["status"]
    assert isinstance(status, dict) and status["done"] == SAMPLES and status["dead"] == 0
    assert summary["verified"] == {"checked": SAMPLES, "ok": SAMPLES, "problems": 0}
    by_second = set(done_events(worker_logs(out_2)))
    by_first = set(done_events(worker_logs(out_1)))
    assert len(by_second) >= 3 and len(by_first | by_second) == SAMPLES
    assert held and set(held) <= by_first  # what node 2 held at its death, node 1 did
    wire = capture.read_bytes()
    assert len(wire) > 10_000  # the joiner's traffic was captured
    assert password.encode() not in wire and b"AUTH" not in wire and b"HELLO" not in wire
    assert "got" not in listened.read_text()
    assert not join_file.exists()  # removed with the Redis it named
