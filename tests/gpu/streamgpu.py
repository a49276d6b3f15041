"""A trainer on the GPU over hsq's stream, for tests/gpu/test_sglang_stream.py: each item's
aux states go through a drafter-sized head (one linear layer, 3H -> H, float32 on CUDA)
against its last state, one Adam step per item, a commit every --every items; at the end
one JSON line: the ids trained (in order), the steps' GPU seconds and the dataset's own
data-wait figures (StreamingHiddenStateDataset.wait_stats: the share of its time the
trainer waited for data).

    python -m tests.gpu.streamgpu --run R --redis-url-file F [--group train] [--every 4]
        [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hsq.data import StreamingDataLoader, StreamingHiddenStateDataset


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--redis-url-file", type=Path, required=True)
    ap.add_argument("--group", default="train")
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    ds = StreamingHiddenStateDataset(a.run, redis_url_file=a.redis_url_file, group=a.group)
    loader = StreamingDataLoader(ds, batch_size=None, num_workers=0)
    head: torch.nn.Linear | None = None
    opt: torch.optim.Optimizer | None = None
    trained: list[str] = []
    step_s, since = 0.0, 0
    for item in loader:
        x = item["aux_hidden_states"].to(a.device, non_blocking=True).float()
        y = item["last_hidden_state"].to(a.device, non_blocking=True).float()
        if head is None:
            head = torch.nn.Linear(x.shape[1], y.shape[1], device=a.device)
            opt = torch.optim.Adam(head.parameters(), lr=1e-4)
        assert opt is not None
        t = time.perf_counter()
        loss = torch.nn.functional.mse_loss(head(x), y)
        loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        step_s += time.perf_counter() - t
        trained.append(str(item["id"]))
        since += 1
        if since >= a.every:
            ds.commit(ds.state_dict())
            since = 0
    ds.commit(ds.state_dict())
    out = {"trained": trained, "step_s": round(step_s, 3), "wait": ds.wait_stats()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
