"""`make slurm-test`: deploy/slurm/ submitted to a real single-node Slurm cluster.

munged, slurmctld and slurmd start here with a test-owned configuration (daemon ports and
the node address on 127.0.0.1, state under the test's temp dir). head.sbatch and then
worker-node.sbatch in CPU mode (two reference servers) are submitted the way docs/multinode.md
says, before anything is enqueued, so the worker node's waits are exercised. A small run
completes; every output verifies; Prometheus finds both workers through file-based
discovery and scrapes their counts; scancel leaves no process of either job running.
Needs root, slurm-wlm, munge, redis-server and prometheus (scripts/setup_deploy.sh).
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploy_helpers import (
    HSQ,
    ROOT,
    VENV,
    Ports,
    prometheus_targets,
    prometheus_value,
    require,
    run_status,
    sh,
    wait_for,
)

from hsq.node.procs import ManagedProcess
from hsq.producer.synthetic import write_synthetic

SAMPLES = 24


@dataclass
class Cluster:
    base: Path
    env: dict[str, str]
    ports: Ports

    def sbatch(self, script: str, *opts: str, **exports: str) -> str:
        export = ",".join(["ALL", *(f"{k}={v}" for k, v in exports.items())])
        return sh(
            "sbatch", "--parsable", f"--chdir={self.base}", f"--export={export}", *opts,
            str(ROOT / "deploy/slurm" / script), env=self.env,
        ).strip()  # fmt: skip

    def jobs(self) -> list[str]:
        return sh("squeue", "-h", "-o", "%i %T", env=self.env).split("\n")[:-1]


def slurm_conf(base: Path, node: str, munge_socket: Path, ports: Ports) -> str:
    ctld_port, slurmd_port = ports.block(), ports.block()
    return f"""\
ClusterName=hsqtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
ProctrackType=proctrack/linuxproc
SlurmUser=root
SlurmdUser=root
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
KillWait=30
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd.log
NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    require("munged", "slurmctld", "slurmd", "sbatch", "redis-server", "prometheus")
    node = socket.gethostname().split(".")[0]
    munge = tmp_path / "munge"
    munge.mkdir(mode=0o700)
    (munge / "munge.key").write_bytes(os.urandom(1024))
    (munge / "munge.key").chmod(0o400)
    sock = munge / "munge.sock"
    conf = tmp_path / "slurm.conf"
    ports = Ports()
    conf.write_text(slurm_conf(tmp_path, node, sock, ports))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[ManagedProcess] = []
    try:
        procs.append(
            ManagedProcess(
                ["munged", "--foreground", "--force", f"--key-file={munge / 'munge.key'}",
                 f"--socket={sock}", f"--pid-file={munge / 'munged.pid'}",
                 f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'seed'}"],
                tmp_path / "munged.out",
            )
        )  # fmt: skip
        wait_for("munged socket", sock.exists, 30, 0.2)
        procs.append(ManagedProcess(["slurmctld", "-D", "-f", str(conf)], tmp_path / "ctld.out"))
        procs.append(
            ManagedProcess(["slurmd", "-D", "-f", str(conf), "-N", node], tmp_path / "slurmd.out")
        )
        wait_for(
            "the Slurm node idle",
            lambda: "idle" in subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True
            ).stdout,
            60,
        )  # fmt: skip
        yield Cluster(tmp_path, env, ports)
    finally:
        left = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True)
        if left.stdout.split():
            subprocess.run(["scancel", *left.stdout.split()], env=env, check=False)
        for p in reversed(procs):
            p.stop()


