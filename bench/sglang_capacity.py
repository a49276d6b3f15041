"""SGLang's prefill capacity on a GPU, without the hook, with it, and hsq end to end.

The 8B shape (Llama-3-8B's config, --load-format dummy: no weights to write or send),
short (64-512 tokens) and long (1024-4096) prompts, each row lasting about 30 s or more
(shorter rows read to +-5 %); SGLang alone at each K given (two by default, to show where
it saturates), the hook and hsq end to end at the K where SGLang alone was fastest; optionally
hsq's reference server on the same workloads. Runs on the GPU machine through
scripts/sglang_live.sh (BENCHMARKS.md section 8):

    bash scripts/sglang_live.sh --exec python3 -m bench.sglang_capacity --json $OUT/cap.json

Without the hook the plugin is installed but inactive (no SGLANG_HS_DUMP_DIR). With it the
dumps are removed as they complete (what a worker does, minus its work), so the hook's own
cost is measured without the dump dir filling tmpfs; then `hsq worker --burst` extracts
the same prompts for real.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from hsq.node.procs import RedisServer, ReferenceServer, hsq_command
from tests.support.sglang import SGLANG_FLAGS, SGLangServer


def write_8b_config(path: Path) -> Path:
    """Llama-3-8B's shape, config only (served with --load-format dummy)."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, bos_token_id=128000,
        eos_token_id=128001, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"], dtype="bfloat16",
    ).save_pretrained(path)  # fmt: skip
    return path


async def _load(url: str, seqs: list[list[int]], k: int) -> float:
    """Seconds to prefill `seqs` with `k` in flight (after a warm-up of `k` of them)."""
    sem = asyncio.Semaphore(k)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=k + 4)) as c:

        async def one(i: int, ids: list[int]) -> None:
            async with sem:
                r = await c.post(url + "/generate", json={
                    "input_ids": ids, "rid": f"hsq-cap-{i}-{os.urandom(4).hex()}",
                    "sampling_params": {"max_new_tokens": 0},
                })  # fmt: skip
                r.raise_for_status()

        await asyncio.gather(*(one(i, s) for i, s in enumerate(seqs[: min(k, len(seqs))])))
        t = time.perf_counter()
        await asyncio.gather(*(one(i, s) for i, s in enumerate(seqs)))
        return time.perf_counter() - t


@contextmanager
def dump_sweeper(dump_dir: Path) -> Iterator[None]:
    """Remove finished dumps as they appear."""
    stop = threading.Event()

    def sweep() -> None:
        while not stop.is_set():
            for d in dump_dir.glob("req_*"):
                if (d / "done").exists():
                    shutil.rmtree(d, ignore_errors=True)
            time.sleep(0.01)

    with ThreadPoolExecutor(1, thread_name_prefix="dump-sweep") as pool:
        pool.submit(sweep)
        try:
            yield
        finally:
            stop.set()  # the pool's exit joins the sweep


def steady_rate(log: Path) -> dict[str, float]:
    """Tokens between the first and the last sample_done of a worker's JSON log."""
    ev = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "sample_done":
            ev.append(rec)
    if len(ev) < 3:
        return {}
    ts = [
        datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp() for e in ev
    ]
    span = max(ts) - min(ts)
    toks = sum(int(e["tokens"]) for e in ev[1:])
    return {"samples": len(ev), "tok_s": round(toks / span), "span_s": round(span, 2),
            "gb_s": round(sum(int(e["bytes"]) for e in ev[1:]) / span / 1e9, 3)}  # fmt: skip


