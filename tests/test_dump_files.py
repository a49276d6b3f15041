"""hsq/engines/common.DumpFiles when a dump cannot be written: the write fails for real
(RLIMIT_FSIZE in a child process: the kernel refuses the tensor file with EFBIG, as a full
tmpfs refuses it with ENOSPC), the failure is counted and logged, and no torn req_<N>.tmp
is left holding the dump dir's space."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, logging, resource, signal, sys
from pathlib import Path
import torch
from hsq.engines.common import DumpContext, DumpFiles, model_identity

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
dump_dir, limit, tokens = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ident = model_identity("m", "LlamaForCausalLM", 4, 64, {"hidden_size": 64})
files = DumpFiles(dump_dir, DumpContext(ident, [1, 2]), fsync=False,
                  log=logging.getLogger("t"), tag="test")
ids = torch.arange(tokens)
tensors = {"aux_hidden_states": torch.ones(tokens, 128, dtype=torch.bfloat16),
           "last_hidden_state": torch.ones(tokens, 64, dtype=torch.bfloat16)}
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
path = files.store("hsq-s1-a0-00000000", ids, tensors, hidden_size=64, dtype=torch.bfloat16)
print(json.dumps({"path": str(path) if path else None, "errors": files.errors}))
"""


def _store(dump_dir: Path, limit: int, tokens: int) -> dict[str, object]:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(dump_dir), str(limit), str(tokens)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    got: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return got


def test_a_dump_too_large_to_write_leaves_nothing(tmp_path: Path) -> None:
    got = _store(tmp_path, 64 * 1024, 4096)  # 1.5 MiB of states, 64 KiB allowed
    assert got == {"path": None, "errors": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_dump_that_fits_is_written(tmp_path: Path) -> None:
    got = _store(tmp_path, 64 * 1024 * 1024, 16)
    assert got["errors"] == 0 and got["path"] == str(tmp_path / "req_0")
    assert (tmp_path / "req_0" / "done").exists()
