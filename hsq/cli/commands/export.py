"""`hsq export`: a run's outputs in the layout a trainer reads (hsq/ops/export/)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hsq import extras
from hsq.cli.command import hsq_command
from hsq.cli.flags import MountedOut, RedisFlags, RunName
from hsq.cli.options import settings_options, take
from hsq.errors import EXIT_PROBLEMS, ConfigError
from hsq.settings import int_tuple_or_none, setting

if TYPE_CHECKING:
    from hsq.ops.export import ExportReport

FORMATS = ("specforge", "speculators", "manifest")
EXTRA_OF_FORMAT = {"specforge": "export", "speculators": "speculators"}


@dataclass(frozen=True)
class ExportFlags:
    format: str = setting(
        choices=FORMATS,
        help="specforge: <shard>/<id>.ckpt files for SpecForge's offline trainer; speculators: "
        "the Arrow dataset and hidden_states/hs_<i>.safetensors vLLM speculators reads (runs "
        "with the pre-norm state); manifest: OUT/RUN/manifest.jsonl for hsq.data",
    )
    dest: Path | None = setting(
        None, flag="--to", path="dir", help="destination directory (specforge, speculators)"
    )
    # Threads, as verify's --read-threads: `--jobs` is processes in verify and tokenize.
    write_threads: int = setting(
        4, minimum=1, deprecated=("--jobs",), help="threads writing files, at once"
    )
    partial: bool = setting(False, help="export a run that is not complete yet")
    expect_layers: tuple[int, ...] | None = setting(
        None,
        parse=int_tuple_or_none,
        help="refuse unless the run captured these layer ids (HF hidden_states indices)",
    )
    prune: bool = setting(
        False,
        flag_only=True,
        help="remove files under the export's names in --to that are not this run's current "
        "output (without it they are listed and the export exits 1)",
    )
    target_model: Path | None = setting(
        None,
        path="dir",
        exists=True,
        help="specforge: the local HF checkpoint the run extracted from; writes "
        "--to/draft_config.json with the run's layer ids in SGLang's numbering (eagle_config)",
    )
    target_dir: Path | None = setting(
        None,
        path="dir",
        help="specforge, with --target-model: write SpecForge's model.target_model_path here "
        "(config.json, embedding and LM head, index file)",
    )
    draft_vocab_size: int | None = setting(
        None,
        minimum=1,
        default_text="min(32000, the target's)",
        help="draft_config.json's draft vocabulary",
    )


@hsq_command("export")
@settings_options(RunName)
@settings_options(RedisFlags)
@settings_options(ExportFlags)
@settings_options(MountedOut)
def export(**values: Any) -> None:
    """Write a run's outputs in the layout a trainer reads.

    Every output is checked first as `verify --deep` does (checksum, finite states); a
    corrupt one fails with its reason and is not exported. Resumable: a file already
    there is skipped only if it is this run's current output (the export's ledger records
    each file's source checksum), so running it again writes nothing; anything else under
    the export's names is rewritten. A killed export leaves only dot-named .tmp files.

    \b
    Example:
      hsq export --run q3 --format specforge --to /shared/specforge/q3 --write-threads 8 \\
          --target-model /models/qwen3-8b --target-dir /shared/specforge/q3-target
      specforge train --config cfg.yaml   # docs/training.md
    """
    from hsq.ops.export import (
        ExportRequest,
        export_manifest,
        export_specforge,
        export_speculators,
    )

    f = take(ExportFlags, values)
    if f.format != "manifest":  # before Redis or the disk is touched
        extras.require(EXTRA_OF_FORMAT[f.format], f"hsq export --format {f.format}")
    st = take(RedisFlags, values).run_store(take(RunName, values).run)
    mounted = take(MountedOut, values)
    cfg = st.require_config()
    root = mounted.run_dir(st)
    if f.format == "manifest":
        n = export_manifest(st, root, partial=f.partial)
        click.echo(f"wrote {root / 'manifest.jsonl'}: {n} samples")
        return
    if f.dest is None:
        raise ConfigError(f"--format {f.format} needs --to DIR")
    if f.format == "speculators":  # before any progress: the run's record says it all
        from hsq.ops.export.speculators import require_prenorm_run

        require_prenorm_run(cfg.prenorm, st.run)
    if (f.target_model or f.target_dir or f.draft_vocab_size) and f.format != "specforge":
        raise ConfigError("--target-model, --target-dir and --draft-vocab-size are for specforge")
    if f.target_dir is not None and f.target_model is None:
        raise ConfigError("--target-dir needs --target-model CKPT (the checkpoint to read)")
    config = None
    if f.target_model is not None:
        from hsq.ops.export.target import check_run_matches, load_config

        config = load_config(f.target_model)
        check_run_matches(config, cfg.hidden_size, cfg.layer_ids)
    exporter = export_specforge if f.format == "specforge" else export_speculators
    with mounted.progress(st.count(st.keys.done), "exporting") as bar:
        req = ExportRequest(
            root,
            f.dest,
            jobs=f.write_threads,
            partial=f.partial,
            expect_layers=list(f.expect_layers) if f.expect_layers else None,
            prune=f.prune,
            on_progress=bar.update,
        )
        report = exporter(st, req)
    if f.target_model is not None and config is not None:
        _write_target(report, config, f.target_model, f.dest, f, cfg.layer_ids)
    for line in report.lines_out():
        click.echo(line)
    for sid, err in list(report.failed.items())[:20]:
        click.echo(f"  failed  {sid}: {err}", err=True)
    for rel in report.stale[:20]:
        click.echo(f"  stale   {rel}: not this run's current output (--prune removes it)", err=True)
    if not report.ok:
        sys.exit(EXIT_PROBLEMS)


def _write_target(
    report: ExportReport,
    config: dict[str, Any],
    checkpoint: Path,
    dest: Path,
    f: ExportFlags,
    layers: list[int] | None,
) -> None:
    """draft_config.json beside the export, and the target dir if asked for."""
    from hsq.ops.export.target import write_draft_config, write_target_dir

    if layers is None:
        report.notes.append("draft_config.json not written: the run has no recorded layers")
    else:
        path, ids = write_draft_config(config, dest, layers, f.draft_vocab_size)
        if ids is None:
            report.notes.append(
                f"wrote {path} WITHOUT eagle_config: no SGLang id list captures HF layers "
                f"{layers} on this architecture; set eagle_aux_hidden_state_layer_ids yourself "
                "(docs/sglang.md#layer-ids)"
            )
        else:
            report.notes.append(f"wrote {path}: eagle_aux_hidden_state_layer_ids {ids}")
    if f.target_dir is not None:
        names = write_target_dir(checkpoint, f.target_dir)
        report.notes.append(f"wrote {f.target_dir}: {', '.join(names)}")
