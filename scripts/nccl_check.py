#!/usr/bin/env python3
"""tqbench's collectives over MLX's NCCL backend, on however many GPUs the launcher gives (one is enough to run it).

The pipeline's messages between ranks are `tqbench.distributed.world`'s: `agree` (a uint8 all_gather of every rank's
load error) and `gather_stats` (an int64 row per rank, gathered as uint8). The CPU tests run them over the ring
backend; this runs the same functions over NCCL, where the dtypes and the group come from MLX's CUDA build.

    # one GPU, one rank (no launcher needed):
    MLX_RANK=0 MLX_WORLD_SIZE=1 NCCL_HOST_IP=127.0.0.1 NCCL_PORT=29511 NCCL_NVLS_ENABLE=0 \\
        PYTHONPATH=. python3 scripts/nccl_check.py --out nccl.json
    # several GPUs of one host:
    mlx.launch --backend nccl -n 2 --env NCCL_NVLS_ENABLE=0 -- scripts/nccl_check.py --out nccl.json
    # the same checks on CPU ranks:
    mlx.launch --backend ring -n 2 -- scripts/nccl_check.py --backend ring --out ring.json

Each check compares what came back with what every rank sent (computed here, independently of MLX), and the JSON says
which passed; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("nccl.json"))
    p.add_argument("--backend", default="nccl", help="nccl (what this is for) or ring (the same checks on CPU ranks)")
    a = p.parse_args()
    import mlx.core as mx

    from tqbench.distributed.world import Pipeline, agree, gather_stats
    from tqbench.errors import TqbenchError
    from tqbench.stream.stats import StreamStats

    t0 = time.perf_counter()
    group = mx.distributed.init(backend=a.backend, strict=True)
    rank, size = group.rank(), group.size()
    checks: dict[str, bool] = {}
    init_s = time.perf_counter() - t0

    for dtype in (mx.float16, mx.bfloat16, mx.float32, mx.int32, mx.int64, mx.uint8):
        x = mx.arange(8).astype(dtype) + rank
        got = np.array(mx.distributed.all_sum(x, group=group).astype(mx.float32)).astype(np.float64)
        want = sum(np.arange(8, dtype=np.float64) + r for r in range(size))
        checks[f"all_sum {dtype}"] = bool(np.array_equal(got, want))
        g = np.array(mx.distributed.all_gather((mx.arange(4) + 10 * rank).astype(dtype)[None], group=group)
                     .astype(mx.float32)).astype(np.float64)
        checks[f"all_gather {dtype}"] = bool(np.array_equal(g.reshape(size, 4),
                                                            np.stack([np.arange(4) + 10 * r for r in range(size)])))

    agree(group, None)  # every rank loaded: returns
    checks["agree, no error"] = True
    try:
        agree(group, ValueError("rank's own error"))
        checks["agree, own error re-raised"] = False
    except ValueError as e:
        checks["agree, own error re-raised"] = str(e) == "rank's own error"
    except TqbenchError:
        checks["agree, own error re-raised"] = False

    stats = StreamStats(misses=3 + rank, critical_bytes=10**10 + rank, stall_s=1.5, tokens=7)
    rows = gather_stats(group, Pipeline(rank=rank, size=size, start=2 * rank, end=2 * rank + 2), stats)
    checks["gather_stats"] = [(r.rank, r.layers, r.misses, r.critical_bytes, r.stall_s, r.tokens) for r in rows] == [
        (r, (2 * r, 2 * r + 2), 3 + r, 10**10 + r, 1.5, 7) for r in range(size)]

    doc = dict(rank=rank, size=size, backend=a.backend, init_s=init_s, checks=checks, passed=all(checks.values()),
               device=str(mx.default_device()), mlx=mx.__version__,
               env={k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "MLX_", "CUDA_VISIBLE"))})
    if rank == 0:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(dict(rank=rank, size=size, passed=doc["passed"],
                          failed=[k for k, v in checks.items() if not v])), flush=True)
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