class Capacity:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = Path(a.work or tempfile.mkdtemp(prefix="hsq-cap-"))
        self.out = Path(a.out) if a.out else self.work / "out"
        self.dump_root = Path(a.dump_root) if a.dump_root else self.work
        rng = random.Random(5)
        lens = {
            "short": ([rng.randint(64, 512) for _ in range(a.short)], a.k_short),
            "long": ([rng.randint(1024, 4096) for _ in range(a.long)], a.k_long),
        }
        lens = {w: v for w, v in lens.items() if w in a.workloads.split(",")}
        self.ks: dict[str, list[int]] = {w: k for w, (_, k) in lens.items()}
        # The hook and hsq run at the K where SGLang alone was fastest (set by measure_plain).
        self.workloads = {w: k[-1] for w, k in self.ks.items()}
        self.seqs = {
            w: [[1] + [rng.randrange(3, 128000) for _ in range(n - 1)] for n in ls]
            for w, (ls, _) in lens.items()
        }
        self.res: dict[str, Any] = {w: {} for w in lens}

    def save(self) -> None:
        """The figures so far (a run cut short by its time limit keeps its rows)."""
        if self.a.json:
            Path(self.a.json).write_text(json.dumps(self.res, indent=1))

    def _row(self, url: str, w: str, k: int) -> dict[str, Any]:
        secs = asyncio.run(_load(url, self.seqs[w], k))
        toks = sum(map(len, self.seqs[w]))
        return {"tok_s": round(toks / secs), "k": k, "seconds": round(secs, 1),
                "samples_s": round(len(self.seqs[w]) / secs, 1)}  # fmt: skip

    def measure_plain(self, url: str) -> None:
        """SGLang alone at every K; the fastest K is the one the hook and hsq get."""
        for w, ks in self.ks.items():
            rows = [self._row(url, w, k) for k in ks]
            for r in rows:
                print(f"[capacity] sglang_no_hook {w}: {r['tok_s']:,} tok/s (K={r['k']}, "
                      f"{r['seconds']} s)", flush=True)  # fmt: skip
            best = max(rows, key=lambda r: r["tok_s"])
            self.workloads[w] = best["k"]
            self.res[w]["sglang_no_hook"] = best
            self.res[w]["sglang_no_hook_by_k"] = rows
            self.save()

    def measure(self, label: str, url: str) -> None:
        for w, k in self.workloads.items():
            self.res[w][label] = r = self._row(url, w, k)
            print(f"[capacity] {label} {w}: {r['tok_s']:,} tok/s (K={k}, {r['seconds']} s)",
                  flush=True)  # fmt: skip
            self.save()

    def end_to_end(self, server: SGLangServer, redis: RedisServer) -> None:
        assert server.dump_dir is not None
        for w, k in self.workloads.items():
            ds = self.work / f"cap-{w}.jsonl"
            with open(ds, "w") as f:
                for i, ids in enumerate(self.seqs[w]):
                    f.write(json.dumps({"id": f"c{w[0]}{i:05d}", "input_ids": ids}) + "\n")
            run = f"cap-{w}"
            dtype = ["--store-dtype", "fp8-e4m3"] if self.a.dump_encoding != "plain" else []
            r = subprocess.run(hsq_command("enqueue", str(ds), "--run", run, "--out",
                               str(self.out), "--redis", redis.url, "--no-progress", *dtype),
                               capture_output=True, text=True)  # fmt: skip
            if r.returncode:
                raise RuntimeError(r.stderr)
            wlog = self.work / f"cap-worker-{w}.log"
            t = time.monotonic()
            argv = hsq_command(
                "--log-format", "json", "worker", "--run", run, "--server", server.url,
                "--dump-dir", str(server.dump_dir), "--inflight", str(k), "--burst",
            )  # fmt: skip
            with open(wlog, "w") as wf:
                env = {**os.environ, "HSQ_REDIS_URL": redis.url}
                code = subprocess.run(argv, stdout=wf, stderr=subprocess.STDOUT, env=env,
                                      timeout=600).returncode  # fmt: skip
            rate = {**steady_rate(wlog), "wall_s": round(time.monotonic() - t, 1), "exit": code}
            self.res[w]["hsq"] = rate
            print(f"[capacity] hsq {w}: {rate}", flush=True)
            self.save()
            shutil.rmtree(self.out / run, ignore_errors=True)

    def run(self) -> dict[str, Any]:
        a = self.a
        model = write_8b_config(self.work / "llama8b-dummy")
        flags = [*SGLANG_FLAGS, "--load-format", "dummy", "--mem-fraction-static", "0.6",
                 "--chunked-prefill-size", "8192", "--max-running-requests", "128"]  # fmt: skip
        plain = SGLangServer(model, self.work / "cap-nohook.log", dump_dir=None, flags=flags,
                             tp=a.tp, start_timeout=a.start_timeout)  # fmt: skip
        if not a.hook_only:  # --hook-only: hook and hsq at the last K given, nothing alone
            try:
                plain.start()
                self.measure_plain(plain.url)
            finally:
                plain.stop()
        dump = self.dump_root / f"hsq-cap-{os.getpid()}"
        shutil.rmtree(dump, ignore_errors=True)
        # --dump-encoding fp8-e4m3: the hook quantizes on the GPU (half the bytes a token).
        env = {"SGLANG_HS_DUMP_ENCODING": a.dump_encoding}
        hooked = SGLangServer(model, self.work / "cap-hook.log", dump_dir=dump,
                              layers="1,15,28", flags=flags, tp=a.tp, env=env,
                              start_timeout=a.start_timeout)  # fmt: skip
        redis = RedisServer(self.work / "redis").wait_ready()
        try:
            hooked.start()
            with dump_sweeper(dump):
                self.measure("sglang_hook", hooked.url)
            self.end_to_end(hooked, redis)
        finally:
            hooked.stop()
            redis.stop()
        for r in self.res.values():
            if "sglang_no_hook" in r:
                r["hook_over_no_hook"] = round(
                    r["sglang_hook"]["tok_s"] / r["sglang_no_hook"]["tok_s"], 3
                )
            if r.get("hsq", {}).get("tok_s"):
                r["hsq_over_hook"] = round(r["hsq"]["tok_s"] / r["sglang_hook"]["tok_s"], 3)
        if a.reference:
            self.reference()
        return self.res

    def reference(self) -> None:
        """hsq's reference server on the same workloads (its own 8B-shape random model)."""
        ref = ReferenceServer(self.dump_root / f"hsq-cap-ref-{os.getpid()}",
                              self.work / "cap-ref.log", args=["--model", "llama-8b",
                              "--device", "cuda", "--layers", "2,16,29", "--no-fsync",
                              "--max-batch-requests", "16", "--warmup-shapes"])  # fmt: skip
        try:
            ref.wait_ready(self.a.start_timeout)
            with dump_sweeper(ref.dump_dir):
                self.measure("reference", ref.url)
        finally:
            ref.stop()
        for r in self.res.values():
            r["reference_over_sglang"] = round(
                r["reference"]["tok_s"] / r["sglang_no_hook"]["tok_s"], 3
            )


