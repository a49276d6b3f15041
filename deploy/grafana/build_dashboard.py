"""Generates dashboards/hsq.json: edit the panels here, run it, commit both.

    python deploy/grafana/build_dashboard.py
tests/test_monitoring.py checks that the JSON is current and that every query returns data
from a real Prometheus scraping a live run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

R = 'run=~"$run"'
RI = "$__rate_interval"
# The datasource is a dashboard variable, not a fixed uid: the JSON then works both when
# provisioned (the variable picks the default Prometheus, deploy/grafana/provisioning) and
# when imported into another Grafana. File provisioning does not resolve `__inputs`.
DS = {"type": "prometheus", "uid": "${datasource}"}

PANELS: list[dict[str, Any]] = [
    {
        "title": "Queue depth (jobs)",
        "unit": "short",
        "targets": {"{{run}} {{queue}}": f"sum by (run, queue) (hsq_queue_jobs{{{R}}})"},
    },
    {
        "title": "Samples remaining / dead",
        "unit": "short",
        "targets": {
            "{{run}} remaining": f'sum by (run) (hsq_run_samples{{{R}, state="remaining"}})',
            "{{run}} dead": f'sum by (run) (hsq_run_samples{{{R}, state="dead"}})',
        },
    },
    {
        "title": "ETA",
        "type": "stat",
        "unit": "s",
        "targets": {
            "{{run}}": f'(sum by (run) (hsq_run_tokens{{{R}, state="total"}})'
            f' - sum by (run) (hsq_run_tokens{{{R}, state="done"}}))'
            f" / sum by (run) (rate(hsq_worker_tokens_total{{{R}}}[10m]))"
        },
    },
    {
        "title": "Throughput (samples/s)",
        "unit": "short",
        "targets": {
            "{{worker}}": f"sum by (worker) (rate(hsq_worker_samples_total{{{R}, "
            f'outcome="done"}}[{RI}]))',
            "total": f'sum(rate(hsq_worker_samples_total{{{R}, outcome="done"}}[{RI}]))',
        },
    },
    {
        "title": "Throughput (tokens/s)",
        "unit": "short",
        "targets": {
            "{{worker}}": f"sum by (worker) (rate(hsq_worker_tokens_total{{{R}}}[{RI}]))",
            "total": f"sum(rate(hsq_worker_tokens_total{{{R}}}[{RI}]))",
        },
    },
    {
        "title": "Output write rate",
        "unit": "Bps",
        "targets": {
            "{{worker}}": f"sum by (worker) (rate(hsq_worker_written_bytes_total{{{R}}}[{RI}]))",
            "total": f"sum(rate(hsq_worker_written_bytes_total{{{R}}}[{RI}]))",
        },
    },
    {
        "title": "Failures by reason (per s)",
        "unit": "short",
        "targets": {
            "{{reason}}": f"sum by (reason) (rate(hsq_worker_mismatches_total{{{R}}}[{RI}]))"
        },
    },
    {
        "title": "Phase latency p50 / p95 / p99",
        "unit": "s",
        "targets": {
            f"{{{{phase}}}} p{q}": f"histogram_quantile(0.{q}, sum by (le, phase) "
            f"(rate(hsq_worker_phase_seconds_bucket{{{R}}}[{RI}])))"
            for q in (50, 95, 99)
        },
    },
    {
        "title": "Workers and servers",
        "type": "table",
        "unit": "short",
        "targets": {
            "server up": f"max by (worker) (hsq_worker_server_up{{{R}}})",
            "state": f"max by (worker, state) (hsq_worker_state{{{R}}}) == 1",
            "in flight": f"max by (worker) (hsq_worker_in_flight_samples{{{R}}})",
            "seconds since last sample": f"time() - max by (worker) "
            f"(hsq_worker_last_success_timestamp_seconds{{{R}}})",
        },
        # One row per worker: the instant frames merged on their common `worker` field,
        # the per-query value columns named after their query, the timestamp hidden.
        "transformations": [
            {"id": "merge", "options": {}},
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True},
                    "renameByName": {
                        f"Value #{chr(ord('A') + j)}": name
                        for j, name in enumerate(
                            ["server up", "state", "in flight", "seconds since last sample"]
                        )
                    },
                },
            },
        ],
    },
    {
        # Per scrape target (it has no worker label, so it is not merged into the table
        # above): a worker that is down shows 0 here while its own metrics go stale.
        "title": "Worker scrape targets",
        "type": "table",
        "unit": "short",
        "targets": {"scraped": 'up{job="hsq-worker"}'},
    },
    {
        "title": "Output filesystem free",
        "unit": "bytes",
        "targets": {"{{worker}}": f"min by (worker) (hsq_worker_output_free_bytes{{{R}}})"},
    },
    # A streamed run (--spool-budget): docs/training.md, "Train while extracting".
    {
        "title": "Stream: spool against its budget",
        "unit": "bytes",
        "targets": {
            "{{run}} spool": f"sum by (run) (hsq_spool_bytes{{{R}}})",
            "{{run}} budget": f"sum by (run) (hsq_spool_budget_bytes{{{R}}})",
        },
    },
    {
        "title": "Stream: entries per group (delivered / committed / pending)",
        "unit": "short",
        "targets": {
            "{{run}} {{group}} {{state}}": f"sum by (run, group, state) "
            f'(hsq_stream_group_entries{{{R}, state=~"delivered|committed|pending"}})'
        },
    },
    {
        "title": "Stream: oldest pending entry (a trainer not committing)",
        "unit": "s",
        "targets": {
            "{{run}} {{group}}": f"max by (run, group) "
            f"(hsq_stream_group_oldest_pending_seconds{{{R}}})"
        },
    },
    {
        "title": "Stream: producer paused share / trainer data-wait share",
        "unit": "percentunit",
        "targets": {
            # Seconds held back per second, over the live workers (the producer's
            # paused share; high: the trainers are the limit).
            "{{run}} producer paused": f"sum by (run) (deriv(hsq_spool_paused_seconds{{{R}}}"
            f"[5m])) / clamp_min(sum by (run) (hsq_run_workers{{{R}}}), 1)",
            # As of each trainer's last commit (high: extraction is the limit).
            "{{run}} {{group}} data wait": f"max by (run, group) "
            f"(hsq_stream_group_data_wait_ratio{{{R}}})",
        },
    },
]


def layout(specs: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Half-width panels two to a row, a table a full row of its own (no overlaps)."""
    out, x, y = [], 0, 0
    for spec in specs:
        width = 24 if spec.get("type") == "table" else 12
        if x + width > 24:
            x, y = 0, y + 8
        out.append({"h": 8, "w": width, "x": x, "y": y})
        x += width
    return out


