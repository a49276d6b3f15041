"""What `hsq launch-sglang` refuses from its own command line (exit 2, before anything
starts) and what the plugin refuses inside a stock `sglang.launch_server` (hsq's message
in the scheduler log, SGLang takes itself down, no readiness marker)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

from hsq.node.procs import ManagedProcess, low_port
from tests.gpu import models_fixture as mf
from tests.gpu.extract import hsq
from tests.gpu.results import Results
from tests.support.sglang import SGLANG_FLAGS


def test_launcher_refuses_before_start(
    results: Results, models_root: Path, fresh: tuple[Path, Path]
) -> None:
    model = mf.llama(models_root)
    _, dd = fresh
    cases = {
        "chunked_prefill_512": ["--layers", model.layers, "--chunked-prefill-size", "512"],
        "two_batch_overlap": ["--layers", model.layers, "--enable-two-batch-overlap"],
        "layer_past_model": ["--layers", f"1,3,{model.num_layers + 3}"],
        "dp_size_2": ["--layers", model.layers, "--dp-size", "2"],
        "tp_zero": ["--layers", model.layers, "--tp", "0"],
    }
    out = {}
    for name, extra in cases.items():
        t = time.monotonic()
        r = hsq("launch-sglang", "--model-path", str(model.served), "--dump-dir", str(dd),
                "--port", str(low_port()), *extra, *SGLANG_FLAGS, timeout=300)  # fmt: skip
        out[name] = {
            "exit": r.returncode,
            "seconds": round(time.monotonic() - t, 1),
            "message": (r.stdout + r.stderr).strip().splitlines()[-1:],
            "refused_before_start": r.returncode == 2 and "serving at" not in r.stdout,
        }
    results.record("refusals", launcher=out)
    assert all(v["refused_before_start"] for v in out.values()), out


def test_plugin_refuses_at_load(
    results: Results, models_root: Path, fresh: tuple[Path, Path]
) -> None:
    model = mf.llama(models_root)
    wd, _ = fresh
    cases = {
        "radix_cache_on": ({"SGLANG_HS_LAYER_IDS": model.layers}, []),
        "layer_past_model": (
            {"SGLANG_HS_LAYER_IDS": f"1,3,{model.num_layers + 3}"},
            ["--disable-radix-cache"],
        ),
    }
    procs: dict[str, tuple[float, Path, ManagedProcess]] = {}
    for name, (env, flags) in cases.items():
        d = wd / f"plugin-{name}"
        d.mkdir(mode=0o700)
        argv = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model.served),
            "--port", str(low_port()), "--mem-fraction-static", "0.1", *SGLANG_FLAGS, *flags,
        ]  # fmt: skip
        p = ManagedProcess(argv, wd / f"plugin-{name}.log", {"SGLANG_HS_DUMP_DIR": str(d), **env},
                           new_session=True)  # fmt: skip
        procs[name] = (time.monotonic(), d, p)
    out = {}
    for name, (t, d, p) in procs.items():
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(300)
        p.stop()
        text = p.log_path.read_text(errors="replace")
        msg = [ln for ln in text.splitlines() if "refusing to start" in ln][:1]
        out[name] = {
            "exit": p.proc.returncode,
            "seconds": round(time.monotonic() - t, 1),
            "refused_with_hsq_message": bool(msg),
            "message": [m[-300:] for m in msg],
            "ready_marker_written": (d / "hsq-ready.json").exists(),
        }
    results.record("refusals", plugin=out)
    assert all(v["refused_with_hsq_message"] and not v["ready_marker_written"]
               for v in out.values()), out  # fmt: skip
