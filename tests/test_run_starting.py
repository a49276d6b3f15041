"""`hsq run` as a new user meets it: a server held in its start says `starting` (not down,
not unreachable) in `hsq status`; `hsq run --prenorm` starts its servers with --prenorm;
the summary's rate leaves the start-up out; the same command on the finished run starts
no server; children cannot be shadowed by a directory named `hsq/` where the user stands;
a missing or empty DATASET is a usage error.

Real parts: `hsq run` as its own process group, its own redis-server, a reference server
held by its test hook (HSQ_TEST_HOLD_START_UNTIL) until the test lets it go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hsq import open_output
from hsq.engines.reference.app import HOLD_START_ENV
from hsq.node.procs import hsq_command, python_module
from hsq.producer.synthetic import write_synthetic
from tests.helpers import hsq, hsq_process, wait_until
from tests.run_helpers import Node, no_node_left, run_store

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="process groups, /dev/shm"),
    pytest.mark.timeout(600),
    pytest.mark.usefixtures(no_node_left.__name__),
]


def test_a_held_server_is_starting_then_prenorm_reaches_it_and_a_rerun_starts_nothing(
    tmp_path: Path,
) -> None:
    ds = tmp_path / "data.jsonl"
    write_synthetic(ds, 12, seed=4, min_len=4, max_len=32)
    out, go = tmp_path / "out", tmp_path / "go"
    args = [str(ds), "--out", str(out), "--engine", "reference", "--prenorm", "--json"]
    first = Node(tmp_path, "first", *args, **{HOLD_START_ENV: str(go)})
    st = run_store(out, "data")

    def record() -> dict[str, str]:
        return next(iter(st.workers.workers_info().values()), {})

    # The worker's record exists while the server is still loading, and says why it waits.
    wait_until(lambda: record().get("cause") == "server_starting", 180, interval=0.1)
    assert record()["state"] == "starting"
    url_file = out / ".hsq" / "redis-url"
    shown = hsq("status", "--run", "data", "--redis-url-file", str(url_file), check=True).stdout
    assert "[starting: server starting since " in shown and "unreachable" not in shown, shown

    go.touch()  # the server loads, answers; the run goes on
    assert first.wait() == 0, first.output()
    summary = first.summary()
    status = summary["status"]
    assert isinstance(status, dict) and status["done"] == 12 and status["dead"] == 0
    # The rate counts extraction only: the held start-up is reported apart.
    starting, active = summary["starting_s"], summary["active_s"]
    assert isinstance(starting, float) and isinstance(active, float) and starting > 0
    rate = status["samples_per_s"] * active
    assert rate == pytest.approx(12, rel=0.01), (summary, first.output())
    assert "unreachable" not in first.output()
    # The outputs hold the pre-norm state: the server was started with --prenorm (without
    # it the worker refuses the server's marker and exits 2, nothing done).
    files = sorted((out / "data").rglob("*.safetensors"))
    assert len(files) == 12 and open_output(files[0]).last_hidden_state_prenorm is not None

    again = Node(tmp_path, "again", *args)
    assert again.wait() == 0, again.output()
    assert "nothing to do: the run is complete (12 done, 0 dead); no server started" in (
        again.output()
    )
    assert json.loads(again.stdout.read_text().splitlines()[-1])["status"]["done"] == 12


def test_the_servers_get_the_runs_prenorm_from_its_record() -> None:
    from hsq.node.plan import REFERENCE, SGLANG, VLLM, server_args_for
    from hsq.runconfig import RunConfig

    cfg = RunConfig(run="r", dataset="/d", out="/o", prenorm=True, layer_ids=[1, 3, 5])
    assert server_args_for(REFERENCE, cfg, ["--x"]) == ["--prenorm", "--layers", "1,3,5", "--x"]
    assert server_args_for(VLLM, cfg, []) == ["--prenorm", "--layers", "1,3,5"]
    assert server_args_for(SGLANG, cfg, []) == ["--prenorm"]  # SGLang's ids map per family


def test_hsqs_children_start_from_a_directory_holding_a_clone_named_hsq(tmp_path: Path) -> None:
    shadow = tmp_path / "hsq"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("")  # what `python -m hsq` from here used to import
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for argv in (hsq_command("--version"), [*python_module("hsq", "serve-reference"), "--help"]):
        res = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert res.returncode == 0, (argv, res.stderr[-2000:])
    # The persist processes of every worker too.
    from hsq.workers.persist import procs

    assert "-P" in Path(procs.__file__).read_text()


@pytest.mark.realproc
def test_a_missing_or_empty_dataset_is_a_usage_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.endswith("REDIS_URL")}
    missing = hsq_process(
        "run", str(tmp_path / "nonexistent.jsonl"), "--out", str(tmp_path / "o"), env=env
    )
    assert missing.returncode == 2 and "no such file" in missing.stderr, missing.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    res = hsq_process(
        "run", str(empty), "--out", str(tmp_path / "o"), "--engine", "reference", env=env
    )
    assert res.returncode == 2 and "no valid sample" in res.stderr, res.stderr
