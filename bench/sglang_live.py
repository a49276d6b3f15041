"""hsq against a live SGLang server (issue 21): correctness, restarts, refusals, capacity.

Run on a GPU machine through scripts/sglang_live.sh (it installs the offline bundle that
scripts/sglang_wheelhouse.sh builds, and hsq itself, then calls this):

    bash scripts/sglang_live.sh --phases refusals,extract,capacity --json $OUT/live.json

Phases (each records its figures in the JSON; a failing phase is recorded and the next runs):
  refusals  settings the launcher judges from its own command line exit 2 before anything
            starts; settings only the plugin can judge (radix cache on, a layer id past the
            model) stop a stock `sglang.launch_server` at start with hsq's message.
  extract   a random-weight Llama written by transformers, served through `hsq launch-sglang`
            (plugin via its entry point, readiness marker): `hsq enqueue` + `hsq worker
            --inflight K` extract samples of mixed lengths (some longer than
            --chunked-prefill-size, many batched together); SGLang is SIGKILLed mid-run and
            started again; then every sample is done once, none dead, `hsq verify --deep`
            passes, and every state equals a transformers forward of the same checkpoint.
  deepseek  the same extraction and comparison on a tiny random DeepSeek-V3 (MLA + MoE).
  capacity  8B shape, --load-format dummy: SGLang's prefill rate without the hook, with the
            hook, and hsq end to end, for short and long samples; the reference server's.

`--server reference` runs extract with hsq's reference server instead of SGLang (CPU), to
test this script itself where there is no GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from hsq.harness.procs import RedisServer, free_port, hsq_command

SGLANG_FLAGS = [
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--skip-tokenizer-init",
    "--cuda-graph-backend-decode",
    "disabled",
    "--log-level",
    "info",
]
RESULTS: dict[str, Any] = {}
START_TIMEOUT = 400.0


def say(msg: str) -> None:
    print(f"[live +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


T0 = time.monotonic()


# ---------------------------------------------------------------------------- processes


class Proc:
    """A child in its own process group (SGLang forks schedulers), logging to a file."""

    def __init__(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None):
        self.argv, self.log = list(argv), log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            self.p = subprocess.Popen(
                self.argv,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.p.poll() is None

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, sig)

    def stop(self, timeout: float = 30) -> None:
        if self.alive():
            self.kill_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.p.wait(timeout)
        self.kill_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(10)

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-n:])


def hsq(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        hsq_command("--log-format", "json", *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def wait_for(
    pred: Callable[[], bool],
    timeout: float,
    what: str,
    proc: Proc | None = None,
    poll: float = 0.25,
) -> float:
    t = time.monotonic()
    while not pred():
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{what}: {proc.argv[:6]} exited {proc.p.returncode}\n{proc.tail()}")
        if time.monotonic() - t > timeout:
            raise RuntimeError(
                f"{what}: not within {timeout:.0f}s" + (f"\n{proc.tail()}" if proc else "")
            )
        time.sleep(poll)
    return time.monotonic() - t


def low_port() -> int:
    """A free port below 50000: SGLang 0.5.15 derives its gRPC port as port + 10000 and
    refuses one above 65535 (seen live with a random port of 57905)."""
    while True:
        port = free_port()
        if port < 50000:
            return port


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ---------------------------------------------------------------------------- models


def llama_config(**shape: Any) -> Any:
    """A LlamaConfig with the settings every test model here shares, `shape` on top."""
    from transformers import LlamaConfig

    return LlamaConfig(
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],  # a config saved alone has none; SGLang needs it
        **shape,
    )


def write_llama(path: Path, *, layers: int, hidden: int, seed: int, device: str) -> Path:
    """A random-weight Llama saved by transformers (bf16 safetensors, config.json)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).bfloat16()
    model.save_pretrained(path, safe_serialization=True)
    say(f"wrote {path.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params")
    return path


