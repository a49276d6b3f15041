"""Hosts in network namespaces for the tests that need a second host: each linked to the
root namespace by a veth pair, created and removed by the test (root and iproute2 needed)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest

# Every name these tests create: "hsqt<pid of the pytest process><host>" for a namespace,
# the same plus "0" for its veth in the root namespace (at most 15 characters). The pid
# makes the names unique per session and tells a stale one (its session is gone) from one
# a running session still uses.
NS_PREFIX = "hsqt"
_OWNED = re.compile(rf"^{NS_PREFIX}(\d+)[A-Z]0?$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]  # "NAME (id: 0)"


def _link_names() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    # "3: NAME@PEER: <FLAGS> ..."
    return [line.split()[1].rstrip(":").split("@")[0] for line in out.splitlines() if line]


def clean_stale_netns() -> list[str]:
    """Remove the namespaces and links of earlier test sessions that were killed
    before their teardown ran (their pid is gone); returns the names removed."""
    removed = []
    for kind, names in (("link", _link_names()), ("netns", netns_names())):
        for name in names:
            m = _OWNED.match(name)
            if m and not _alive(int(m.group(1))):
                subprocess.run(["ip", kind, "del", name], capture_output=True)
                removed.append(name)
    return removed


class Netns:
    """Hosts B and C in their own network namespaces, each linked by a veth pair to the
    root namespace (host A). Created and removed by the test."""

    def __init__(self, pid: int) -> None:
        self.tag = f"{NS_PREFIX}{pid}"
        self.subnet = 16 + (pid % 100) * 2  # two sessions at once rarely share a subnet
        self.hosts: dict[str, tuple[str, str, str]] = {}  # name -> (ns, root ip, host ip)

    def ip(self, *args: str, ns: str | None = None) -> None:
        cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def add(self, name: str) -> None:
        subnet = self.subnet + len(self.hosts)
        ns, veth = f"{self.tag}{name}", f"{self.tag}{name}0"
        root_ip, host_ip = f"10.231.{subnet}.1", f"10.231.{subnet}.2"
        self.hosts[name] = (ns, root_ip, host_ip)  # before creating: cleanup covers a half
        self.ip("netns", "add", ns)
        self.ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.ip("addr", "add", f"{root_ip}/24", "dev", veth)
        self.ip("link", "set", veth, "up")
        self.ip("addr", "add", f"{host_ip}/24", "dev", "eth0", ns=ns)
        self.ip("link", "set", "eth0", "up", ns=ns)
        self.ip("link", "set", "lo", "up", ns=ns)

    def link(self, name: str, up: bool) -> None:
        self.ip("link", "set", f"{self.tag}{name}0", "up" if up else "down")

    def exec(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[name][0]]

    def cleanup(self) -> None:
        for name, (ns, _, _) in self.hosts.items():
            subprocess.run(["ip", "link", "del", f"{self.tag}{name}0"], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.hosts.clear()


def needs_netns() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")


@pytest.fixture
def netns(request: pytest.FixtureRequest) -> Iterator[Netns]:
    needs_netns()
    clean_stale_netns()
    net = Netns(os.getpid())
    # A finalizer, registered before anything exists, runs on failure and on Ctrl-C; SIGTERM
    # (a CI timeout, `kill`) is turned into the same KeyboardInterrupt while the namespaces
    # exist, so its teardown runs too. Only SIGKILL leaves them: the next session's
    # clean_stale_netns removes those.
    request.addfinalizer(net.cleanup)
    previous = signal.getsignal(signal.SIGTERM)

    def interrupted(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    request.addfinalizer(lambda: signal.signal(signal.SIGTERM, previous))
    try:
        net.add("B")
        net.add("C")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
    yield net
