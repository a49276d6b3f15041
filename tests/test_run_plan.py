"""`hsq run`'s pure parts: the server plan (kind, GPU/TP split), the worker flags it hands
on, the live view's text. No process starts here."""

from __future__ import annotations

import io
import signal
from pathlib import Path

import pytest

from hsq.cli.commands.run import run_name_of
from hsq.cli.options import as_argv
from hsq.errors import ConfigError
from hsq.node.node import Interrupts
from hsq.node.plan import (
    WORKER_API,
    NodePlan,
    model_shape,
    parse_gpus,
    plan_node,
    server_args_for,
    split_gpus,
    visible_gpus,
)
from hsq.node.supervisor import launcher_args, should_restart
from hsq.node.view import PairView, Screen, log_line, render
from hsq.ops.status import RunStatus, WorkerStatus
from hsq.workers.settings import ExchangeTuning, WorkerTuning


def plan(**kw: object) -> NodePlan:
    args: dict[str, object] = dict(
        requested=None, model=None, gpus_flag=None, tp=1, servers=None, sglang=False, visible=()
    )
    args.update(kw)
    return plan_node(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sglang", "visible", "kind"),
    [
        (True, ("0", "1"), "sglang"),  # the GPU node
        (True, (), "reference"),  # SGLang installed, no GPU (a login node)
        (False, ("0",), "reference"),  # a GPU, no SGLang in this environment
        (False, (), "reference"),  # a laptop
    ],
)
def test_default_server_is_sglang_only_where_it_can_run(
    sglang: bool, visible: tuple[str, ...], kind: str
) -> None:
    p = plan_node(
        requested=None, model="/m", gpus_flag=None, tp=1, servers=None, sglang=sglang,
        visible=visible,
    )  # fmt: skip
    assert p.kind == kind
    assert ("GPU" in p.why or "SGLang" in p.why) and (kind == "sglang" or "reference" in p.why)


def test_eight_gpus_split_by_tp() -> None:
    gpus = tuple(str(i) for i in range(8))
    assert split_gpus(gpus, 1) == [(g,) for g in gpus]
    assert split_gpus(gpus, 2) == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
    assert split_gpus(gpus, 8) == [gpus]
    with pytest.raises(ConfigError, match="multiple of 3"):
        split_gpus(gpus, 3)
    with pytest.raises(ConfigError, match="none is visible"):
        split_gpus((), 1)
    p = plan_node(
        requested="sglang", model="/m", gpus_flag="0-7", tp=4, servers=None, sglang=True,
        visible=(),
    )  # fmt: skip
    assert [s.gpus for s in p.servers] == [("0", "1", "2", "3"), ("4", "5", "6", "7")]
    assert p.tp == 4 and [s.index for s in p.servers] == [0, 1]


def test_gpu_lists_parse_and_bad_ones_are_refused() -> None:
    assert parse_gpus("0-3,6") == ("0", "1", "2", "3", "6")
    assert parse_gpus("") == ()
    for bad in ("a", "3-1", "0,0", "1-2,2"):
        with pytest.raises(ConfigError):
            parse_gpus(bad)


