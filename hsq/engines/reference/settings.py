"""The reference server's settings: each field is a flag of `hsq serve-reference` and an
HSQ_* variable (hsq.settings). No torch here: `hsq --help` must start fast."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hsq.errors import ConfigError
from hsq.settings import int_tuple, setting
from hsq.states import ENCODINGS, PLAIN

TUNING = "Batching and writing"
"""--help's headings (hsq/cli/command.py): how the server batches and writes dumps, and
what tests and demos drive it with."""
TESTING = "Tests and demos"


@dataclass(frozen=True)
class ReferenceSettings:
    dump_dir: Path = setting(
        help="where dumps are written (the worker's --dump-dir)", env=("SGLANG_HS_DUMP_DIR",)
    )
    model: str = setting(
        "tiny",
        help="`tiny` (seeded random Llama for CPU), `llama-8b` (random weights, 8B shape) or "
        "a local HF checkpoint path",
    )
    device: str = setting("cpu", help="cpu, cuda or cuda:N")
    dtype: str | None = setting(
        None, help="compute dtype", default_text="float32 on cpu, bfloat16 on cuda"
    )
    dump_dtype: str = setting("bfloat16", help="dtype of the dumped hidden states")
    dump_encoding: str = setting(
        PLAIN,
        choices=ENCODINGS,
        help="plain: states in --dump-dtype; fp8-e4m3: quantized on the device exactly as "
        "fp8 outputs store them (half the dump bytes; the worker only validates and copies); "
        "only runs enqueued with --store-dtype fp8-e4m3 accept such dumps",
    )
    prenorm: bool = setting(
        False,
        help="also dump the final layer's output before the final norm "
        "(last_hidden_state_prenorm), for runs enqueued with --prenorm",
    )
    layers: tuple[int, ...] | None = setting(
        None,
        help="aux layer ids in HF hidden_states indexing, comma-separated",
        parse=int_tuple,
        default_text="EAGLE-3's 2,L//2,L-3",
    )
    host: str = setting("127.0.0.1", help="address to listen on")
    port: int = setting(30000, help="port to listen on")
    max_tokens: int = setting(8192, help="longest request accepted, in tokens")
    max_batch_requests: int | None = setting(
        None,
        section=TUNING,
        help="concurrent requests gathered into one forward (1: one request at a time)",
        default_text="8 on cuda, 1 on cpu, where a batch costs its rows and padding",
    )
    max_batch_tokens: int = setting(
        16384,
        section=TUNING,
        help="tokens per batched forward (a longer single request still runs, alone)",
    )
    warmup_shapes: bool = setting(
        False,
        section=TUNING,
        help="on CUDA, run every padded batch shape once at start (first-use cost)",
    )
    warmup: int = setting(
        0, section=TUNING, help="requests the server sends itself at start; each creates a dump"
    )
    counter_start: int = setting(
        0,
        section=TESTING,
        help="first req_<N> index (simulates a counter moved by earlier requests)",
    )
    faults: tuple[str, ...] = setting(
        (),
        section=TESTING,
        help="fault rule MODE[:key=value,...], repeatable; see docs/reference-server.md",
        flag="--fault",
    )
    admin: bool = setting(
        False,
        section=TESTING,
        help="serve /admin/* (fault rules, pause/resume) for tests and demos; from loopback "
        "only, or from anywhere with --admin-token-file (then always with the token)",
    )
    admin_token_file: Path | None = setting(
        None,
        path="file",
        section=TESTING,
        help="file holding the token /admin/* requests must send (X-Hsq-Admin-Token or "
        "Authorization: Bearer); a file, never a flag value",
    )
    seed: int = setting(0, section=TESTING, help="seed of the tiny model's weights")
    writer_depth: int = setting(
        2, section=TUNING, help="dumps queued for the writer thread before requests block"
    )
    writer_threads: int = setting(
        1, section=TUNING, help="threads writing dumps (more only if one falls behind)"
    )
    fsync: bool = setting(True, section=TUNING, help="fsync dumps (--no-fsync for tmpfs dump dirs)")
    threads: int | None = setting(None, section=TUNING, help="torch CPU threads")
    ready_marker: bool = setting(
        True,
        help="write hsq-ready.json at start-up; off only to test workers against a hookless server",
        hidden=True,
    )

    @property
    def compute_dtype(self) -> str:
        return self.dtype or ("float32" if self.device == "cpu" else "bfloat16")

    def validate(self) -> None:
        from hsq.dump.format import DTYPES  # torch: only once the server starts

        for name in (self.compute_dtype, self.dump_dtype):
            if name not in DTYPES:
                raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
        if self.dump_encoding not in ENCODINGS:
            raise ConfigError(f"--dump-encoding must be one of {', '.join(ENCODINGS)}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be cpu or cuda[:N], not {self.device!r}")
        if self.max_tokens < 1 or self.warmup < 0 or self.counter_start < 0:
            raise ConfigError("--max-tokens must be >= 1, --warmup and --counter-start >= 0")
        if self.writer_threads < 1 or self.writer_depth < 1:
            raise ConfigError("--writer-threads and --writer-depth must be >= 1")
        if (self.max_batch_requests or 1) < 1 or self.max_batch_tokens < 1:
            raise ConfigError("--max-batch-requests and --max-batch-tokens must be >= 1")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port {self.port} out of range")
        if self.admin_token_file is not None and not self.admin:
            raise ConfigError("--admin-token-file needs --admin")