def _ks(text: str) -> list[int]:
    ks = [int(x) for x in text.split(",") if x.strip()]
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of K >= 1")
    return ks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=None, help="scratch folder (default: a new temporary one)")
    p.add_argument("--out", default=None, help="hsq's outputs (default: WORK/out)")
    p.add_argument("--dump-root", default=None, help="where dump dirs go (e.g. /dev/shm)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--short", type=int, default=4000, help="short prompts (~30 s a row)")
    p.add_argument("--long", type=int, default=450, help="long prompts (~30 s a row)")
    p.add_argument("--k-short", type=_ks, default=[32, 64], help="K values, comma list")
    p.add_argument("--k-long", type=_ks, default=[8, 16], help="K values, comma list")
    p.add_argument("--reference", action="store_true", help="also the reference server")
    p.add_argument("--workloads", default="short,long", help="short, long (comma list)")
    p.add_argument(
        "--hook-only",
        action="store_true",
        help="skip SGLang without the hook: the hook and hsq at the last K given",
    )
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument(
        "--dump-encoding",
        default="plain",
        choices=("plain", "fp8-e4m3"),
        help="the hooked server's dumps (fp8-e4m3: server-made fp8, a run stored as fp8)",
    )
    a = p.parse_args()
    if a.tp < 1:
        p.error("--tp must be >= 1")
    res = Capacity(a).run()
    text = json.dumps(res, indent=1)
    if a.json:
        Path(a.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