def test_visible_gpus_follow_cuda_visible_devices_then_the_devices(tmp_path: Path) -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, tmp_path) == ("2", "3")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == ()
    for name in ("nvidia0", "nvidia1", "nvidia10", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpus({}, tmp_path) == ("0", "1", "10")


def test_plan_refusals_say_what_to_change() -> None:
    with pytest.raises(ConfigError, match="needs --model"):
        plan(requested="sglang", visible=("0",))
    with pytest.raises(ConfigError, match="disagrees"):
        plan(requested="sglang", model="/m", visible=("0", "1"), servers=1)
    with pytest.raises(ConfigError, match="--tp is for SGLang"):
        plan(tp=2)
    with pytest.raises(ConfigError, match="--gpus is for SGLang"):
        plan(gpus_flag="0")
    p = plan_node(
        requested=None, model=None, gpus_flag=None, tp=1, servers=3, sglang=False, visible=()
    )
    assert p.kind == "reference" and p.model == "tiny" and len(p.servers) == 3


def test_vllm_servers_are_planned_as_sglang_ones_and_launched_by_their_launcher() -> None:
    with pytest.raises(ConfigError, match="--engine vllm needs --model"):
        plan(requested="vllm", visible=("0",))
    with pytest.raises(ConfigError, match="vLLM needs GPUs and none is visible"):
        plan(requested="vllm", model="/m")
    p = plan(requested="vllm", model="/m", visible=("0", "1", "2", "3"), tp=2)
    assert isinstance(p, NodePlan) and p.kind == "vllm" and WORKER_API[p.kind] == "vllm"
    assert [s.gpus for s in p.servers] == [("0", "1"), ("2", "3")]
    assert launcher_args(p, Path("/dev/shm/d"), 8001) == [
        "launch-vllm", "--model-path", "/m", "--tp", "2", "--dump-dir", "/dev/shm/d",
        "--host", "127.0.0.1", "--port", "8001",
    ]  # fmt: skip
    assert WORKER_API["reference"] == WORKER_API["sglang"] == "sglang"  # one API


def test_worker_flags_are_the_ones_given_and_only_those() -> None:
    assert as_argv(WorkerTuning()) == []
    exchange = ExchangeTuning(dump_timeout_s=5.0, dump_dir_force=True)
    s = WorkerTuning(exchange=exchange, inflight=2, direct_io=False)
    assert as_argv(s) == ["--dump-timeout", "5.0", "--dump-dir-force", "--no-direct-io",
                          "--inflight", "2"]  # fmt: skip


def test_run_names_come_from_the_file_name() -> None:
    assert run_name_of(Path("/d/train.tokens.jsonl")) == "train-tokens"
    assert run_name_of(Path("sharegpt_v3.jsonl")) == "sharegpt_v3"
    with pytest.raises(ConfigError):
        run_name_of(Path("....jsonl"))


def test_one_interrupt_asks_for_a_clean_stop_two_for_a_kill() -> None:
    stop = Interrupts()
    stop(signal.SIGINT, None)
    assert stop.count == 1 and stop.exit_code == 130
    stop(signal.SIGTERM, None)
    assert stop.count == 2 and stop.exit_code == 130  # the first signal names the exit


def status(**kw: object) -> RunStatus:
    base: dict[str, object] = dict(
        run="r", total=10, done=4, queued=3, in_progress=2, retry=0, dead=1, missing=0,
        invalid_lines=0, tokens_done=400, tokens_total=1000, bytes_done=0, samples_per_s=2.0,
        tokens_per_s=1234.0, eta_s=75.0, dead_by_reason={"too_long": 1}, workers=[],
    )  # fmt: skip
    base.update(kw)
    return RunStatus(**base)  # type: ignore[arg-type]


def test_the_view_puts_each_server_beside_its_worker_and_other_nodes_below() -> None:
    w = WorkerStatus(id="n-0.x", state="working", name="n-0", done=4, tokens_per_s=1234.0,
                     last_sample="s7")  # fmt: skip
    other = WorkerStatus(id="m-0.y", state="server_down", name="m-0")
    st = status(workers=[w, other])
    pairs = [
        PairView(0, "reference", "http://127.0.0.1:1", "up", "n-0", None),
        PairView(1, "reference", "http://127.0.0.1:2", "starting", "n-1", None),
    ]
    lines = render(st, pairs, 31.0)
    assert lines[0].startswith("run r: 4/10 done (40.0%), dead 1, 1,234 tokens/s, ETA 1m15s")
    assert "dead by reason: too_long: 1" in lines[2]
    assert "[up]" in lines[3] and "worker n-0 [working] done 4" in lines[3]
    assert "[starting]" in lines[4]
    assert "(another node)" in lines[5] and "[server_down]" in lines[5]
    line = log_line(st, pairs, 31.0)
    assert "done=4/10" in line and "dead_by_reason=too_long:1" in line
    # n-1's worker has no record yet: its server's state says what it waits for.
    assert " n-0=working " in line and line.endswith(" n-1=starting(server-starting)")
    gone = PairView(1, "reference", "http://127.0.0.1:2", "exited 1, given up", "n-1", None)
    assert log_line(st, [gone], 31.0).endswith(" n-1=starting(server-exited-1-given-up)")


def test_plain_lines_when_stdout_is_not_a_terminal() -> None:
    out = io.StringIO()
    screen = Screen(out, every_s=10.0)
    st = status()
    for t in (0.0, 1.0, 5.0, 10.0, 11.0):
        screen.show(st, [], t)
    screen.show(st, [], 12.0, final=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and all(x.startswith("progress run=r") for x in lines)
    assert "\x1b" not in out.getvalue()


def test_a_server_is_restarted_unless_it_refused_or_used_its_restarts() -> None:
    assert should_restart(1, 0, 3) and should_restart(-9, 2, 3) and should_restart(0, 0, 1)
    assert not should_restart(2, 0, 3)  # a refusal (launch-sglang's exit 2) would repeat
    assert not should_restart(1, 3, 3) and not should_restart(-9, 0, 0)


def test_persist_processes_share_the_host_between_the_workers() -> None:
    from hsq.node.plan import persist_procs_each

    assert persist_procs_each(8, cpus=16) == 0  # 2 cores a worker: threads
    assert persist_procs_each(1, cpus=16) == 8
    assert persist_procs_each(2, cpus=16) == 4
    assert persist_procs_each(1, cpus=2) == 0


def test_an_fp8_runs_servers_make_the_fp8_unless_told_otherwise() -> None:
    from hsq.runconfig import RunConfig

    bf16 = RunConfig(run="r", dataset="/d", out="/o")
    fp8 = RunConfig(run="r", dataset="/d", out="/o", store_dtype="fp8-e4m3")
    assert server_args_for("reference", bf16, ["--x", "1"]) == ["--x", "1"]
    assert server_args_for("sglang", fp8, []) == ["--dump-encoding", "fp8-e4m3"]
    # The user's own choice after `--` comes last, which click keeps.
    given = server_args_for("sglang", fp8, ["--dump-encoding", "plain"])
    assert given == ["--dump-encoding", "fp8-e4m3", "--dump-encoding", "plain"]


def test_the_view_fits_an_80_column_terminal_and_follows_the_worker() -> None:
    """Lines wider than the terminal wrap, and a redraw that counts lines then scrolls a new
    copy each refresh: every line fits; a server and its worker take two lines there."""
    long_cause = "output disk full since 12:00:00 (" + "x" * 200 + ")"
    w = WorkerStatus(id="n-0.x", state="idle", name="node-with-a-long-name-0", done=180,
                     tokens_per_s=0.0, cause_text=long_cause)  # fmt: skip
    st = status(workers=[w], dead_by_reason={f"reason_{i}": i for i in range(30)})
    started = "starting: loading since 12:00:01"
    pairs = [PairView(0, "sglang", "http://127.0.0.1:31234", started, "node-with-a-long-name-0",
                      None)]  # fmt: skip
    lines = render(st, pairs, 31.0, width=79)
    assert all(len(x) <= 79 for x in lines), [len(x) for x in lines]
    assert lines[3].startswith("  server 0 sglang") and "[starting: loading since" in lines[3]
    assert lines[4].startswith("    worker node-with-a-long-name-0 [idle]")
    # Wide: one line a pair, as before.
    assert len(render(st, pairs, 31.0, width=300)) == 4
    # A worker whose record is gone after it was seen is not `starting`.
    seen = PairView(0, "reference", "http://x", "up", "n-0", None, stopped=True, worker_seen=True)
    assert "[stopping]" in render(status(), [seen], 1.0)[-1]


def test_a_tty_screen_redraws_within_the_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("COLUMNS", "60")
    out = Tty()
    w = WorkerStatus(id="n-0.x", state="working", name="n-0", done=1, last_sample="s" * 90)
    pairs = [PairView(0, "reference", "http://127.0.0.1:1", "up", "n-0", None)]
    screen = Screen(out)
    screen.show(status(workers=[w]), pairs, 1.0)
    screen.show(status(workers=[w]), pairs, 2.0)
    drawn = out.getvalue().split("\x1b[J")[-1].splitlines()
    assert drawn and all(len(x) <= 59 for x in drawn)
    assert out.getvalue().count(f"\x1b[{len(drawn)}F") == 1  # the second draw replaced the first


def test_a_streamed_run_s_lines_are_part_of_the_view_and_cut_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stream's figures were a line printed above the view every 10 s: wider than 80
    columns it wrapped, and between prints it showed a spool long since full as empty."""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("COLUMNS", "80")
    out = Tty()
    pairs = [PairView(0, "reference", "http://127.0.0.1:1", "up", "n-0", None)]
    group = "    group train: delivered 83, committed 72, pending 11, data wait 31%"
    stream = ["  stream: spool 8.3M/10.0M, published 86, consumed 72, producer paused 16%",
              group + "x" * 40]  # fmt: skip
    screen = Screen(out)
    screen.show(status(), pairs, 1.0, extra=stream)
    screen.show(status(), pairs, 2.0, extra=stream)
    drawn = out.getvalue().split("\x1b[J")[-1].splitlines()
    assert drawn[-2] == stream[0] and drawn[-1].startswith("    group train: delivered 83")
    assert all(len(x) <= 79 for x in drawn), [len(x) for x in drawn]
    assert out.getvalue().count(f"\x1b[{len(drawn)}F") == 1  # the redraw counts them


def test_the_summary_says_so_when_every_worker_failed_and_verifies_nothing() -> None:
    from hsq.node.node import NodeJob, NodeOutcome, Rate, _summary_lines
    from hsq.node.plan import NodePlan

    plan = NodePlan("reference", "tiny", 1, (), "test")
    job = NodeJob(run="r", out=Path("/o"), plan=plan, redis_url=None, enqueue=None,
                  worker_argv=(), server_args=(), metrics_port=None)  # fmt: skip
    st = status(done=0, dead=0, queued=10, in_progress=0, dead_by_reason={})
    o = NodeOutcome(1, st, Rate(0, 0, 0.0, 12.0), None, 13.0, Path("/o/r"), None, 0, {},
                    all_failed=True)  # fmt: skip
    text = "\n".join(_summary_lines(job, o, ""))
    assert "every worker of this node exited with an error" in text
    assert "verified" not in text.replace("nothing was verified", "")


def test_a_streamed_run_s_summary_suggests_no_export_of_files_it_removed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hsq.node.node import NodeJob, NodeOutcome, Rate, report_node

    plan = NodePlan("reference", "tiny", 1, (), "test")
    job = NodeJob(run="r", out=Path("/o"), plan=plan, redis_url=None, enqueue=None,
                  worker_argv=(), server_args=(), metrics_port=None)  # fmt: skip
    st = status(done=10, dead=0, queued=0, in_progress=0, dead_by_reason={})
    for consumed in (False, True):
        o = NodeOutcome(0, st, Rate(0, 10, 1.0, 1.0), None, 2.0, Path("/o/r"), None, 0, {},
                        files_consumed=consumed)  # fmt: skip
        report_node(job, o)
        text = capsys.readouterr().out
        assert "hsq verify --run r" in text
        assert ("hsq export --run r" in text) is not consumed, text


def test_the_model_s_shape_is_read_before_any_server_starts(tmp_path: Path) -> None:
    """What sizes a streamed run's budget check at enqueue (hsq/producer/spoolcheck.py):
    the reference server's named shape, a checkpoint's config.json (a multimodal wrapper's
    text config), the engines' default three aux layers unless the servers get --layers."""
    tiny = model_shape(plan(), [])
    assert tiny is not None and (tiny.hidden_size, tiny.layer_ids) == (64, [2, 4, 5])
    ckpt = tmp_path / "kimi"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        '{"architectures": ["KimiK25ForConditionalGeneration"], "hidden_size": 1, '
        '"text_config": {"hidden_size": 7168, "num_hidden_layers": 61}}'
    )
    on_gpus = plan(model=str(ckpt), sglang=True, visible=("0",))
    kimi = model_shape(on_gpus, [])
    assert kimi is not None and (kimi.hidden_size, kimi.layer_ids) == (7168, [2, 30, 58])
    assert str(ckpt / "config.json") in kimi.source
    own = model_shape(on_gpus, ["--layers", "1,2"])
    assert own is not None and own.layer_ids is None  # the run's recorded layers count
    assert model_shape(plan(model="org/hub-id", sglang=True, visible=("0",)), []) is None
    assert model_shape(plan(model="no-such-shape"), []) is None
