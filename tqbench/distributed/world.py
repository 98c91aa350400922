"""The ranks a command runs on, when `mlx.launch` (or MPI) started several: MLX's distributed group, the layers a
rank holds, and how every rank learns that one of them failed.

Pipeline parallel by layers, as mlx-lm's `pipeline(group)` splits them: rank 0 runs the last layers and is the face
(it prints, serves, draws); the other ranks are headless and run the same forward passes in step. Nothing here is a
transport of tqbench's own: the group is `mx.distributed.init()`, the messages its collectives.

A rank that fails before the first forward pass (a bad model path, a budget that cannot hold one expert) must not
leave the others waiting on it: every rank reaches `agree` after loading, with its error or none, and every rank
raises the same one line naming the first rank that failed and why. A rank that dies later closes its sockets; the
others' next collective fails within a second (the ring backend), and `lost` turns that into one line."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

from tqbench.errors import TqbenchError

RANK_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
MESSAGE_BYTES = 512  # an error's one line, as every rank receives it


def env_rank() -> int | None:
    """This process's rank as the launcher set it, None when no launcher did (no MLX needed: the CLI decides from it
    whether to print)."""
    for var in RANK_VARS:
        value = os.environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """This rank's place in a pipeline: its rank, the group's size, and its layers [start, end)."""

    rank: int
    size: int
    start: int
    end: int

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.end


@cache
def join():
    """MLX's distributed group when a launcher started several ranks, else None (made once per process). Engine
    thread (MLX)."""
    if env_rank() is None:
        return None
    import mlx.core as mx

    group = mx.distributed.init()
    return group if group.size() > 1 else None


def split(group, model) -> Pipeline:
    """Give this rank its contiguous layers (mlx-lm's own split: rank 0 the last ones). Raises TqbenchError for a model
    family mlx-lm cannot pipeline."""
    inner = getattr(model, "language_model", model)
    inner = getattr(inner, "model", None)
    if inner is None or not hasattr(inner, "pipeline"):
        raise TqbenchError(f"this model's family has no pipeline split in mlx-lm: it cannot run across "
                           f"{group.size()} ranks")
    if len(inner.layers) < group.size():
        raise TqbenchError(f"{len(inner.layers)} layers cannot be split across {group.size()} ranks")
    inner.pipeline(group)
    return Pipeline(rank=group.rank(), size=group.size(), start=inner.start_idx, end=inner.end_idx)


def agree(group, error: BaseException | None) -> None:
    """Every rank calls this after loading, with the error it met (None: it loaded). If any rank failed, every rank
    raises TqbenchError naming the first that did and its one line; the rank that failed re-raises its own error."""
    import mlx.core as mx
    import numpy as np

    line = "" if error is None else (str(error) or type(error).__name__).splitlines()[0]
    mine = np.zeros(MESSAGE_BYTES + 1, dtype=np.uint8)
    if error is not None:
        data = line.encode()[:MESSAGE_BYTES]
        mine[0] = 1
        mine[1:1 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    every = np.array(mx.distributed.all_gather(mx.array(mine)[None], group=group)).reshape(group.size(), -1)
    failed = [r for r in range(group.size()) if every[r, 0]]
    if error is not None:
        raise error
    if failed:
        r = failed[0]
        why = bytes(every[r, 1:]).rstrip(b"\0").decode(errors="replace")
        raise TqbenchError(f"rank {r} of {group.size()} failed to load: {why}")


def every(group, flag: bool) -> bool:
    """True on every rank when `flag` is true on every rank (one all_sum)."""
    import mlx.core as mx

    n = mx.distributed.all_sum(mx.array([1 if flag else 0], dtype=mx.int32), group=group)
    return int(n.item()) == group.size()


@dataclass(frozen=True, kw_only=True)
class RankStats:
    """One pipeline rank's expert streaming, as rank 0 gathers it after each reply (a chat's StreamReport.ranks)."""

    rank: int
    layers: tuple[int, int]  # [start, end)
    streamed: bool  # False: its experts are resident (or its layers have none)
    hits_gpu: int
    hits_host: int
    misses: int
    critical_bytes: int  # read from disk while its layers waited
    stall_s: float
    tokens: int  # forward passes

    def to_dict(self) -> dict:
        return {"rank": self.rank, "layers": list(self.layers), "streamed": self.streamed, "hits_gpu": self.hits_gpu,
                "hits_host": self.hits_host, "misses": self.misses, "critical_bytes": self.critical_bytes,
                "stall_s": round(self.stall_s, 4), "tokens": self.tokens}


def gather_stats(group, pipeline: Pipeline, stats) -> tuple:
    """Every rank's streaming counters (`stats`: its StreamStats, None when it streams nothing), on every rank: one
    all_gather after a reply, every rank calling it. Returns RankStats per rank, rank 0 first."""
    import mlx.core as mx
    import numpy as np

    s = stats
    mine = np.array([pipeline.start, pipeline.end, s is not None, s.hits_gpu if s else 0, s.hits_host if s else 0,
                     s.misses if s else 0, s.critical_bytes if s else 0, round(s.stall_s * 1e6) if s else 0,
                     s.tokens if s else 0], dtype=np.int64)  # stall in microseconds
    # The reply's generator may have launched one more forward pass on mlx-lm's generation stream (it evaluates the
    # next token's asynchronously) whose collectives are still in flight: they end first, on every rank, or this
    # gather would read their bytes.
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    raw = mx.distributed.all_gather(mx.array(mine.view(np.uint8))[None], group=group)
    rows = np.array(raw).reshape(group.size(), -1).view(np.int64)
    return tuple(RankStats(rank=r, layers=(int(x[0]), int(x[1])), streamed=bool(x[2]), hits_gpu=int(x[3]),
                           hits_host=int(x[4]), misses=int(x[5]), critical_bytes=int(x[6]), stall_s=int(x[7]) / 1e6,
                           tokens=int(x[8])) for r, x in enumerate(rows))


def in_step(events, pipeline: Pipeline):
    """`events` (a generator) on a rank of a pipeline: a collective that fails because another rank went away is one
    line."""
    try:
        return (yield from events)
    except RuntimeError as e:
        if "[ring]" in str(e) or "peer" in str(e) or "NCCL" in str(e) or "MPI" in str(e):
            raise lost(e, pipeline) from None
        raise


def lost(error: BaseException, pipeline: Pipeline) -> TqbenchError:
    """The one line for a collective that failed because another rank went away."""
    return TqbenchError(f"rank {pipeline.rank} of {pipeline.size}: another rank stopped ({str(error).strip()})")