def panel(i: int, spec: dict[str, Any], pos: dict[str, int]) -> dict[str, Any]:
    kind = spec.get("type", "timeseries")
    return {
        "id": i + 1,
        "type": kind,
        "title": spec["title"],
        "datasource": DS,
        "gridPos": pos,
        "fieldConfig": {"defaults": {"unit": spec["unit"]}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + j),
                "expr": expr,
                "legendFormat": legend,
                "datasource": DS,
                **({"instant": True, "format": "table"} if kind == "table" else {}),
            }
            for j, (legend, expr) in enumerate(spec["targets"].items())
        ],
        **({"transformations": spec["transformations"]} if "transformations" in spec else {}),
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": "hsq-overview",
        "title": "hsq: hidden-state extraction",
        "tags": ["hsq"],
        "timezone": "utc",
        "schemaVersion": 39,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "refresh": 1,
                    "regex": "",
                    "hide": 0,
                },
                {
                    "name": "run",
                    "label": "run",
                    "type": "query",
                    "multi": True,
                    "includeAll": True,
                    "allValue": ".*",
                    "datasource": DS,
                    "query": {"query": "label_values(hsq_run_samples, run)", "refId": "runs"},
                    "refresh": 2,
                },
            ]
        },
        "panels": [
            panel(i, p, pos) for i, (p, pos) in enumerate(zip(PANELS, layout(PANELS), strict=True))
        ],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    out = Path(__file__).parent / "dashboards" / "hsq.json"
    out.write_text(render())
    print(f"wrote {out}")
