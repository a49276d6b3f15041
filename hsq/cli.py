"""The `hsq` command line. Thin: parse flags (with env vars), build settings, call the core.

Exit codes: 0 ok, 1 problems found, 2 usage or configuration error, 3 Redis unreachable.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hsq import __version__
from hsq.errors import ConfigError, HsqError
from hsq.logs import configure

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_REDIS = 3


def _layers(value: str | None) -> tuple[int, ...] | None:
    if not value:
        return None
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from exc


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
@click.option(
    "--model",
    default="tiny",
    show_default=True,
    help="`tiny` (seeded random Llama for CPU), `llama-8b` (random weights, 8B "
    "shape) or a local HF checkpoint path.",
)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N")
@click.option(
    "--dtype", default=None, help="compute dtype [default: float32 on cpu, bfloat16 on cuda]"
)
@click.option("--dump-dtype", default="bfloat16", show_default=True)
@click.option(
    "--layers",
    default=None,
    help="aux layer ids in HF hidden_states indexing [default: EAGLE-3's 2,L//2,L-3]",
)
@click.option(
    "--dump-dir", type=click.Path(path_type=Path), required=True, envvar="SGLANG_HS_DUMP_DIR"
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=30000, show_default=True, type=int)
@click.option("--max-tokens", default=8192, show_default=True, type=int)
@click.option(
    "--warmup",
    default=0,
    show_default=True,
    type=int,
    help="requests the server sends itself at start; each creates a dump",
)
@click.option(
    "--counter-start",
    default=0,
    show_default=True,
    type=int,
    help="first req_<N> index (simulates a counter moved by earlier requests)",
)
@click.option(
    "--fault",
    "faults",
    multiple=True,
    help="fault rule MODE[:key=value,...], repeatable; see docs/reference-server.md",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--writer-depth",
    default=2,
    show_default=True,
    type=int,
    help="dumps queued for the writer thread before requests block",
)
@click.option("--no-fsync", is_flag=True, help="skip fsync of dumps (tmpfs dump dirs)")
@click.option("--threads", default=None, type=int, help="torch CPU threads")
def serve_reference(
    model: str,
    device: str,
    dtype: str | None,
    dump_dtype: str,
    layers: str | None,
    dump_dir: Path,
    host: str,
    port: int,
    max_tokens: int,
    warmup: int,
    counter_start: int,
    faults: tuple[str, ...],
    seed: int,
    writer_depth: int,
    no_fsync: bool,
    threads: int | None,
) -> None:
    """Serve a real transformer with SGLang's HTTP API, dumping hidden states per request.

    \b
    Example:
      hsq serve-reference --model tiny --dump-dir /tmp/dumps --port 30000
      hsq serve-reference --model /models/llama --device cuda --dump-dir /dev/shm/d0
    """
    from sglang_server.reference.app import ReferenceSettings, serve

    settings = ReferenceSettings(
        model=model,
        device=device,
        dtype=dtype or ("float32" if device == "cpu" else "bfloat16"),
        dump_dtype=dump_dtype,
        layers=_layers(layers),
        dump_dir=dump_dir,
        host=host,
        port=port,
        max_tokens=max_tokens,
        warmup=warmup,
        counter_start=counter_start,
        faults=faults,
        seed=seed,
        writer_depth=writer_depth,
        fsync=not no_fsync,
        threads=threads,
    )
    serve(settings)


def main() -> None:
    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(EXIT_PROBLEMS)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_USAGE)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except HsqError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_PROBLEMS)
    except OSError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_PROBLEMS)


if __name__ == "__main__":
    main()
