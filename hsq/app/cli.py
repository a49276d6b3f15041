"""The `hsq` command line. Thin: parse flags (with env vars), build settings, call the core.

Exit codes: 0 ok, 1 problems found, 2 usage or configuration error, 3 Redis unreachable.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from hsq import __version__
from hsq.app.options import F, settings_options
from hsq.errors import ConfigError, HsqError, StoreError
from hsq.logs import configure, progress
from hsq.runconfig import RunConfig
from hsq.settings import int_tuple
from hsq.sglang_server.reference.settings import ReferenceSettings
from hsq.workers.settings import WorkerSettings

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_REDIS = 3

_RUN_SETTINGS = (
    "max_attempts",
    "chunk_size",
    "layer_ids",
    "model_id",
    "max_tokens",
    "store_dtype",
    "prenorm",
)
"""RunConfig fields `hsq enqueue` takes as options (the rest: arguments or recorded later)."""


def _given(param: str) -> bool:
    """Whether the user gave `param` (flag or env var), not click's default."""
    source = click.get_current_context().get_parameter_source(param)
    return source not in (None, click.core.ParameterSource.DEFAULT)


def _layers(value: str | None) -> tuple[int, ...] | None:
    if not value:
        return None
    try:
        return int_tuple(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="hsq")
@click.option("--log-level", default="INFO", envvar="HSQ_LOG_LEVEL", show_default=True)
@click.option(
    "--log-format", type=click.Choice(["json", "console"]), default="json", envvar="HSQ_LOG_FORMAT"
)
def cli(log_level: str, log_format: str) -> None:
    """hsq: extract an LLM's hidden states at scale to train EAGLE-3 drafters."""
    configure(log_level, log_format)


@cli.command("serve-reference")
@settings_options(ReferenceSettings)
def serve_reference(**values: Any) -> None:
    """Serve a real transformer with SGLang's HTTP API, dumping hidden states per request.

    \b
    Example:
      hsq serve-reference --model tiny --dump-dir /tmp/dumps --port 30000
      hsq serve-reference --model /models/llama --device cuda --dump-dir /dev/shm/d0
    """
    from hsq.sglang_server.reference.app import serve

    serve(ReferenceSettings(**values))


def _out_root_option(text: str, *, required: bool = False) -> Callable[[F], F]:
    """--out: the root under which a run's files live (OUT/RUN/)."""
    return click.option(
        "--out",
        type=click.Path(file_okay=False, path_type=Path),
        required=required,
        help=text,
    )


_run_option = click.option(
    "--run",
    required=True,
    envvar="HSQ_RUN",
    show_envvar=True,
    help="run name ([A-Za-z0-9_-])",
)