def processes_with(marker: str) -> list[str]:
    """Processes whose environment holds marker: everything a job of this test started."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes().split(b"\0"):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{proc.name}: {cmd[:120]}")
        except OSError:
            continue
    return found


@pytest.mark.timeout(900)
def test_head_and_cpu_worker_node_run_a_run_and_scancel_leaves_nothing(cluster: Cluster) -> None:
    shared = cluster.base / "shared"
    state = shared / "hsq-state"
    shared.mkdir()
    run = f"slurm-{os.getpid()}"
    free = cluster.ports.block
    prom = free()
    server_base, metrics_base = free(2), free(2)  # servers i use base + i
    common = {"HSQ_SHARED": str(shared), "HSQ_VENV": str(VENV), "HSQ_BIND": "127.0.0.1",
              "HSQ_ADVERTISE": "127.0.0.1"}  # fmt: skip
    # The node has few CPUs: the recipes' #SBATCH sizes are overridden, as users would.
    head = cluster.sbatch(
        "head.sbatch", "--cpus-per-task=1", **common, HSQ_REPO=str(ROOT),
        HSQ_REDIS_PORT=str(free()), HSQ_EXPORTER_PORT=str(free()),
        HSQ_PROMETHEUS_PORT=str(prom),
    )  # fmt: skip
    node = cluster.sbatch(
        "worker-node.sbatch", "--gpus-per-node=0", "--oversubscribe", "--cpus-per-task=1",
        **common, HSQ_RUN=run, HSQ_ENGINE="reference", HSQ_SERVERS="2", HSQ_WAIT_S="300",
        HSQ_SERVER_PORT_BASE=str(server_base), HSQ_METRICS_PORT_BASE=str(metrics_base),
    )  # fmt: skip
    prom_url = f"http://127.0.0.1:{prom}"
    try:
        wait_for("the head's redis-url", (state / "redis-url").exists, 120)
        env = {**os.environ, "REDIS_URL": (state / "redis-url").read_text().strip()}
        dataset = shared / "data.jsonl"
        write_synthetic(dataset, SAMPLES, seed=7, min_len=16, max_len=160)
        sh(HSQ, "enqueue", str(dataset), "--run", run, "--out", str(shared / "out"),
           "--no-progress", env=env)  # fmt: skip

        def status() -> dict[str, object]:
            return run_status(sh(HSQ, "status", "--run", run, "--json", env=env))

        wait_for("every sample done", lambda: status()["done"] == SAMPLES, 420, 3)
        st = status()
        assert st["dead"] == 0 and st["missing"] == 0, st
        assert len(st["workers"]) == 2, st  # type: ignore[arg-type]
        verified = sh(HSQ, "verify", "--run", run, "--deep", "--no-progress", env=env)
        assert f"{SAMPLES}" in verified, verified

        # File-based discovery: the node's target file names both workers, Prometheus
        # scrapes them (and the exporter) and sees every sample they finished.
        def workers_up() -> bool:
            ts = prometheus_targets(prom_url, "hsq-worker")
            return len(ts) == 2 and all(t["health"] == "up" for t in ts)

        wait_for("Prometheus scraping both workers", workers_up, 180, 2)
        for t in prometheus_targets(prom_url, "hsq-worker"):
            assert "targets/workers/" in t["discoveredLabels"]["__meta_filepath"], t
            assert t["labels"]["node"] == socket.gethostname().split(".")[0], t
        wait_for(
            "Prometheus scraping the exporter",
            lambda: [t["health"] for t in prometheus_targets(prom_url, "hsq-exporter")] == ["up"],
            120, 2,
        )  # fmt: skip
        done_query = f'sum(hsq_worker_samples_total{{run="{run}",outcome="done"}})'
        wait_for(
            "Prometheus seeing every sample done",
            lambda: prometheus_value(prom_url, done_query) == SAMPLES,
            120, 2,
        )  # fmt: skip
        run_done = f'hsq_run_samples{{run="{run}",state="done"}}'
        wait_for(  # the exporter is scraped on its own schedule
            "the exporter's figure reaching Prometheus",
            lambda: prometheus_value(prom_url, run_done) == SAMPLES,
            120, 2,
        )  # fmt: skip
    finally:
        logs = sorted(state.glob("logs/*.log")) + sorted(state.glob("nodes/*/.hsq/logs/*.log"))
        print("\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in logs))
        for f in sorted(cluster.base.glob("hsq-*.log")):
            print(f"== {f.name}\n{f.read_text()[-1500:]}")

    # The worker node first (its workers hand back to a live Redis), then the head.
    sh("scancel", node, env=cluster.env)
    wait_for("the worker-node job gone", lambda: not any(node in j for j in cluster.jobs()), 120)
    sh("scancel", head, env=cluster.env)
    wait_for("every job gone", lambda: not cluster.jobs(), 120)
    marker = f"HSQ_SHARED={shared}"
    wait_for("no process of either job left", lambda: not processes_with(marker), 60)
    assert not list(Path("/dev/shm").glob(f"hsq-{run}-*")), "dump dirs left in /dev/shm"
    assert not (state / "redis-url").exists()
    assert not list((state / "prometheus/targets/workers").glob("*.json"))