def write_deepseek(path: Path, *, seed: int, device: str) -> Path:
    """A tiny random DeepSeek-V3 (MLA attention, one dense then MoE layers), saved with
    per-expert weight names (what SGLang's DeepseekV2 loader reads)."""
    config = path / "config.json"
    if (path / "model.safetensors").exists() and "architectures" in config.read_text():
        return path
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=768,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        routed_scaling_factor=1.0,
        max_position_embeddings=8192,
        rope_interleave=True,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(cfg).bfloat16()
        # Random routing biases would send every token to the same experts; spread them.
        for mod in model.modules():
            bias = getattr(mod, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.data.zero_()
    path.mkdir(parents=True, exist_ok=True)
    cfg.architectures = ["DeepseekV3ForCausalLM"]  # model.save_pretrained would set it
    cfg.save_pretrained(path)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    # transformers 5 keeps the experts fused ([E, 2I, H] gate_up, [E, H, I] down); SGLang
    # loads DeepSeek's original per-expert names.
    out: dict[str, Any] = {}
    for k, v in state.items():
        fused = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", k)
        if fused is None:
            out[k] = v
            continue
        base = fused.group(1)
        for e in range(v.shape[0]):
            if fused.group(2) == "gate_up_proj":
                gate, up = v[e].chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{base}.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{base}.{e}.down_proj.weight"] = v[e].contiguous()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    say(
        f"wrote {path.name}: {sum(v.numel() for v in out.values()) / 1e6:.0f}M params, "
        f"{len(out)} tensors"
    )
    return path


def write_8b_config(path: Path) -> Path:
    """Llama-3-8B's shape, config only (served with --load-format dummy)."""
    llama_config(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        bos_token_id=128000,
        eos_token_id=128001,
        dtype="bfloat16",
    ).save_pretrained(path)
    return path


