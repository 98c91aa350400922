#!/usr/bin/env python3
"""Where a streamed expert's page-in time goes on MLX's CUDA backend, one component at a time.

A page-in is: read the expert's bytes from disk (O_DIRECT, into an aligned host buffer), then put them into a slot of
a pool array the gathered matmuls read. On CUDA MLX allocates arrays in managed (unified) memory, so where a page
lives decides what a copy costs. This script measures, for K3-sized experts (10.96 MB) and pools of about 1 GiB:

- raw:        O_DIRECT reads of N experts with W threads (the disk alone);
- from_numpy: `mx.array(numpy)` of one expert, evaluated (a host copy into a managed buffer);
- first_use:  a GPU reduction over such a fresh array (its pages migrate to the GPU on demand);
- slot_lazy:  the streamer's path before this script: `pool[slot] = mx.array(buf)` per expert, one eval at the end;
- slot_async: the same with `mx.async_eval` after each write;
- direct:     the bytes read by pread straight into the pool's slot (a writable host view of the managed array);
- prefetch:   `direct` followed by the driver's cuMemPrefetchAsync of the slot to the GPU;
- pipelines:  reads by W threads with each page-in path run as reads complete, against the raw read time.

    PYTHONPATH=. python3 scripts/gpu_pagein_check.py --dir /tmp/pagein --out pagein.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

EXPERT = 10_960_896  # bytes of one K3 expert at the recipe (a multiple of 4096)
WORDS = EXPERT // 4


def aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)


class Cuda:
    """The driver API's prefetch of managed memory, through ctypes (None where there is no libcuda)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuInit(0)
        self.lib.cuMemPrefetchAsync.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.lib.cuCtxSynchronize.argtypes = []
        self.lib.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self.lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]

    def stream(self):
        s = ctypes.c_void_p()
        assert self.lib.cuStreamCreate(ctypes.byref(s), 1) == 0  # CU_STREAM_NON_BLOCKING
        return s

    def prefetch(self, ptr: int, n: int, device: int, stream=None) -> int:
        r = self.lib.cuMemPrefetchAsync(ptr, n, device, stream)
        assert r == 0, r
        return r

    def sync(self) -> int:
        return self.lib.cuCtxSynchronize()


def host_view(a: mx.array) -> np.ndarray:
    return np.asarray(memoryview(a))


