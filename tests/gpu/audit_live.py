"""Audit on MoE, live: the samples a worker extracted in batches, sent
again one at a time to the same server, compared with what was stored.

Reported: how many come back bit-identical, how many rows differ at all and how many are
outside the row tolerance, how many token-layer expert choices differ between the batched
and the alone forward (both recorded by the routing proxy), and what hsq's audit says with
the dense row rule and with the MoE allowance (hsq/closeness/moe.py): false alarms on this
correct server, and mix-ups (a stored sample against another sample's alone states of the
same length, what the reference server's `mix` fault produces) that must still be caught.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from hsq.closeness.rule import compare_states, dump_states
from hsq.dump.find import remove_dump, scan_by_rid
from hsq.dump.format import fingerprint
from hsq.dump.read import Expected, read_dump
from hsq.errors import NoDumpError
from hsq.outputs import open_output, output_relpath
from tests.gpu import equality as eq
from tests.gpu.proxy import RoutingProxy
from tests.support.sglang import SGLangServer


def alone_dump(url: str, dump_dir: Path, ids: list[int], rid: str) -> Any:
    r = httpx.post(
        url + "/generate",
        json={"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 0}},
        timeout=120,
    )
    r.raise_for_status()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        mine = scan_by_rid(dump_dir).complete.get(rid, [])
        if mine:
            path = mine[0].path
            try:
                return read_dump(path, Expected(rid, fingerprint(ids), len(ids)))
            finally:
                remove_dump(path)
        time.sleep(0.01)
    raise NoDumpError(f"no dump for {rid}")


def batched_vs_alone(
    phase: Any,
    server: SGLangServer,
    proxy: RoutingProxy | None,
    data: dict[str, list[int]],
    out_dir: Path,
) -> dict[str, Any]:
    assert server.dump_dir is not None
    by_len: dict[int, list[str]] = {}
    for sid, ids in data.items():
        by_len.setdefault(len(ids), []).append(sid)
    pairs = [v[:2] for v in by_len.values() if len(v) >= 2]
    chosen = sorted(data)[: phase.live.audit_samples]
    chosen += [s for p in pairs for s in p if s not in chosen]
    dist = eq.Distribution("batched_vs_alone")
    identical = rows_differ = rows_outside = 0
    routing_diff_tokens = routing_tokens = 0
    strict_alarms: list[str] = []
    moe_alarms: list[str] = []
    moe_notes: list[str] = []
    alone: dict[str, Any] = {}
    for sid in chosen:
        ids = data[sid]
        rid = f"hsq-alone-{sid}-{secrets.token_hex(3)}"
        dump = alone_dump(proxy.url if proxy else server.url, server.dump_dir, ids, rid)
        alone[sid] = dump
        stored = open_output(out_dir / output_relpath(sid))
        got = eq.stored_tensors(stored)
        fresh = {eq.AUX: dump.aux_hidden_states, eq.LAST_NAME: dump.last_hidden_state}
        exact = all(bool((got[k].float() == fresh[k].float()).all()) for k in fresh)
        identical += exact
        c = eq.compare(got, fresh)
        dist.add(c)
        rows_outside += c.bad_rows
        rows_differ += sum(1 for x in c.cosines if x < 1.0)
        batched = [r for r in proxy.for_input(ids) if r.rid != rid] if proxy else []
        if proxy is not None and batched and rid in proxy.by_rid:
            a, b = proxy.by_rid[rid].experts, batched[-1].experts
            sa, sb = np.sort(a, axis=-1), np.sort(b, axis=-1)
            differ = (sa != sb).any(axis=-1)  # [T, layers]: another expert set
            routing_diff_tokens += int(differ.sum())
            routing_tokens += int(differ.size)
        arch = dump.meta.model.architecture
        v_strict = compare_states(stored, ids, dump_states(dump))
        v_moe = compare_states(stored, ids, dump_states(dump), architecture=arch)
        if not v_strict.ok:
            strict_alarms.append(f"{sid}: {v_strict.detail}")
        if not v_moe.ok:
            moe_alarms.append(f"{sid}: {v_moe.detail}")
        elif ";" in v_moe.detail:
            moe_notes.append(f"{sid}: {v_moe.detail}")
    mixes, caught = 0, 0
    mix_dist = eq.Distribution("mixed_pair")
    for a_sid, b_sid in pairs:
        stored = open_output(out_dir / output_relpath(a_sid))
        dump = alone[b_sid]
        mixes += 1
        v = compare_states(
            stored, data[a_sid], dump_states(dump), architecture=dump.meta.model.architecture
        )
        caught += not v.ok
        mix_dist.add(
            eq.compare(
                eq.stored_tensors(stored),
                {eq.AUX: dump.aux_hidden_states, eq.LAST_NAME: dump.last_hidden_state},
            )
        )
    return {
        "samples": len(chosen),
        "bit_identical": identical,
        "rows_not_identical": rows_differ,
        "rows_outside_row_tolerance": rows_outside,
        "routing_token_layers": routing_tokens,
        "routing_token_layers_differing": routing_diff_tokens,
        "false_alarms_row_rule": len(strict_alarms),
        "false_alarms_moe_rule": len(moe_alarms),
        "row_rule_alarm_examples": strict_alarms[:5],
        "moe_rule_alarm_examples": moe_alarms[:5],
        "moe_allowance_used": moe_notes[:5],
        "mixed_pairs": mixes,
        "mixed_pairs_caught_moe_rule": caught,
        "distribution": dist.summary(),
        "mixed_distribution": mix_dist.summary(),
    }