class Reference:
    """The states a transformers forward gives for hsq's layer ids (HF hidden_states
    indices: id i is the residual stream entering decoder layer i) and the final norm's
    output, in float32 (the bf16 weights upcast): the truth the served states are held to."""

    def __init__(self, model_dir: Path, layer_ids: Sequence[int], device: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.to(torch.device(device)).eval()  # type: ignore[arg-type]
        self.device, self.ids = device, list(layer_ids)
        self.captured: dict[int | str, Any] = {}
        inner = self.model.model
        for i in self.ids:
            inner.layers[i].register_forward_pre_hook(self._pre(i), with_kwargs=True)
        inner.norm.register_forward_hook(lambda _m, _a, out: self.captured.__setitem__("last", out))
        inner.norm.register_forward_pre_hook(
            lambda _m, args: self.captured.__setitem__("prenorm", args[0])
        )

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            h = args[0] if args else kwargs["hidden_states"]
            self.captured[i] = h

        return hook

    def states(self, input_ids: list[int]) -> tuple[Any, Any, Any]:
        """(aux [T, k*H], final post-norm [T, H], final pre-norm [T, H]) in float32."""
        torch = self.torch
        with torch.inference_mode():
            self.captured.clear()
            self.model.model(torch.tensor([input_ids], device=self.device))
            aux = torch.cat([self.captured[i][0] for i in self.ids], dim=-1)
            last, pre = self.captured["last"][0], self.captured["prenorm"][0]
            return aux.float().cpu(), last.float().cpu(), pre.float().cpu()


def compare_outputs(out_dir: Path, dataset: dict[str, list[int]], ref: Reference) -> dict[str, Any]:
    """Every output against the reference forward: ids exact, per-token closeness of every
    stored state (aux, final post-norm, and the pre-norm final state where stored). An fp8
    output is held to the fresh states quantized the same way (hsq.audit's rule: cosine
    >= 0.999, max |d| <= 10% of the row norm); bf16 to the reference server's rule."""
    from hsq import quant
    from hsq.audit import FP8_MAX_ABS_OF_NORM, MAX_ABS_OF_NORM, MIN_COSINE, closeness
    from hsq.outputs.format import open_output
    from hsq.states import FP8

    worst_cos, worst_err, bad, tokens, ids_wrong = 1.0, 0.0, [], 0, []
    files = sorted(out_dir.rglob("*.safetensors"))
    fmt, with_prenorm = "", False
    for f in files:
        o = open_output(f)
        want_ids = dataset[o.sample_id]
        if o.input_ids.tolist() != want_ids:
            ids_wrong.append(o.sample_id)
            continue
        aux, last, pre = ref.states(want_ids)
        fmt = quant.store_dtype_of(o.metadata)
        pairs = [(o.aux_hidden_states, aux, len(ref.ids)), (o.last_hidden_state, last, 1)]
        stored_pre = getattr(o, "last_hidden_state_prenorm", None)
        if stored_pre is not None:
            with_prenorm = True
            pairs.append((stored_pre, pre, 1))
        bound = FP8_MAX_ABS_OF_NORM if fmt == FP8 else MAX_ABS_OF_NORM
        for got, want, groups in pairs:
            if fmt == FP8:
                q, scale = quant.quantize(want, groups)
                want = quant.dequantize(q, scale)
            c = closeness(got, want)
            worst_cos, worst_err = min(worst_cos, c.min_cosine), max(worst_err, c.max_abs_over_norm)
            if c.min_cosine < MIN_COSINE or c.max_abs_over_norm > bound:
                bad.append((o.sample_id, round(c.min_cosine, 5), round(c.max_abs_over_norm, 5)))
        tokens += o.num_tokens
    return {
        "files": len(files),
        "tokens": tokens,
        "store_dtype": fmt,
        "prenorm_compared": with_prenorm,
        "ids_exact": not ids_wrong,
        "ids_wrong": ids_wrong[:10],
        "min_cosine": round(worst_cos, 6),
        "max_abs_over_norm": round(worst_err, 6),
        "tolerance": f"cosine >= {MIN_COSINE}, max|d| <= "
        f"{FP8_MAX_ABS_OF_NORM if fmt == FP8 else MAX_ABS_OF_NORM} * ||row||",
        "samples_outside_tolerance": len({b[0] for b in bad}),
        "outside_examples": bad[:10],
    }


# ---------------------------------------------------------------------------- servers


class Server:
    """A dumping server the worker uses: SGLang through `hsq launch-sglang`, or hsq's
    reference server."""

    def __init__(
        self,
        kind: str,
        model: Path,
        dump_dir: Path,
        log: Path,
        *,
        layers: str,
        extra: Sequence[str] = (),
        device: str = "cuda",
    ):
        self.kind, self.model, self.dump_dir, self.log = kind, model, dump_dir, log
        self.layers, self.extra, self.device = layers, list(extra), device
        self.port = low_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Proc | None = None
        self.starts = 0

    def argv(self) -> list[str]:
        common = [
            "--dump-dir",
            str(self.dump_dir),
            "--layers",
            self.layers,
            "--port",
            str(self.port),
        ]
        if self.kind == "sglang":
            return hsq_command(
                "launch-sglang",
                "--model-path",
                str(self.model),
                *common,
                "--start-timeout",
                "900",
                *self.extra,
            )
        return hsq_command(
            "serve-reference",
            "--model",
            str(self.model),
            "--device",
            self.device,
            "--no-fsync",
            *common,
            *self.extra,
        )

    def start(self, timeout: float | None = None) -> float:
        timeout = timeout or START_TIMEOUT
        t = time.monotonic()
        self.starts += 1
        proc = self.proc = Proc(self.argv(), self.log)
        wait_for(lambda: healthy(self.url), timeout, f"{self.kind} health", proc)
        if self.kind == "sglang":  # the launcher's own checks passed: it says so
            wait_for(lambda: "serving at" in proc.text(), 120, "launch-sglang checks", proc)
        took = time.monotonic() - t
        say(f"{self.kind} server up in {took:.1f}s (start {self.starts})")
        return took

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill_group(signal.SIGKILL)
        self.proc.p.wait(60)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


# ---------------------------------------------------------------------------- data


def make_dataset(
    path: Path, lengths: Sequence[int], *, vocab: int, seed: int, prefix: str = "s"
) -> dict[str, list[int]]:
    rng = random.Random(seed)
    rows = {
        f"{prefix}{i:05d}": [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]
        for i, n in enumerate(lengths)
    }
    with open(path, "w") as f:
        for sid, ids in rows.items():
            f.write(json.dumps({"id": sid, "input_ids": ids}) + "\n")
    return rows


def lengths_mixed(n: int, seed: int, *, chunk: int) -> list[int]:
    """Mostly chat-length samples (batched together), a fifth past the chunked-prefill size."""
    rng = random.Random(seed)
    out = [rng.randint(16, 512) for _ in range(n - n // 5)]
    out += [rng.randint(chunk + 1, 3 * chunk) for _ in range(n // 5)]
    rng.shuffle(out)
    return out


def status(redis_url: str, run: str) -> dict[str, Any]:
    r = hsq("status", "--run", run, "--redis", redis_url, "--json", timeout=60)
    for line in r.stdout.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("run") == run:
            return obj
    raise RuntimeError(f"hsq status: {r.returncode}\n{r.stdout}\n{r.stderr}")


def done_count(redis_url: str, run: str) -> Callable[[], int]:
    """A cheap poll of the run's done count (one HLEN), for timing the mid-run kill."""
    from hsq.runstore import RunStore
    from hsq.store import connect

    store = RunStore(connect(redis_url), run)
    return lambda: store.count(store.keys.done)


def log_events(path: Path, event: str) -> Iterator[dict[str, Any]]:
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == event:
            yield rec


def steady_rate(log: Path) -> dict[str, float]:
    """Tokens between the first and the last sample_done (the first sample's tokens are
    not counted: the interval starts when it ended)."""
    from datetime import datetime

    ev = list(log_events(log, "sample_done"))
    if len(ev) < 3:
        return {}
    ts = [
        datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp() for e in ev
    ]
    span = max(ts) - min(ts)
    toks = sum(int(e["tokens"]) for e in ev[1:])
    byts = sum(int(e["bytes"]) for e in ev[1:])
    return {
        "samples": len(ev),
        "tok_s": round(toks / span),
        "samples_s": round((len(ev) - 1) / span, 1),
        "gb_s": round(byts / span / 1e9, 3),
        "span_s": round(span, 2),
    }


# ---------------------------------------------------------------------------- phases


def phase_refusals(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """What the launcher refuses before starting, and what the live plugin refuses."""
    model = write_llama(work / "llama", layers=a.layers_n, hidden=a.hidden, seed=0, device="cuda")
    out: dict[str, Any] = {}
    dump = work / "refuse-dump"
    launcher_cases = {
        "chunked_prefill_512": ["--layers", a.layers, "--chunked-prefill-size", "512"],
        "two_batch_overlap": ["--layers", a.layers, "--enable-two-batch-overlap"],
        "layer_past_model": ["--layers", f"1,3,{a.layers_n + 3}"],
        "dp_size_2": ["--layers", a.layers, "--dp-size", "2"],
    }
    for name, extra in launcher_cases.items():
        t = time.monotonic()
        r = hsq(
            "launch-sglang",
            "--model-path",
            str(model),
            "--dump-dir",
            str(dump),
            "--port",
            str(low_port()),
            *extra,
            *SGLANG_FLAGS,
            timeout=300,
        )
        out[name] = {
            "exit": r.returncode,
            "seconds": round(time.monotonic() - t, 1),
            "message": (r.stdout + r.stderr).strip().splitlines()[-1:],
            "refused_before_start": r.returncode == 2 and "serving at" not in r.stdout,
        }
        say(f"launcher refusal {name}: exit {r.returncode} in {out[name]['seconds']}s")
    # Only the plugin sees these: a stock launch_server with the hook's environment.
    plugin_cases = {
        "radix_cache_on": ({"SGLANG_HS_LAYER_IDS": a.layers}, []),
        "layer_past_model": (
            {"SGLANG_HS_LAYER_IDS": f"1,3,{a.layers_n + 3}"},
            ["--disable-radix-cache"],
        ),
    }
    procs = {}
    for name, (env, flags) in plugin_cases.items():
        d = work / f"plugin-{name}"
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
        argv = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            "--port",
            str(low_port()),
            "--mem-fraction-static",
            "0.1",
            *SGLANG_FLAGS,
            *flags,
        ]
        procs[name] = (
            time.monotonic(),
            Proc(argv, work / f"plugin-{name}.log", {"SGLANG_HS_DUMP_DIR": str(d), **env}),
        )
    for name, (t, p) in procs.items():
        try:
            p.p.wait(300)
        except subprocess.TimeoutExpired:
            p.stop()
        text = p.text()
        msg = [ln for ln in text.splitlines() if "refusing to start" in ln][:1]
        out[f"plugin_{name}"] = {
            "exit": p.p.returncode,
            "seconds": round(time.monotonic() - t, 1),
            "refused_with_hsq_message": bool(msg),
            "message": [m[-300:] for m in msg],
            "ready_marker_written": (work / f"plugin-{name}" / "hsq-ready.json").exists(),
        }
        p.stop()
        say(f"plugin refusal {name}: exit {p.p.returncode}, hsq message: {bool(msg)}")
    return out


def extract_run(
    a: argparse.Namespace,
    work: Path,
    server: Server,
    redis: RedisServer,
    run: str,
    dataset: dict[str, list[int]],
    ds_path: Path,
    *,
    kill_at: float | None,
    layers: str,
    run_flags: Sequence[str] = (),
) -> dict[str, Any]:
    out_root = work / "out"
    r = hsq(
        "enqueue",
        str(ds_path),
        "--run",
        run,
        "--out",
        str(out_root),
        "--redis",
        redis.url,
        "--layers",
        layers,
        "--no-progress",
        *run_flags,
    )
    if r.returncode != 0:
        raise RuntimeError(f"enqueue: {r.stdout}\n{r.stderr}")
    wlog = work / f"worker-{run}.log"
    wlog.unlink(missing_ok=True)  # the counts below read this run's log only
    worker = Proc(
        hsq_command(
            "--log-format",
            "json",
            "worker",
            "--run",
            run,
            "--server",
            server.url,
            "--dump-dir",
            str(server.dump_dir),
            "--redis",
            redis.url,
            "--inflight",
            str(a.inflight),
            "--name",
            f"live-{run}",
            "--dump-timeout",
            "60",
        ),
        wlog,
    )
    n = len(dataset)
    res: dict[str, Any] = {"samples": n, "tokens": sum(map(len, dataset.values()))}
    t0 = time.monotonic()
    try:
        done = done_count(redis.url, run)
        if kill_at is not None:
            wait_for(lambda: done() >= n * kill_at, 600, "first third", worker, poll=0.02)
            done_before = done()
            say(f"SIGKILL to SGLang's process group with {done_before}/{n} done")
            server.kill()
            res["killed_with_done"] = done_before
            time.sleep(3)  # the worker sees a dead server with K requests in flight
            res["restart_s"] = round(server.start(), 1)
        wait_for(lambda: done() >= n, 300, "all done", worker)
        res["wall_s"] = round(time.monotonic() - t0, 1)
    finally:
        worker.stop()
    st = status(redis.url, run)
    res["status"] = {k: st.get(k) for k in ("total", "done", "dead", "queued", "in_progress")}
    done_ev = Counter(str(e["sample"]) for e in log_events(wlog, "sample_done"))
    res["marked_done_once"] = all(v == 1 for v in done_ev.values()) and len(done_ev) == n
    res["first_marks"] = sum(1 for e in log_events(wlog, "sample_done") if e.get("first"))
    res["discarded_dumps"] = sum(1 for _ in log_events(wlog, "dump_discarded"))
    v = hsq("verify", "--run", run, "--redis", redis.url, "--deep", "--no-progress", timeout=600)
    res["verify_deep_exit"] = v.returncode
    res["rate"] = steady_rate(wlog)
    say(f"{run}: {json.dumps(res)}")
    return res


def phase_extract(
    a: argparse.Namespace, work: Path, redis: RedisServer, *, family: str, variant: str = "bf16"
) -> dict[str, Any]:
    """`variant` fp8-prenorm: the server quantizes its dumps (--dump-encoding fp8-e4m3) and
    adds the pre-norm final state (--prenorm); the run stores fp8 with the pre-norm state."""
    dev = "cuda" if a.server == "sglang" else "cpu"
    fp8 = variant == "fp8-prenorm"
    server_flags = ["--dump-encoding", "fp8-e4m3", "--prenorm"] if fp8 else []
    run_flags = ["--store-dtype", "fp8-e4m3", "--prenorm"] if fp8 else []
    name = family if not fp8 else f"{family}-{variant}"
    # SGLang is given the ids as a drafter config names them (Llama: +1, docs/sglang.md);
    # the reference server takes HF hidden_states indices. The effective ids come from
    # the readiness marker either way.
    if family == "llama":
        model = write_llama(work / "llama", layers=a.layers_n, hidden=a.hidden, seed=0, device=dev)
        layers = (
            a.layers
            if a.server == "sglang"
            else ",".join(str(int(x) + 1) for x in a.layers.split(","))
        )
    else:
        model = write_deepseek(work / "deepseek", seed=0, device=dev)
        layers = "2,3,5"
    vocab = 32000
    dump = Path(a.dump_root) / f"hsq-live-{name}"
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    dump.chmod(0o700)
    extra = (
        [
            *SGLANG_FLAGS,
            "--mem-fraction-static",
            "0.25",
            "--chunked-prefill-size",
            str(a.chunk),
            "--max-running-requests",
            "64",
        ]
        if a.server == "sglang"
        else ["--max-batch-requests", "4"]
    )
    server = Server(
        a.server,
        model,
        dump,
        work / f"server-{name}.log",
        layers=layers,
        extra=[*server_flags, *extra],
        device=dev,
    )
    res: dict[str, Any] = {
        "model": model.name,
        "variant": variant,
        "layers": layers,
        "chunked_prefill_size": a.chunk,
    }
    try:
        res["start_s"] = round(server.start(), 1)
        marker = json.loads((dump / "hsq-ready.json").read_text())
        res["ready_marker"] = {k: marker.get(k) for k in ("server", "server_version", "layer_ids")}
        effective = ",".join(str(int(i)) for i in marker["layer_ids"])
        lengths = lengths_mixed(a.samples, seed=1, chunk=a.chunk)
        ds_path = work / f"{family}.jsonl"
        data = make_dataset(ds_path, lengths, vocab=vocab, seed=2)
        res["longer_than_chunk"] = sum(1 for n in lengths if n > a.chunk)
        res["run"] = extract_run(
            a,
            work,
            server,
            redis,
            f"live-{name}",
            data,
            ds_path,
            kill_at=(1 / 3 if a.kill and not fp8 else None),
            layers=effective,
            run_flags=run_flags,
        )
        log_text = server.proc.text() if server.proc else ""
        res["server_log_errors"] = [
            ln[-200:]
            for ln in log_text.splitlines()
            if "hs_dump" in ln and ("error" in ln.lower() or "fail" in ln.lower())
        ][:10]
        hook_lines = [ln[-300:] for ln in log_text.splitlines() if "hs_dump:" in ln][:3]
        res["hook_log"] = hook_lines
    finally:
        server.stop()
    import torch

    ref = Reference(
        model,
        [int(x) for x in effective.split(",")],
        "cuda" if torch.cuda.is_available() else "cpu",
    )
    res["equality"] = compare_outputs(work / "out" / f"live-{name}", data, ref)
    say(f"{name} equality: {json.dumps(res['equality'])}")
    del ref
    return res


async def _load(url: str, seqs: list[list[int]], k: int, rid_prefix: str) -> float:
    sem = asyncio.Semaphore(k)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=k + 4)) as c:

        async def one(i: int, ids: list[int]) -> None:
            async with sem:
                r = await c.post(
                    url + "/generate",
                    json={
                        "input_ids": ids,
                        "rid": f"{rid_prefix}{i}-{os.urandom(4).hex()}",
                        "sampling_params": {"max_new_tokens": 0},
                    },
                )
                r.raise_for_status()

        await asyncio.gather(*(one(i, s) for i, s in enumerate(seqs[: min(k, len(seqs))])))  # warm
        t = time.perf_counter()
        await asyncio.gather(*(one(i, s) for i, s in enumerate(seqs)))
        return time.perf_counter() - t


@contextmanager
def dump_sweeper(dump_dir: Path) -> Iterator[None]:
    """Remove finished dumps as they appear (what a worker would do, minus the work), so
    the hook's cost is measured without the dump dir filling tmpfs."""
    stop = threading.Event()

    def sweep() -> None:
        while not stop.is_set():
            for d in dump_dir.glob("req_*"):
                if (d / "done").exists():
                    shutil.rmtree(d, ignore_errors=True)
            time.sleep(0.01)

    t = threading.Thread(target=sweep, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def phase_capacity(a: argparse.Namespace, work: Path, redis: RedisServer) -> dict[str, Any]:
    model = write_8b_config(work / "llama8b-dummy")
    rng = random.Random(5)
    workloads = {
        "short": ([rng.randint(64, 512) for _ in range(a.cap_short)], a.cap_k_short),
        "long": ([rng.randint(1024, 4096) for _ in range(a.cap_long)], a.cap_k_long),
    }
    seqs = {
        w: [[1] + [rng.randrange(3, 128000) for _ in range(n - 1)] for n in ls]
        for w, (ls, _) in workloads.items()
    }
    flags = [
        *SGLANG_FLAGS,
        "--load-format",
        "dummy",
        "--mem-fraction-static",
        "0.6",
        "--chunked-prefill-size",
        "8192",
        "--max-running-requests",
        "128",
    ]
    res: dict[str, Any] = {}
    dump = Path(a.dump_root) / "hsq-live-cap"
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    dump.chmod(0o700)

    def measure(label: str, url: str) -> None:
        for w, (ls, k) in workloads.items():
            secs = asyncio.run(_load(url, seqs[w], k, "hsq-cap-"))
            toks = sum(ls)
            res.setdefault(w, {})[label] = {
                "tok_s": round(toks / secs),
                "k": k,
                "samples_s": round(len(ls) / secs, 1),
            }
            say(f"capacity {label} {w}: {toks / secs:,.0f} tok/s (K={k})")

    # 1. SGLang alone: the plugin is installed but inactive without SGLANG_HS_DUMP_DIR.
    port = low_port()
    plain = Proc(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            "--port",
            str(port),
            "--disable-radix-cache",
            "--disable-prefill-cuda-graph",
            *flags,
        ],
        work / "cap-nohook.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: healthy(url), START_TIMEOUT, "sglang (no hook)", plain)
        measure("sglang_no_hook", url)
    finally:
        plain.stop()
    # 2. The same with the hook (dumps swept as they complete), then hsq end to end.
    server = Server("sglang", model, dump, work / "cap-hook.log", layers="1,15,28", extra=flags)
    try:
        server.start()
        with dump_sweeper(dump):
            measure("sglang_hook", server.url)
        for w, (_, k) in workloads.items():
            ds = work / f"cap-{w}.jsonl"
            data = {f"c{w[0]}{i:05d}": s for i, s in enumerate(seqs[w])}
            with open(ds, "w") as f:
                for sid, ids in data.items():
                    f.write(json.dumps({"id": sid, "input_ids": ids}) + "\n")
            run = f"cap-{w}"
            r = hsq(
                "enqueue",
                str(ds),
                "--run",
                run,
                "--out",
                a.cap_out,
                "--redis",
                redis.url,
                "--no-progress",
            )
            if r.returncode:
                raise RuntimeError(r.stderr)
            wlog = work / f"cap-worker-{w}.log"
            t = time.monotonic()
            argv = hsq_command(
                "--log-format", "json", "worker", "--run", run, "--server", server.url,
                "--dump-dir", str(dump), "--redis", redis.url, "--inflight", str(k), "--burst",
                "--persist-threads", "4",
            )  # fmt: skip
            with open(wlog, "w") as wf:
                wr = subprocess.run(argv, stdout=wf, stderr=subprocess.STDOUT, timeout=600)
            rate = steady_rate(wlog)
            rate["wall_s"] = round(time.monotonic() - t, 1)
            rate["exit"] = wr.returncode
            res[w]["hsq"] = rate
            say(f"hsq end to end {w}: {json.dumps(rate)}")
            shutil.rmtree(Path(a.cap_out) / run, ignore_errors=True)
    finally:
        server.stop()
    for w in workloads:
        r = res[w]
        r["hook_over_no_hook"] = round(r["sglang_hook"]["tok_s"] / r["sglang_no_hook"]["tok_s"], 3)
        if r.get("hsq", {}).get("tok_s"):
            r["hsq_over_hook"] = round(r["hsq"]["tok_s"] / r["sglang_hook"]["tok_s"], 3)
    # 3. The reference server on the same workloads (its own 8B-shape random model).
    if a.cap_reference:
        ref = Server(
            "reference",
            Path("llama-8b"),
            Path(a.dump_root) / "hsq-live-ref",
            work / "cap-ref.log",
            layers="2,16,29",
            extra=["--max-batch-requests", "16", "--warmup-shapes"],
        )
        ref.dump_dir.mkdir(parents=True, exist_ok=True)
        ref.dump_dir.chmod(0o700)
        try:
            ref.start()
            with dump_sweeper(ref.dump_dir):
                measure("reference", ref.url)
        finally:
            ref.stop()
        for w in workloads:
            res[w]["reference_over_sglang"] = round(
                res[w]["reference"]["tok_s"] / res[w]["sglang_no_hook"]["tok_s"], 3
            )
    return res


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--server", choices=("sglang", "reference"), default="sglang")
    p.add_argument("--phases", default="refusals,extract,capacity")
    p.add_argument("--work", default="/tmp/hsq-live")
    p.add_argument("--dump-root", default="/dev/shm")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--inflight", type=int, default=8)
    p.add_argument("--chunk", type=int, default=1024, help="--chunked-prefill-size")
    p.add_argument(
        "--layers", default="1,3,5", help="EAGLE-3 layer ids of the Llama run (SGLang adds 1)"
    )
    p.add_argument("--layers-n", type=int, default=8, help="decoder layers of the test Llama")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--no-kill", dest="kill", action="store_false")
    p.add_argument("--cap-short", type=int, default=600)
    p.add_argument("--cap-long", type=int, default=60)
    p.add_argument("--cap-k-short", type=int, default=32)
    p.add_argument("--cap-k-long", type=int, default=8)
    p.add_argument("--cap-out", default="/root/hsq-cap-out")
    p.add_argument("--cap-reference", action="store_true")
    p.add_argument("--start-timeout", type=float, default=400.0)
    a = p.parse_args()
    global START_TIMEOUT
    START_TIMEOUT = a.start_timeout
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    phases = [x for x in a.phases.split(",") if x]
    RESULTS["args"] = vars(a)
    try:
        import sglang  # type: ignore[import-not-found,unused-ignore]

        RESULTS["sglang_version"] = sglang.__version__
    except ImportError:
        RESULTS["sglang_version"] = None
    redis = RedisServer(work / "redis").wait_ready()
    ok = True
    try:
        for ph in phases:
            say(f"=== phase {ph}")
            t = time.monotonic()
            try:
                if ph == "refusals":
                    RESULTS[ph] = phase_refusals(a, work)
                elif ph in ("extract", "deepseek"):
                    RESULTS[ph] = phase_extract(
                        a, work, redis, family="llama" if ph == "extract" else "deepseek"
                    )
                elif ph == "fp8-prenorm":
                    RESULTS[ph] = phase_extract(a, work, redis, family="llama", variant=ph)
                elif ph == "capacity":
                    RESULTS[ph] = phase_capacity(a, work, redis)
                else:
                    raise SystemExit(f"unknown phase {ph}")
            except Exception as exc:
                ok = False
                RESULTS[ph] = {
                    "error": f"{type(exc).__name__}: {exc}"[-3000:],
                    "traceback": traceback.format_exc()[-3000:],
                }
                say(f"phase {ph} FAILED: {exc}")
            RESULTS.setdefault("phase_seconds", {})[ph] = round(time.monotonic() - t, 1)
            if a.json:
                Path(a.json).write_text(json.dumps(RESULTS, indent=1))
    finally:
        redis.stop()
    print(json.dumps(RESULTS, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