def _tls_file(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    # Eager: --redis's callback folds them into the URL (hsq.redisurl.RedisTls).
    if value:
        ctx.meta.setdefault("hsq_redis_tls", {})[str(param.name)] = value


def _remember_url_file(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    if value is not None:
        ctx.meta["hsq_redis_url_file"] = value


def _redis_url(ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """--redis, or the URL read from --redis-url-file (a Docker secret, a mode-600 file):
    a password on a command line is visible to every local user in `ps` and /proc."""
    from hsq.redisurl import RedisTls, read_url_file

    path = ctx.meta.get("hsq_redis_url_file")
    if path is not None:
        if ctx.get_parameter_source("redis_url") is click.core.ParameterSource.COMMANDLINE:
            raise click.UsageError("give --redis or --redis-url-file, not both")
        value = read_url_file(path)
    return RedisTls(**ctx.meta.get("hsq_redis_tls", {})).into_url(value)


def _redis_option(f: Callable[..., Any]) -> Callable[..., Any]:
    tls = [
        ("--redis-ca", "ssl_ca_certs", "HSQ_REDIS_CA", "CA bundle that signed the Redis server"),
        ("--redis-cert", "ssl_certfile", "HSQ_REDIS_CERT", "client certificate (mutual TLS)"),
        ("--redis-key", "ssl_keyfile", "HSQ_REDIS_KEY", "client certificate's private key"),
    ]
    for flag, name, env, text in tls:
        f = click.option(
            flag,
            name,
            envvar=env,
            default=None,
            expose_value=False,
            is_eager=True,
            callback=_tls_file,
            type=click.Path(exists=True, dir_okay=False),
            help=f"rediss:// only: {text}; env {env} or URL query `{name}=`",
        )(f)
    f = click.option(
        "--redis-url-file",
        envvar="HSQ_REDIS_URL_FILE",
        show_envvar=True,
        default=None,
        is_eager=True,  # read before --redis, whose callback uses it
        expose_value=False,
        callback=_remember_url_file,
        type=click.Path(dir_okay=False, path_type=Path),
        help="read the Redis URL from this file (its first line; e.g. a Docker secret)",
    )(f)
    return click.option(
        "--redis",
        "redis_url",
        envvar=["HSQ_REDIS_URL", "REDIS_URL"],
        show_envvar=True,
        default="redis://127.0.0.1:6379/0",
        show_default=True,
        callback=_redis_url,
        help="Redis URL with its auth, `redis://[USER]:PASSWORD@host:port/db` (rediss:// for "
        "TLS). Give a password through the environment or --redis-url-file, never as a "
        "flag: every local user sees a command line",
    )(f)


def _chat_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by `tokenize` and `enqueue --tokenizer` (see docs/training.md)."""
    opts = [
        click.option(
            "--template",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            default=None,
            help="Jinja chat template file [default: the tokenizer's own]",
        ),
        click.option("--max-length", type=int, default=None, help="cut longer rows (recorded)"),
        click.option(
            "--no-truncate",
            is_flag=True,
            help="rows longer than --max-length go to the dead letter instead",
        ),
        click.option("--last-turn-only", is_flag=True, help="loss on the last assistant turn only"),
        click.option(
            "--system-prompt", default=None, help="system message for rows that have none"
        ),
        click.option(
            "--assistant-header",
            default=None,
            help="text opening an assistant turn [default: read off the template]",
        ),
        click.option(
            "--end-of-turn",
            default=None,
            help="text closing an assistant turn [default: read off the template]",
        ),
        click.option(
            "--control-tokens",
            type=click.Choice(["allow", "escape", "reject"]),
            default="allow",
            show_default=True,
            help="the tokenizer's special tokens and the template's markers inside content "
            "(a user message faking an assistant turn): allow (as SpecForge: rendered as "
            "control tokens, the faked turn is trained on), escape (tokenized as text) or "
            "reject the row",
        ),
        click.option("--jobs", type=int, default=None, help="processes [default: every core]"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _tokenize_settings(tokenizer: Path, kw: dict[str, Any]) -> Any:
    from hsq.chat import ChatOptions
    from hsq.producer.tokenize import TokenizeSettings

    if kw["max_length"] is not None and kw["max_length"] < 1:
        raise ConfigError("--max-length must be >= 1")
    return TokenizeSettings(
        tokenizer=str(tokenizer),
        template=str(kw["template"]) if kw["template"] else None,
        assistant_header=kw["assistant_header"],
        end_of_turn=kw["end_of_turn"],
        options=ChatOptions(
            max_length=kw["max_length"],
            truncate=not kw["no_truncate"],
            last_turn_only=kw["last_turn_only"],
            system_prompt=kw["system_prompt"],
            control_tokens=kw["control_tokens"],
        ),
        jobs=kw["jobs"],
    )


def _looks_like_chat(path: Path) -> bool:
    from hsq import jsonsafe

    with open(path, "rb") as f:
        first = f.readline(1 << 20)
    try:
        row = jsonsafe.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and ("conversations" in row or "messages" in row)


@cli.command("tokenize")
@click.argument("chats", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--tokenizer",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="local Hugging Face tokenizer directory (nothing is downloaded)",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True)
@_chat_options
@click.option("--no-progress", is_flag=True)
def tokenize(chats: Path, tokenizer: Path, output: Path, no_progress: bool, **kw: Any) -> None:
    """Tokenize chat rows (ShareGPT / OpenAI messages) into `hsq enqueue`'s JSONL.

    input_ids and loss_mask (1 on assistant turns, end-of-turn token included) equal
    SpecForge 0.2.0's GeneralParser on the same tokenizer and template. Unusable rows go
    to OUTPUT.rejects.jsonl with a reason; `hsq enqueue OUTPUT` dead-letters them.

    \b
    Example:
      hsq tokenize chats.jsonl --tokenizer /models/qwen3-8b -o tokens.jsonl --max-length 4096
    """
    from hsq.producer.tokenize import rejects_path, tokenize_file

    report, _ = tokenize_file(
        chats, output, _tokenize_settings(tokenizer, kw), progress=not no_progress
    )
    for line in report.lines_out():
        click.echo(line)
    click.echo(f"wrote {output} and {rejects_path(output)}")


@cli.command("enqueue")
@click.argument("dataset", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_run_option
@_out_root_option("output root; files go to OUT/RUN/", required=True)
@_redis_option
@settings_options(RunConfig, only=_RUN_SETTINGS)
@click.option("--strict", is_flag=True, help="refuse the whole dataset if any line is bad")
@click.option("--no-progress", is_flag=True)
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="DATASET holds chat rows: tokenize them with this local HF tokenizer first",
)
@click.option(
    "--tokens",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="with --tokenizer: where the tokenized JSONL goes (on storage every worker "
    "reads) [default: DATASET's name with .tokens.jsonl, next to it]",
)
@_chat_options
def enqueue(
    dataset: Path,
    run: str,
    out: Path,
    redis_url: str,
    strict: bool,
    no_progress: bool,
    tokenizer: Path | None,
    tokens: Path | None,
    **kw: Any,
) -> None:
    """Validate DATASET (JSONL) and enqueue the samples that are neither done nor queued.

    \b
    Example:
      export HSQ_REDIS_URL=redis://:PASSWORD@head:6379/0   # or --redis-url-file FILE
      hsq enqueue data.jsonl --run kimi-v1 --out /shared/hs
      hsq enqueue chats.jsonl --tokenizer /models/qwen3-8b --run q3 --out /shared/hs
    Running it again enqueues nothing; after a partial run it enqueues only the rest.
    With --tokenizer, DATASET holds chat rows (see `hsq tokenize`); rows that cannot be
    used go to the dead letter. Without it, the rejects file `hsq tokenize` wrote next to
    DATASET (DATASET.rejects.jsonl), if any, is dead-lettered too.
    """
    from hsq.errors import DatasetError
    from hsq.producer.enqueue import enqueue_run
    from hsq.producer.tokenize import read_rejects, rejects_path, tokenize_file
    from hsq.runstore import RunStore
    from hsq.store import connect

    if tokenizer is not None:
        tokens = tokens or dataset.with_name(dataset.name.removesuffix(".jsonl") + ".tokens.jsonl")
        tok_report, rejects = tokenize_file(
            dataset, tokens, _tokenize_settings(tokenizer, kw), progress=not no_progress
        )
        for line in tok_report.lines_out():
            click.echo(line)
        dataset = tokens
    else:
        rejects = read_rejects(rejects_path(dataset))
    rejected = [(r.key, DatasetError(r.message, r.reason), r.id) for r in rejects]

    store = RunStore(connect(redis_url), run)
    settings = {name: kw[name] for name in _RUN_SETTINGS}
    existing = store.load_config()
    for name in ("store_dtype", "prenorm"):
        # A second enqueue need not repeat what the run stores; a different value is refused.
        if not _given(name) and existing is not None:
            settings[name] = getattr(existing, name)
    cfg = RunConfig(run=run, dataset=str(dataset.resolve()), out=str(out.resolve()), **settings)
    try:
        report = enqueue_run(store, cfg, strict=strict, progress=not no_progress, rejected=rejected)
    except DatasetError as exc:
        if tokenizer is None and _looks_like_chat(dataset):
            raise DatasetError(
                f"{exc}; the lines look like chat rows: pass --tokenizer DIR (see `hsq tokenize`)",
                exc.reason,
            ) from exc
        raise
    for line in report.lines_out():
        click.echo(line)
    for p in report.problems[:10]:
        click.echo(f"  invalid: {p}", err=True)


@cli.command("recover")
@click.argument(
    "dataset", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@_run_option
@_out_root_option(
    "output root the run wrote to (files are in OUT/RUN/) [default: the run's, if known]"
)
@_redis_option
@settings_options(RunConfig, only=("chunk_size", "store_dtype", "prenorm", "layer_ids", "model_id"))
@click.option(
    "--server-dump-dir",
    "server_dump_dirs",
    multiple=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="dump dir of one of the run's servers (repeatable): its readiness marker says the "
    "model and layers the run uses",
)
@click.option("--no-progress", is_flag=True)
def recover(
    dataset: Path | None,
    run: str,
    out: Path | None,
    redis_url: str,
    chunk_size: int,
    store_dtype: str,
    prenorm: bool,
    layer_ids: list[int] | None,
    model_id: str | None,
    server_dump_dirs: tuple[Path, ...],
    no_progress: bool,
) -> None:
    """Rebuild a run's Redis state from its output files (after a Redis loss).

    Every file under OUT/RUN/ is checked against its DATASET line (header, every tensor,
    token ids, finite values); valid ones are marked done with their checksum, the rest of
    the dataset is enqueued. Safe to run on a live run: it only adds what is missing.
    The run's model and layers are its recorded ones, else --model-id/--layers, else what
    the readiness markers in --server-dump-dir say, else what most files hold (a tie is
    refused); files of another model or layers are stale: reported and enqueued again.
    Symlinks are never adopted.

    \b
    Example (Redis was wiped; HSQ_REDIS_URL set):
      hsq recover data.jsonl --run kimi-v1 --out /shared/hs --server-dump-dir /dev/shm/hsq0
    """
    from hsq.producer.enqueue import IdentityHint, recover_run
    from hsq.runstore import RunStore
    from hsq.store import connect

    store = RunStore(connect(redis_url), run)
    known = store.load_config()
    hint = IdentityHint(model_id, layer_ids, _announced(server_dump_dirs))
    if known is not None:
        given = [
            f"{name}: recorded {rec}, given {arg}"
            for name, rec, arg in (("dataset", known.dataset, dataset), ("out", known.out, out))
            if arg is not None and Path(rec) != arg.resolve()
        ]
        given += [
            f"{name}: recorded {rec!r}, given {arg!r}"
            for name, rec, arg in (("model_id", known.model_id, model_id),
                                   ("layer_ids", known.layer_ids, layer_ids))
            if arg is not None and rec is not None and rec != arg
        ]  # fmt: skip
        if given:
            raise ConfigError(f"run {run!r} exists with other settings: " + "; ".join(given))
        cfg = known
    elif dataset is None or out is None:
        raise ConfigError(f"run {run!r} is not in Redis: give DATASET and --out to recover it")
    else:
        from hsq.adopt import detect_prenorm, detect_store_dtype

        root = out.resolve()
        if not _given("store_dtype"):  # what most files say the run stored
            store_dtype = detect_store_dtype(root / run) or store_dtype
        if not _given("prenorm"):
            prenorm = bool(detect_prenorm(root / run))
        cfg = RunConfig(
            run=run,
            dataset=str(dataset.resolve()),
            out=str(root),
            chunk_size=chunk_size,
            store_dtype=store_dtype,
            prenorm=prenorm,
        )
    report = recover_run(store, cfg, progress=not no_progress, hint=hint)
    for line in report.lines_out() + report.recover_lines():
        click.echo(line)
    for sid, why in list(report.rejected_files.items())[:10]:
        click.echo(f"  rejected file of {sid}: {why}", err=True)


def _announced(dump_dirs: tuple[Path, ...]) -> tuple[str, list[int]] | None:
    """The model and layers the readiness markers in these dump dirs announce (they must
    agree); None without dirs."""
    from hsq.protocol import read_ready

    seen: dict[tuple[str, tuple[int, ...]], Path] = {}
    for d in dump_dirs:
        marker = read_ready(d)
        if marker is None:
            raise ConfigError(f"--server-dump-dir {d} holds no readiness marker (hsq-ready.json)")
        seen.setdefault((marker.model.model_id, tuple(marker.layer_ids)), d)
    if len(seen) > 1:
        said = "; ".join(f"{d}: {m} layers {list(ls)}" for (m, ls), d in seen.items())
        raise ConfigError(f"the servers announce different models or layers: {said}")
    if not seen:
        return None
    (model, layers), _ = seen.popitem()
    return model, list(layers)


@cli.command("worker")
@_redis_option
@settings_options(WorkerSettings, skip=("redis_url",))
def worker(**values: Any) -> None:
    """Extract samples of a run through one inference server.

    \b
    Example:
      hsq worker --run kimi-v1 --server http://127.0.0.1:30000 --dump-dir /dev/shm/hsq0
    """
    from hsq.workers.worker import run_worker

    rc = run_worker(WorkerSettings(**values))
    # Everything is released (jobs, registration, dump dir lock) and `worker_stopped` is
    # logged: skip the interpreter's teardown, which takes seconds once torch is loaded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


@cli.command("demo")
@click.option("--samples", default=300, show_default=True, type=int)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("demo-out"),
    show_default=True,
)
@click.option(
    "--redis",
    "redis_url",
    envvar="REDIS_URL",
    default=None,
    help="use this Redis instead of starting a private one",
)
@click.option("--seed", default=0, show_default=True, type=int)
def demo(samples: int, out: Path, redis_url: str | None, seed: int) -> None:
    """Extract a synthetic dataset end to end on this machine, then verify every output.

    Starts a private redis-server (unless --redis/REDIS_URL), a reference server with the
    tiny model, the producer and a worker.

    \b
    Example:
      hsq demo --samples 300
    """
    from hsq.app.demo import run_demo

    sys.exit(run_demo(samples=samples, out=out, redis_url=redis_url, seed=seed))


def _store(redis_url: str, run: str) -> Any:
    from hsq.runstore import RunStore
    from hsq.store import connect

    st = RunStore(connect(redis_url), run)
    st.require_config()  # an unknown run is a usage error (exit 2), said in plain words
    return st


@cli.command("status")
@click.option("--run", default=None, envvar="HSQ_RUN", help="one run [default: every run]")
@_redis_option
@click.option("--json", "as_json", is_flag=True, help="one JSON object per run (stable keys)")
@click.option("--watch", is_flag=True, help="refresh in place until Ctrl-C")
@click.option("--interval", default=2.0, show_default=True, type=float)
@click.option(
    "--recount",
    is_flag=True,
    help="re-derive the run's counters from its queues and hashes first (O(samples); status "
    "does it by itself when they are missing or disagree with the queues)",
)
def status(
    run: str | None, redis_url: str, as_json: bool, watch: bool, interval: float, recount: bool
) -> None:
    """How far along a run is: counts, rate, ETA, workers, dead letter by reason.

    Reads a handful of counters per run, whatever its size (docs/queue.md, "Counters").

    \b
    Example:
      hsq status --run kimi-v1 --watch
      hsq status --json | jq .done
    JSON keys: run, total, done, queued, in_progress, retry, dead, missing, invalid_lines,
    tokens_done, tokens_total, bytes_done, samples_per_s, tokens_per_s, eta_s,
    dead_by_reason, workers (docs/operations.md).
    """
    from hsq.app.ops import dumps_json, run_status, status_text
    from hsq.runstore import RunStore
    from hsq.store import connect, list_runs

    client = connect(redis_url)
    runs = [run] if run else list_runs(client)
    if run:
        _store(redis_url, run)
    first = True
    while True:
        reports = [run_status(RunStore(client, r), recount_first=recount and first) for r in runs]
        first = False
        if as_json:
            out = "\n".join(dumps_json(r.to_dict()) for r in reports)
        else:
            out = "\n".join("\n".join(status_text(r)) for r in reports) or "no runs"
        if watch:
            click.echo("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + "\n" + out)
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                return
        else:
            click.echo(out)
            return


@cli.command("requeue")
@_run_option
@_redis_option
@click.option("--failed", is_flag=True, help="every sample in the dead letter")
@click.option("--reason", default=None, help="dead-letter samples with this reason")
@click.option("--sample", "samples", multiple=True, help="these sample ids (repeatable)")
@click.option("--missing", is_flag=True, help="samples in no queue, not done and not dead")
@click.option("--dry-run", is_flag=True, help="say what would be requeued, change nothing")
def requeue(
    run: str,
    redis_url: str,
    failed: bool,
    reason: str | None,
    samples: tuple[str, ...],
    missing: bool,
    dry_run: bool,
) -> None:
    """Put failed, chosen or lost samples back in the queue (idempotent).

    \b
    Examples:
      hsq requeue --run kimi-v1 --failed --dry-run
      hsq requeue --run kimi-v1 --reason stale_dump
      hsq requeue --run kimi-v1 --sample s000042 --sample s000043
      hsq requeue --run kimi-v1 --missing
    """
    from hsq.app.ops import requeue as do_requeue
    from hsq.app.ops import select_for_requeue

    if not (failed or reason or samples or missing):
        raise click.UsageError("say what to requeue: --failed, --reason, --sample or --missing")
    st = _store(redis_url, run)
    ids, res = select_for_requeue(
        st, failed=failed, reason=reason, samples=samples, missing=missing
    )
    do_requeue(st, ids, res, dry_run=dry_run)
    verb = "would requeue" if dry_run else "requeued"
    click.echo(f"selected {res.selected}, {verb} {res.enqueued}")
    for why, sids in res.skipped.items():
        shown = ", ".join(sids[:10]) + (" ..." if len(sids) > 10 else "")
        click.echo(f"skipped {len(sids)}: {why}: {shown}")


def _mounted_out_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """--out (the run's output root as mounted here) and --no-progress, for commands that
    read a run's files."""
    f = click.option("--no-progress", is_flag=True)(f)
    return _out_root_option("output root if it is mounted elsewhere here [default: the run's]")(f)


def _file_progress(total: int, desc: str, off: bool) -> Any:
    """A progress bar over a run's files, on stderr (stdout carries the report)."""
    return progress(total, "file", desc, enabled=not off)


@cli.command("verify")
@_run_option
@_redis_option
@click.option("--deep", is_flag=True, help="read every byte: checksum, tensors, finite values")
@click.option(
    "--requeue",
    "do_requeue",
    is_flag=True,
    help="un-done missing and corrupt samples (corrupt files removed) and requeue",
)
@_mounted_out_option
@click.option(
    "--jobs",
    default=None,
    type=click.IntRange(min=1),
    help="processes checking files [default: the CPUs, from 20,000 samples]",
)
def verify(
    run: str,
    redis_url: str,
    deep: bool,
    do_requeue: bool,
    out: Path | None,
    no_progress: bool,
    jobs: int | None,
) -> None:
    """Check every output file against the run's manifest; exit 1 if anything is wrong.

    Reads only headers (size, names, shapes, token count) unless --deep. Reports missing
    and corrupt files, and orphans (files no manifest entry claims).

    \b
    Example:
      hsq verify --run kimi-v1 --deep --requeue
    """

    from hsq.app.ops import repair
    from hsq.app.ops import verify as do_verify

    st = _store(redis_url, run)
    cfg = st.require_config()
    root = (out or Path(cfg.out)) / run
    with _file_progress(st.count(st.keys.done), "verifying", no_progress) as bar:
        res = do_verify(st, root, deep=deep, on_progress=bar.update, jobs=jobs)
    click.echo(
        f"checked {res.checked}: ok {res.ok}, missing {len(res.missing)}, "
        f"corrupt {len(res.corrupt)}, orphans {len(res.orphans)}, refused {len(res.refused)}"
    )
    for sid in res.missing[:20]:
        click.echo(f"  missing  {sid}")
    for sid, problems in list(res.corrupt.items())[:20]:
        click.echo(f"  corrupt  {sid}: {'; '.join(problems)}")
    for rel in res.orphans[:20]:
        click.echo(f"  orphan   {rel}")
    for sid, why in list(res.refused.items())[:20]:
        click.echo(f"  refused  {sid}: manifest entry not trusted ({why}); left alone")
    if do_requeue and (res.missing or res.corrupt):
        n = repair(st, root, res)
        click.echo(f"requeued {n} samples")
    if res.problems:
        sys.exit(EXIT_PROBLEMS)


@cli.command("audit")
@_run_option
@_redis_option
@click.option(
    "--sample-fraction",
    "fraction",
    type=float,
    required=True,
    help="fraction of the done samples to re-extract, chosen at random (0 < F <= 1)",
)
@click.option("--server", required=True, help="inference server URL the audit may use alone")
@click.option(
    "--dump-dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="that server's dump dir; the audit takes it as a worker does (refused while a "
    "worker holds it)",
)
@click.option("--requeue", "do_requeue", is_flag=True, help="un-done and requeue mismatches")
@click.option("--seed", type=int, default=None, help="which samples [default: random, printed]")
@click.option("--dump-timeout", default=60.0, show_default=True, type=float)
@click.option("--dump-dir-force", is_flag=True, help="use a dump dir that looks shared")
@_mounted_out_option
def audit(
    run: str,
    redis_url: str,
    fraction: float,
    server: str,
    dump_dir: Path,
    do_requeue: bool,
    seed: int | None,
    dump_timeout: float,
    dump_dir_force: bool,
    out: Path | None,
    no_progress: bool,
) -> None:
    """Re-extract a random subset of done samples alone and compare with the stored states.

    No check on a dump's metadata can tell that a batching server put one request's rid,
    fingerprint and token count on another request's states: they are saved as valid and
    `verify --deep` passes. The audit sends each chosen sample alone (one request at a
    time, so alone in its batch) to --server, through --dump-dir (which it owns while it
    runs), and compares with the stored file within the reference tolerance (per token:
    cosine >= 0.999, max |diff| <= 1% of the norm). Exit 1 on any mismatch or a sample it
    could not audit. Workers can audit continuously too: `hsq worker --audit-fraction F`.

    \b
    Example (a spare server; HSQ_REDIS_URL set):
      hsq audit --run kimi-v1 --sample-fraction 0.01 --server http://127.0.0.1:30009 \\
          --dump-dir /dev/shm/hsq-audit --requeue
    """
    from hsq.app.audit import run_audit

    st = _store(redis_url, run)
    root = (out or Path(st.require_config().out)) / run
    with _file_progress(0, "auditing", no_progress) as bar:
        report = run_audit(
            st,
            server=server,
            dump_dir=dump_dir,
            fraction=fraction,
            out_root=root,
            seed=seed,
            do_requeue=do_requeue,
            dump_timeout_s=dump_timeout,
            dump_dir_force=dump_dir_force,
            on_progress=bar.update,
        )
    for line in report.lines_out():
        click.echo(line)
    for sid, why in list(report.mismatched.items())[:50]:
        click.echo(f"  mismatch  {sid}: {why}")
    for sid, why in list(report.failed.items())[:20]:
        click.echo(f"  failed    {sid}: {why}")
    if report.mismatched or report.failed:
        sys.exit(EXIT_PROBLEMS)


@cli.command("export")
@_run_option
@_redis_option
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["specforge", "speculators", "manifest"]),
    required=True,
    help="specforge: <shard>/<id>.ckpt files for SpecForge's offline trainer; speculators: "
    "the Arrow dataset and hidden_states/hs_<i>.safetensors vLLM speculators reads (runs with "
    "the pre-norm state); manifest: OUT/RUN/manifest.jsonl for hsq.data",
)
@click.option(
    "--to",
    "dest",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="destination directory (specforge, speculators)",
)
@click.option("--jobs", default=4, show_default=True, type=int, help="files written at once")
@click.option("--partial", is_flag=True, help="export a run that is not complete yet")
@click.option(
    "--expect-layers",
    default=None,
    help="refuse unless the run captured these layer ids (HF hidden_states indices)",
)
@click.option(
    "--prune",
    is_flag=True,
    help="remove files under the export's names in --to that are not this run's current "
    "output (without it they are listed and the export exits 1)",
)
@click.option(
    "--target-model",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="specforge: the local HF checkpoint the run extracted from; writes "
    "--to/draft_config.json with the run's layer ids in SGLang's numbering (eagle_config)",
)
@click.option(
    "--target-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="specforge, with --target-model: write SpecForge's model.target_model_path here "
    "(config.json, embedding and LM head, index file)",
)
@click.option(
    "--draft-vocab-size",
    type=click.IntRange(min=1),
    default=None,
    help="draft_config.json's draft vocabulary [default: min(32000, the target's)]",
)
@_mounted_out_option
def export(
    run: str,
    redis_url: str,
    fmt: str,
    dest: Path | None,
    jobs: int,
    partial: bool,
    expect_layers: str | None,
    prune: bool,
    target_model: Path | None,
    target_dir: Path | None,
    draft_vocab_size: int | None,
    out: Path | None,
    no_progress: bool,
) -> None:
    """Write a run's outputs in the layout a trainer reads.

    Every output is checked first as `verify --deep` does (checksum, finite states); a
    corrupt one fails with its reason and is not exported. Resumable: a file already
    there is skipped only if it is this run's current output (the export's ledger records
    each file's source checksum), so running it again writes nothing; anything else under
    the export's names is rewritten. A killed export leaves only dot-named .tmp files.

    \b
    Example:
      hsq export --run q3 --format specforge --to /shared/specforge/q3 --jobs 8 \\
          --target-model /models/qwen3-8b --target-dir /shared/specforge/q3-target
      specforge train --config cfg.yaml   # docs/training.md
    """

    from hsq.app.export import export_manifest, export_specforge, export_speculators

    st = _store(redis_url, run)
    cfg = st.require_config()
    root = (out or Path(cfg.out)) / run
    if fmt == "manifest":
        n = export_manifest(st, root, partial=partial)
        click.echo(f"wrote {root / 'manifest.jsonl'}: {n} samples")
        return
    if dest is None:
        raise ConfigError(f"--format {fmt} needs --to DIR")
    if (target_model or target_dir or draft_vocab_size) and fmt != "specforge":
        raise ConfigError("--target-model, --target-dir and --draft-vocab-size are for specforge")
    if target_dir is not None and target_model is None:
        raise ConfigError("--target-dir needs --target-model CKPT (the checkpoint to read)")
    layers = _layers(expect_layers)
    config = None
    if target_model is not None:
        from hsq.app.export.target import check_run_matches, load_config

        config = load_config(target_model)
        check_run_matches(config, cfg.hidden_size, cfg.layer_ids)
    exporter = export_specforge if fmt == "specforge" else export_speculators
    with _file_progress(st.count(st.keys.done), "exporting", no_progress) as bar:
        report = exporter(
            st,
            root,
            dest,
            jobs=jobs,
            partial=partial,
            expect_layers=list(layers) if layers else None,
            prune=prune,
            on_progress=bar.update,
        )
    if target_model is not None and config is not None:
        _write_target(
            report, config, target_model, target_dir, dest, cfg.layer_ids, draft_vocab_size
        )
    for line in report.lines_out():
        click.echo(line)
    for sid, err in list(report.failed.items())[:20]:
        click.echo(f"  failed  {sid}: {err}", err=True)
    for rel in report.stale[:20]:
        click.echo(f"  stale   {rel}: not this run's current output (--prune removes it)", err=True)
    if not report.ok:
        sys.exit(EXIT_PROBLEMS)


def _write_target(
    report: Any,
    config: dict[str, Any],
    checkpoint: Path,
    target_dir: Path | None,
    dest: Path,
    layers: list[int] | None,
    draft_vocab_size: int | None,
) -> None:
    """draft_config.json beside the export, and the target dir if asked for."""
    from hsq.app.export.target import write_draft_config, write_target_dir

    if layers is None:
        report.notes.append("draft_config.json not written: the run has no recorded layers")
    else:
        path, ids = write_draft_config(config, dest, layers, draft_vocab_size)
        if ids is None:
            report.notes.append(
                f"wrote {path} WITHOUT eagle_config: no SGLang id list captures HF layers "
                f"{layers} on this architecture; set eagle_aux_hidden_state_layer_ids yourself "
                "(docs/sglang.md#layer-ids)"
            )
        else:
            report.notes.append(f"wrote {path}: eagle_aux_hidden_state_layer_ids {ids}")
    if target_dir is not None:
        names = write_target_dir(checkpoint, target_dir)
        report.notes.append(f"wrote {target_dir}: {', '.join(names)}")


@cli.command("runs")
@_redis_option
def runs(redis_url: str) -> None:
    """List runs with their progress.

    \b
    Example:
      hsq runs --redis-url-file /run/secrets/redis_url
    """
    from hsq.app.ops import run_figures
    from hsq.runstore import RunStore
    from hsq.store import connect, list_runs

    client = connect(redis_url)
    names = list_runs(client)
    if not names:
        click.echo("no runs")
    for name in names:
        fig = run_figures(RunStore(client, name))
        click.echo(f"{name}  done {fig.done}/{fig.total}  dead {fig.dead}")


@cli.command("acl")
@click.option("--run", required=True, help="run name")
@click.option("--user", default=None, help="ACL user name [default: hsq-RUN]")
def acl(run: str, user: str | None) -> None:
    """Print a Redis ACL user that can work on one run only.

    It can enqueue, run workers, status/requeue/verify/recover/audit/purge that run, and
    cannot read, change or list another run's keys (docs/operations.md). Put the line in
    Redis's ACL file with a real password in place of <PASSWORD>, then `ACL LOAD`; never
    pass a password to redis-cli as an argument.

    \b
    Example:
      hsq acl --run kimi-v1 >> /etc/redis/users.acl   # then edit <PASSWORD>
    """
    from hsq.keys import RunKeys

    try:
        keys = RunKeys(run)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    click.echo(keys.acl_user(user))


@cli.command("purge")
@click.option("--run", required=True)
@_redis_option
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
def purge(run: str, redis_url: str, yes: bool) -> None:
    """Delete a run's Redis state (queues, done, dead letter). Output files stay on disk.

    \b
    Example:
      hsq purge --run old-run --yes
    """
    from hsq.app.ops import purge as do_purge

    st = _store(redis_url, run)
    if not yes:
        click.confirm(
            f"delete every Redis key of run {run!r} ({st.count(st.keys.done)} done entries)?",
            abort=True,
        )
    n = do_purge(st)
    click.echo(f"purged run {run}: {n} keys deleted; output files untouched")


@cli.command("exporter")
@_redis_option
@click.option("--port", default=9640, show_default=True, type=int, envvar="HSQ_EXPORTER_PORT")
@click.option(
    "--metrics-host",
    "--host",
    "host",
    default="127.0.0.1",
    show_default=True,
    envvar="HSQ_EXPORTER_HOST",
    help="address to bind; 0.0.0.0 to let Prometheus on another host scrape it",
)
def exporter(redis_url: str, port: int, host: str) -> None:
    """Serve queue-level Prometheus metrics for every run in a Redis.

    \b
    Example:
      hsq exporter --redis-url-file /run/secrets/redis_url --port 9640 --metrics-host 0.0.0.0
    """
    from hsq.app.exporter import run_exporter

    run_exporter(redis_url, host, port)


@cli.command(
    "launch-sglang",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option("--model-path", required=True)
@click.option(
    "--dump-dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    envvar="SGLANG_HS_DUMP_DIR",
    help="the dump dir the worker owns (node-local tmpfs)",
)
@click.option(
    "--layers",
    default=None,
    help="EAGLE-3 aux layer ids as the drafter config names them [default: SGLang's]",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=30000, show_default=True, type=int)
@click.option("--tp", "tp_size", default=1, show_default=True, type=int)
@click.option(
    "--sglang-version",
    default=None,
    help="[default: the installed one] decides plugin (>= 0.5.11) or launcher",
)
@click.option(
    "--dump-encoding",
    type=click.Choice(["plain", "fp8-e4m3"]),
    default="plain",
    show_default=True,
    help="fp8-e4m3: the GPU quantizes the states as fp8 outputs store them (for runs "
    "enqueued with --store-dtype fp8-e4m3)",
)
@click.option(
    "--prenorm", is_flag=True, help="also dump the final norm's input (runs with --prenorm)"
)
@click.option("--print-only", is_flag=True, help="print the command, start nothing")
@click.option("--start-timeout", default=1800.0, show_default=True, type=float)
@click.pass_context
def launch_sglang(
    ctx: click.Context,
    model_path: str,
    dump_dir: Path,
    layers: str | None,
    host: str,
    port: int,
    tp_size: int,
    sglang_version: str | None,
    dump_encoding: str,
    prenorm: bool,
    print_only: bool,
    start_timeout: float,
) -> None:
    """Start a stock SGLang server that dumps hidden states, then check that it does.

    Sets the required flags (--disable-radix-cache, prefill CUDA graphs off) and the hook's
    environment; extra arguments go to SGLang unchanged. Once healthy, checks /server_info
    and the hook's readiness marker in the dump dir, and prints the effective layers to
    pin with `hsq enqueue --layers`. Exits 2 if the server's settings would produce wrong
    dumps or its hook is not active (docs/sglang.md).

    \b
    Example:
      hsq launch-sglang --model-path /models/kimi-k2.5 --tp 8 --dump-dir /dev/shm/hsq0
    """
    import shlex

    from hsq.sglang_server.sglang_hook.launch_sglang import run_checked

    sys.exit(
        run_checked(
            model_path=model_path,
            dump_dir=dump_dir,
            layers=_layers(layers),
            host=host,
            port=port,
            tp_size=tp_size,
            sglang_version=sglang_version,
            encoding=dump_encoding,
            prenorm=prenorm,
            extra=list(ctx.args),
            print_only=print_only,
            start_timeout=start_timeout,
            echo=click.echo,
            quote=shlex.join,
        )
    )


# Expected failures: one line on stderr and an exit code (docs/operations.md), never a
# traceback. The first matching class wins: ConfigError and StoreError are HsqErrors.
_EXIT_CODES: tuple[tuple[type[Exception], int], ...] = (
    (ConfigError, EXIT_USAGE),
    (StoreError, EXIT_REDIS),
    (HsqError, EXIT_PROBLEMS),
    (OSError, EXIT_PROBLEMS),
)


def main() -> None:
    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(EXIT_PROBLEMS)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_USAGE)
    except (HsqError, OSError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(next(code for kind, code in _EXIT_CODES if isinstance(exc, kind)))


if __name__ == "__main__":
    main()