def timed(fn, reps: int = 1) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/pagein")
    p.add_argument("--out", default="pagein.json")
    p.add_argument("--experts", type=int, default=48)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--slots", type=int, default=96)
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, "experts.bin")
    n = a.experts
    res: dict = {"machine": platform.node(), "mlx": mx.__version__, "device": str(mx.default_device()),
                 "expert_bytes": EXPERT, "experts": n, "workers": a.workers, "slots": a.slots}
    rng = np.random.default_rng(0)
    if not os.path.exists(path) or os.path.getsize(path) != n * EXPERT:
        with open(path, "wb") as f:
            for _ in range(n):
                f.write(rng.integers(0, 2**32, WORDS, dtype=np.uint32).tobytes())
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    bufs = [aligned(EXPERT) for _ in range(a.workers)]

    def read(e: int, buf) -> None:
        got = os.preadv(fd, [buf], e * EXPERT)
        assert got == EXPERT, got

    # raw disk: W threads, each expert into one of W buffers
    def raw():
        with ThreadPoolExecutor(a.workers) as ex:
            list(ex.map(lambda e: read(e, bufs[e % a.workers]), range(n)))
    raw()
    res["raw_s"] = timed(raw)
    res["raw_gbps"] = n * EXPERT / res["raw_s"] / 1e9

    host = np.frombuffer(bufs[0], dtype=np.uint32)
    read(0, bufs[0])
    expect = int(host.astype(np.uint64).sum())

    def from_numpy():
        x = mx.array(host)
        mx.eval(x)
        return x
    from_numpy()
    res["from_numpy_ms"] = timed(from_numpy, 10) * 1e3

    def first_use():
        x = mx.array(host)
        mx.eval(x)
        t = time.perf_counter()
        s = x.astype(mx.uint64).sum() if hasattr(mx, "uint64") else x.sum()
        mx.eval(s)
        return time.perf_counter() - t
    first_use()
    res["first_use_ms"] = sum(first_use() for _ in range(10)) / 10 * 1e3

    pool = mx.zeros((a.slots, WORDS), dtype=mx.uint32)
    mx.eval(pool)
    holder = {"w": pool}  # a second reference, as a model's projection holds the pool
    view = host_view(pool)
    res["pool_host_view"] = bool(view.flags.writeable) and view.ctypes.data != 0
    try:
        cuda = Cuda()
    except OSError as e:
        cuda, res["cuda_error"] = None, str(e)

    def check(slot: int) -> bool:
        return int(holder["w"][slot].astype(mx.uint64).sum().item()) == expect

    def slot_lazy(k: int):
        for i in range(k):
            holder["w"][i] = mx.array(host)
        mx.eval(holder["w"])

    def slot_async(k: int):
        for i in range(k):
            holder["w"][i] = mx.array(host)
            mx.async_eval(holder["w"])
        mx.eval(holder["w"])

    def touch(k: int):  # the GPU reads the k slots (as a gathered matmul would)
        mx.eval(holder["w"][:k].sum())

    def direct(k: int, prefetch: bool):
        view = host_view(holder["w"])
        for i in range(k):
            np.copyto(view[i].view(np.uint8), bufs[0])
            if prefetch and cuda:
                cuda.prefetch(view[i].ctypes.data, EXPERT, 0)

    k = 16
    before = view.ctypes.data
    slot_lazy(1)
    res["slot_write_in_place"] = host_view(holder["w"]).ctypes.data == before
    for name, fn in [("slot_lazy", lambda: slot_lazy(k)), ("slot_async", lambda: slot_async(k))]:
        fn()
        res[name + "_ms_per_expert"] = timed(fn, 3) / k * 1e3
        res[name + "_correct"] = check(k - 1)
    for pf in (False, True):
        name = "direct_prefetch" if pf else "direct"
        if pf and not cuda:
            continue
        touch(k)
        t = time.perf_counter()
        direct(k, pf)
        t1 = time.perf_counter()
        if cuda and pf:
            cuda.sync()
        t2 = time.perf_counter()
        touch(k)
        t3 = time.perf_counter()
        res[name + "_host_ms_per_expert"] = (t1 - t) / k * 1e3
        res[name + "_sync_ms_per_expert"] = (t2 - t1) / k * 1e3
        res[name + "_first_use_ms_per_expert"] = (t3 - t2) / k * 1e3
        res[name + "_correct"] = check(k - 1)

    # pipelines: W threads read, the main thread pages each expert in as its read completes
    def pipeline(mode: str) -> float:
        touch(a.slots)
        view = host_view(holder["w"])
        slot_of = {}
        t = time.perf_counter()
        with ThreadPoolExecutor(a.workers) as ex:
            if mode.startswith("into_slot"):  # the read lands in the slot itself: no staging buffer
                streams = {}
                def job(e):
                    v = view[e % a.slots].view(np.uint8)
                    if mode == "into_slot_cpu":
                        import threading
                        st = streams.setdefault(threading.get_ident(), cuda.stream())
                        cuda.prefetch(v.ctypes.data, EXPERT, -1, st)
                        cuda.lib.cuStreamSynchronize(st)
                        got = os.preadv(fd, [v], e * EXPERT)
                        assert got == EXPERT
                        cuda.prefetch(v.ctypes.data, EXPERT, 0, st)
                        return
                    got = os.preadv(fd, [v], e * EXPERT)
                    assert got == EXPERT
                    if mode == "into_slot_prefetch" and cuda:
                        cuda.prefetch(v.ctypes.data, EXPERT, 0)
                list(ex.map(job, range(n)))
            else:
                free = list(range(a.workers))
                futs = {}
                e = 0
                done = 0
                while done < n:
                    while e < n and free:
                        b = free.pop()
                        if mode == "copy_cpu":
                            cuda.prefetch(view[e % a.slots].ctypes.data, EXPERT, -1)
                        futs[ex.submit(read, e, bufs[b])] = (e, b)
                        e += 1
                    f = next(iter(futs))
                    f.result()
                    ee, b = futs.pop(f)
                    s = ee % a.slots
                    if mode == "lazy":
                        holder["w"][s] = mx.array(np.frombuffer(bufs[b], dtype=np.uint32))
                    elif mode == "async":
                        holder["w"][s] = mx.array(np.frombuffer(bufs[b], dtype=np.uint32))
                        mx.async_eval(holder["w"])
                    elif mode in ("copy", "copy_prefetch", "copy_cpu"):
                        v = view[s].view(np.uint8)
                        np.copyto(v, bufs[b])
                        if mode in ("copy_prefetch", "copy_cpu") and cuda:
                            cuda.prefetch(v.ctypes.data, EXPERT, 0)
                    slot_of[ee] = s
                    free.append(b)
                    done += 1
        if cuda:
            cuda.sync()
        touch(min(n, a.slots))
        return time.perf_counter() - t

    modes = ["lazy", "async", "copy", "copy_prefetch", "into_slot", "into_slot_prefetch"]
    for mode in modes + (["copy_cpu", "into_slot_cpu"] if cuda else []):
        try:
            pipeline(mode)
            s = min(pipeline(mode) for _ in range(2))
            res[f"pipeline_{mode}_s"] = s
            res[f"pipeline_{mode}_vs_raw"] = res["raw_s"] / s
        except Exception as e:  # noqa: BLE001 - reported
            res[f"pipeline_{mode}_error"] = " ".join(str(e).split())[:200]
    res["raw_s_again"] = timed(raw)

    # bulk host -> GPU, as conversion does (a 256 MB source slice)
    big = rng.integers(0, 2**32, 64 << 20, dtype=np.uint32)
    def bulk(prefetch: bool) -> float:
        t = time.perf_counter()
        x = mx.array(big)
        mx.eval(x)
        if prefetch and cuda:
            cuda.prefetch(host_view(x).ctypes.data, big.nbytes, 0)
            cuda.sync()
        mx.eval((x ^ 1).sum())
        return time.perf_counter() - t
    for pf in (False, True):
        bulk(pf)
        res["bulk_256MB_gbps" + ("_prefetch" if pf else "")] = big.nbytes / min(bulk(pf) for _ in range(3)) / 1e9
    if cuda:
        stage = mx.zeros(big.shape, dtype=mx.uint32)
        mx.eval(stage)
        sv = host_view(stage)
        def staged() -> float:
            mx.eval((stage ^ 1).sum())  # pages on the GPU, as after a previous use
            t = time.perf_counter()
            cuda.prefetch(sv.ctypes.data, big.nbytes, -1)
            cuda.sync()
            np.copyto(sv, big)
            cuda.prefetch(sv.ctypes.data, big.nbytes, 0)
            cuda.sync()
            mx.eval((stage ^ 1).sum())
            return time.perf_counter() - t
        staged()
        res["bulk_256MB_gbps_staged"] = big.nbytes / min(staged() for _ in range(3)) / 1e9
        def back_staged() -> float:
            x = (stage ^ 3)
            mx.eval(x)
            t = time.perf_counter()
            cuda.prefetch(host_view(x).ctypes.data, big.nbytes, -1)
            cuda.sync()
            y = np.array(x)
            return big.nbytes / (time.perf_counter() - t) / 1e9
        back_staged()
        res["gpu_to_numpy_256MB_gbps_prefetch"] = max(back_staged() for _ in range(3))
        def h2d_raw() -> float:
            mx.eval((stage ^ 1).sum())
            t = time.perf_counter()
            cuda.prefetch(sv.ctypes.data, big.nbytes, -1)
            cuda.sync()
            t1 = time.perf_counter()
            cuda.prefetch(sv.ctypes.data, big.nbytes, 0)
            cuda.sync()
            return big.nbytes / (t1 - t) / 1e9, big.nbytes / (time.perf_counter() - t1) / 1e9
        res["prefetch_d2h_h2d_gbps"] = max(h2d_raw() for _ in range(3))
    def back() -> float:
        x = (mx.array(big) ^ 3)
        mx.eval(x)
        t = time.perf_counter()
        y = np.array(x)
        return big.nbytes / (time.perf_counter() - t) / 1e9
    back()
    res["gpu_to_numpy_256MB_gbps"] = max(back() for _ in range(3))
    print(json.dumps(res, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
