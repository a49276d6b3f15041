"""Monitoring: a real Prometheus scrapes a live run; the dashboard, rules and compose agree."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from hsq.node.procs import ManagedProcess, exporter_process, free_port, wait_http_ok
from hsq.producer.synthetic import write_synthetic
from tests.helpers import enqueue, hsq, spawn_worker, store, wait_until
from tests.support.procs import ReferenceServer

ROOT = Path(__file__).resolve().parents[1]
PROM = ROOT / "deploy" / "prometheus"
Factory = Callable[..., ReferenceServer]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: `make setup` installs Debian's prometheus package")
        pytest.skip(f"{name} not installed (make setup installs it)")
    return path


def test_promtool_checks_config_and_rules() -> None:
    promtool = _tool("promtool")
    subprocess.run(
        [promtool, "check", "config", str(PROM / "prometheus.yml")], check=True, capture_output=True
    )
    out = subprocess.run(
        [promtool, "check", "rules", str(PROM / "alerts.yml")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "9 rules found" in out
    # The alerts' logic on synthetic series (the stuck-trainer alert of a streamed run).
    test = subprocess.run(
        [promtool, "test", "rules", str(PROM / "alerts_test.yml")], capture_output=True, text=True
    )
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def test_dashboard_json_is_generated_from_the_builder() -> None:
    sys.path.insert(0, str(ROOT / "deploy" / "grafana"))
    try:
        import build_dashboard
    finally:
        sys.path.pop(0)
    assert (ROOT / "deploy/grafana/dashboards/hsq.json").read_text() == build_dashboard.render()


def test_dashboard_imports_anywhere_and_its_table_is_one_table() -> None:
    """Every panel named the provisioned datasource uid `hsq-prometheus`,
    so the JSON imported into another Grafana broke every panel; and the worker table's
    queries were separate frames (Grafana showed a frame picker, not one table)."""
    dash = json.loads((ROOT / "deploy/grafana/dashboards/hsq.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert "hsq-prometheus" not in json.dumps(dash)
    chosen = {"type": "prometheus", "uid": "${datasource}"}
    assert variables["run"]["datasource"] == chosen
    for p in dash["panels"]:
        assert p["datasource"] == chosen, p["title"]
        assert all(t["datasource"] == chosen for t in p["targets"]), p["title"]
    (table,) = [p for p in dash["panels"] if p["title"] == "Workers and servers"]
    assert len(table["targets"]) > 1
    kinds = [t["id"] for t in table.get("transformations", [])]
    assert "merge" in kinds or "joinByField" in kinds, kinds
    # Merged rows are per worker: every query of the table keeps the worker label.
    assert all("by (worker" in t["expr"] for t in table["targets"]), table["targets"]


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((ROOT / "deploy/grafana/dashboards/hsq.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_compose_references_exist_and_agree_with_the_code() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services: dict[str, Any] = compose["services"]
    assert {"redis", "prometheus", "grafana", "exporter"} <= set(services)
    redis_cmd = " ".join(services["redis"]["command"])
    # requirepass in a config file written from the environment: never on a command line
    assert "--appendonly yes" in redis_cmd and "requirepass" in redis_cmd
    declared = set(compose["volumes"])
    servers = {n: s for n, s in services.items() if n.startswith("reference-")}
    workers = {n: s for n, s in services.items() if s.get("command", [None, None])[1] == "worker"}
    assert servers and len(servers) == len(workers)
    for name, svc in services.items():
        if "build" in svc:
            build = svc["build"] if isinstance(svc["build"], dict) else {"context": svc["build"]}
            assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).exists(), name
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name}: {src}"
            elif not src.startswith("$"):
                assert src in declared, f"{name}: volume {src} not declared"
        cmd = svc.get("command")
        if isinstance(cmd, list) and cmd[0] == "hsq":
            help_text = hsq(cmd[1], "--help", check=True).stdout
            for flag in (c for c in cmd if c.startswith("--")):
                assert flag in help_text, f"{name}: `hsq {cmd[1]}` has no {flag}"
    node = services["node"]  # the gpu profile: `hsq run`, worker i's metrics on PORT + i
    assert node["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    base = int(node["command"][node["command"].index("--metrics-port") + 1])
    gpu_targets = json.loads((PROM / "targets/workers/compose.json").read_text())[0]["targets"]
    assert gpu_targets == [f"node:{base + i}" for i in range(8)]  # 8 GPUs at TP 1
    worker_targets = json.loads((PROM / "targets/workers/compose-cpu.json").read_text())[0][
        "targets"
    ]
    for name, svc in workers.items():
        cmd = svc["command"]
        server = cmd[cmd.index("--server") + 1]
        host, port = server.removeprefix("http://").split(":")
        assert host in servers
        assert f"--port {port}" in " ".join(servers[host]["command"])
        dump = cmd[cmd.index("--dump-dir") + 1]
        shared = {v.split(":")[0] for v in svc["volumes"] if v.split(":")[1] == dump}
        assert shared and shared <= {v.split(":")[0] for v in servers[host]["volumes"]}, name
        assert f"{name}:{cmd[cmd.index('--metrics-port') + 1]}" in worker_targets
    exporter_cmd = services["exporter"]["command"]
    exporter_targets = json.loads((PROM / "targets/exporter/compose.json").read_text())
    assert (
        f"exporter:{exporter_cmd[exporter_cmd.index('--metrics-port') + 1]}"
        in exporter_targets[0]["targets"]
    )
    grafana_vols = " ".join(services["grafana"]["volumes"])
    assert (
        "deploy/grafana/provisioning" in grafana_vols
        and "deploy/grafana/dashboards" in grafana_vols
    )


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[int, int], str]]:
    """Start a real Prometheus from the repo's config, pointed at local targets."""
    binary = _tool("prometheus")
    procs: list[ManagedProcess] = []

    def start(worker_port: int, exporter_port: int) -> str:
        cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
        cfg["global"]["scrape_interval"] = "1s"
        cfg["global"]["evaluation_interval"] = "1s"
        for job in cfg["scrape_configs"]:
            job["file_sd_configs"][0]["refresh_interval"] = "1s"
        conf = tmp_path / "prom"
        for sub in ("targets/workers", "targets/exporter"):
            (conf / sub).mkdir(parents=True)
        (conf / "targets/workers/local.json").write_text(
            json.dumps([{"targets": [f"127.0.0.1:{worker_port}"]}])
        )
        (conf / "targets/exporter/local.json").write_text(
            json.dumps([{"targets": [f"127.0.0.1:{exporter_port}"]}])
        )
        shutil.copy(PROM / "alerts.yml", conf / "alerts.yml")
        (conf / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        port = free_port()
        proc = ManagedProcess(
            [
                binary,
                f"--config.file={conf / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            tmp_path / "prom.log",
        )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(url + "/-/ready", proc, timeout=60)
        return url

    yield start
    for p in procs:
        p.stop()


def query(prom: str, expr: str) -> list[Any]:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]  # type: ignore[no-any-return]


def test_real_prometheus_scrapes_a_live_run_and_every_panel_has_data(
    tmp_path: Path, server_factory: Factory, redis_url: str, prometheus: Callable[[int, int], str]
) -> None:
    srv = server_factory(name="monsrv").wait_ready()
    rules = [{"mode": "stale", "times": 2}, {"mode": "slow", "seconds": 0.15, "prob": 0.5}]
    httpx.post(srv.url + "/admin/faults", json={"rules": rules}).raise_for_status()
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 80, seed=4, min_len=4, max_len=64)
    # Streamed (a budget it never fills), so the stream's panels have data too.
    enqueue(ds, "mon", tmp_path / "out", redis_url, "--chunk-size", "4", "--spool-budget", "1G")
    wport, eport = free_port(), free_port()
    prom = prometheus(wport, eport)  # first, so it scrapes the whole run
    worker = spawn_worker(
        "mon",
        srv.url,
        srv.dump_dir,
        redis_url,
        tmp_path / "worker.log",
        "--name",
        "mon-w",
        "--metrics-port",
        str(wport),
        "--metrics-host",
        "127.0.0.1",
        "--dump-timeout",
        "3",  # stale dumps are caught at the request's timeout: keep the run short
    )
    exporter = exporter_process(redis_url, eport, tmp_path / "exporter.log")
    try:
        wait_http_ok(f"http://127.0.0.1:{eport}/metrics", exporter, timeout=60)
        wait_http_ok(f"http://127.0.0.1:{wport}/metrics", worker, timeout=60)
        st = store(redis_url, "mon")
        wait_until(lambda: st.count(st.keys.done) == 80, 120)
        # Mid-run and final values reached Prometheus.
        wait_until(lambda: bool(query(prom, 'hsq_run_samples{state="done"} == 80')), 30)
        promtool = _tool("promtool")
        for port in (wport, eport):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            lint = subprocess.run(
                [promtool, "check", "metrics"], input=text, text=True, capture_output=True
            )
            assert lint.returncode == 0, lint.stdout + lint.stderr

        def empty_panels() -> list[str]:
            empty = []
            for title, expr in dashboard_queries():
                q = expr.replace("$__rate_interval", "30s").replace('run=~"$run"', 'run=~".*"')
                assert "$" not in q, q
                if not query(prom, q):
                    empty.append(f"{title}: {q}")
            return empty

        # A rate needs two scrapes of the worker, which file-based discovery may find only
        # seconds into a short run: the worker stays up, so wait for them.
        try:
            wait_until(lambda: not empty_panels(), 45, interval=1.0)
        except AssertionError:
            raise AssertionError("panels without data:\n" + "\n".join(empty_panels())) from None
        up = query(prom, 'up{job="hsq-worker"} == 1')
        assert up and query(prom, 'up{job="hsq-exporter"} == 1')
        assert query(prom, 'hsq_worker_mismatches_total{reason="stale_dump"} >= 1')
        rules_api = httpx.get(prom + "/api/v1/rules").json()["data"]["groups"][0]["rules"]
        assert {r["name"] for r in rules_api} >= {
            "HsqQueueNotDraining", "HsqWorkerDown", "HsqStreamTrainerStuck"
        }  # fmt: skip
        assert all(r["health"] == "ok" for r in rules_api), rules_api
        # Labels stay low-cardinality: no sample ids anywhere.
        names = httpx.get(prom + "/api/v1/labels").json()["data"]
        assert not [n for n in names if re.search("sample", n)]
    finally:
        worker.stop()
        exporter.stop()
