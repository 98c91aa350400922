"""Reading tensor data: prefetching threads, fp8 and mxfp4 decoding against independent computations."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from tqbench.quant.mxfp4 import pack_mxfp4, unpack_mxfp4
from tqbench.source.reader import ShardReader, decode_fp8, decode_mxfp4
from tqbench.source.staging import ALIGN, Arena
from tqbench.shards.header import read_header
from tqbench.shards.writer import save_shard


def test_prefetched_reads_equal_direct_reads(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": ("F32", rng.standard_normal((64, 33)).astype(np.float32)) for i in range(12)}
    save_shard(tmp_path / "a.safetensors", arrays)
    entries = list(read_header(tmp_path / "a.safetensors").tensors)
    with ShardReader(tmp_path, workers=2) as r:
        r.prefetch(entries[::2])
        got = {t.name: r.read_numpy(t) for t in entries}
        assert not r._pending  # every prefetched read was collected
        r.prefetch(entries[:3])
        r.discard(entries[:3])
        assert not r._pending
    for name, (_, a) in arrays.items():
        np.testing.assert_array_equal(got[name], a)


def test_decode_mxfp4_is_our_reference_decoder():
    w = np.random.default_rng(1).standard_normal((8, 96)).astype(np.float32) * 3
    packed, scales = pack_mxfp4(w)
    np.testing.assert_array_equal(np.array(decode_mxfp4(mx.array(packed), mx.array(scales))),
                                  unpack_mxfp4(packed, scales))


def test_decode_fp8_with_block_scales():
    rng = np.random.default_rng(2)
    out, inp, block = 200, 300, 128
    codes = rng.integers(0, 256, (out, inp), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # skip NaN encodings
    scale_inv = rng.uniform(0.5, 2.0, (-(-out // block), -(-inp // block))).astype(np.float32)

    def e4m3(b: int) -> float:  # independent decoder: sign, 4 exponent bits (bias 7), 3 mantissa bits
        s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
        v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        return -v if s else v

    table = np.array([e4m3(b) for b in range(256)], np.float32)
    expected = table[codes] * np.repeat(np.repeat(scale_inv, block, 0), block, 1)[:out, :inp]
    got = np.array(decode_fp8(mx.array(codes), mx.array(scale_inv), (block, block)))
    np.testing.assert_array_equal(got, expected)


def test_streamed_header_is_json_dumps_of_the_header_dict():
    """header_parts/header_bytes write what json.dumps(separators=(",", ":")) of the header dict gives."""
    import json
    import struct

    from tqbench.shards import TensorSpec, header_bytes
    from tqbench.shards.writer import header_length

    specs = [TensorSpec(name="a.weight", dtype="BF16", shape=(64, 32)), TensorSpec(name='odd "name" \u00e9', dtype="U8",
                                                                                   shape=(3,)),
             TensorSpec(name="scalar", dtype="F32", shape=())]
    meta = {"format": "mlx", "k": "v"}
    header, offset = {"__metadata__": meta}, 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    assert header_bytes(specs, meta) == struct.pack("<Q", len(raw)) + raw
    assert header_length(iter(specs), meta) == 8 + len(raw)


def test_arena_hands_out_regions_in_order_and_wraps_only_into_freed_space():
    a = Arena(10 * ALIGN)
    assert a.capacity == 10 * ALIGN
    r1, r2, r3 = a.reserve(3 * ALIGN), a.reserve(3 * ALIGN - 5), a.reserve(2 * ALIGN)
    assert (r1.start, r2.start, r3.start) == (0, 3 * ALIGN, 6 * ALIGN)
    assert r2.end == 6 * ALIGN - 5  # the region is the bytes asked for; the next starts on the next page
    assert a.reserve(3 * ALIGN) is None  # 2 pages left at the end, nothing freed at the start
    r2.collected = True
    assert a.release() == 0  # the oldest (r1) is still in use: nothing is freed out of order
    r1.collected = True
    assert a.release() == 2 and a.used == 2 * ALIGN
    r4 = a.reserve(4 * ALIGN)  # does not fit after r3 (2 pages): wraps to 0, below r3
    assert r4.start == 0 and a.used == 10 * ALIGN - 6 * ALIGN + 4 * ALIGN
    assert a.reserve(3 * ALIGN) is None  # wrapped: only 2 pages between r4 and r3
    r5 = a.reserve(2 * ALIGN)
    assert r5.start == 4 * ALIGN
    assert a.reserve(11 * ALIGN) is None  # larger than the arena: never
    for r in (r3, r4, r5):
        r.collected = True
    assert a.release() == 3 and a.used == 0
    assert a.reserve(10 * ALIGN).start == 0  # empty again: the whole arena from 0


def test_staged_reads_are_views_of_the_arena_equal_to_direct_reads(tmp_path):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    packed, scales = pack_mxfp4(w)
    arrays = {"packed": ("U8", packed), "scales": ("F8_E8M0", scales),
              "f32": ("F32", rng.standard_normal((5, 7)).astype(np.float32)),
              "bf16": ("BF16", rng.integers(0, 2**15, (3, 9), dtype=np.uint16)),
              "i32": ("I32", rng.integers(-9, 9, (11,), dtype=np.int32))}
    save_shard(tmp_path / "a.safetensors", arrays)
    entries = {t.name: t for t in read_header(tmp_path / "a.safetensors").tensors}
    with ShardReader(tmp_path) as plain:
        want = {n: np.array(plain.read_mlx(t).view(mx.uint8) if t.dtype == "BF16" else plain.read_mlx(t))
                for n, t in entries.items()}
    with ShardReader(tmp_path, workers=2, stage_bytes=64 * 2**10) as r:
        r.prefetch_mlx(list(entries.values()))
        assert r.staged_reads == 5 and r.arena_full == 0 and not r._pending
        got = {n: r.read_mlx(t) for n, t in entries.items()}
        assert got["bf16"].dtype == mx.bfloat16 and got["scales"].dtype == mx.uint8
        for n, t in entries.items():
            g = got[n].view(mx.uint8) if t.dtype == "BF16" else got[n]
            np.testing.assert_array_equal(np.array(g), want[n])
        # a view: the arena's bytes, where the region starts
        start = r._arena._live[0].start
        assert bytes(r._arena.view[start:start + packed.nbytes]) == packed.tobytes()
        decoded = np.array(decode_mxfp4(got["packed"], got["scales"]))
        np.testing.assert_array_equal(decoded, unpack_mxfp4(packed, scales))
        r.release()
        assert r._arena.used == 0


def test_a_full_arena_falls_back_to_bytes_and_every_read_is_collected(tmp_path):
    rng = np.random.default_rng(4)
    arrays = {f"t{i}": ("F32", rng.standard_normal((32, 64)).astype(np.float32)) for i in range(6)}  # 8 KiB each
    save_shard(tmp_path / "a.safetensors", arrays)
    entries = list(read_header(tmp_path / "a.safetensors").tensors)
    with ShardReader(tmp_path, workers=2, stage_bytes=3 * ALIGN * 2) as r:  # room for three 2-page tensors
        r.prefetch_mlx(entries)
        assert (r.staged_reads, r.arena_full) == (3, 3) and len(r._pending) == 3
        first = np.array(r.read_mlx(entries[0]))
        second = r.read_bytes(entries[1])  # a staged tensor read as bytes: copied out of the arena
        r.discard(entries[2:4])  # one staged, one pending as bytes
        r.release()
        assert r._arena.used == 0 and set(r._pending) == {(t.shard, t.offset, t.nbytes) for t in entries[4:]}
        r.prefetch_mlx(entries[2:4])  # room again
        assert r.staged_reads == 5
        rest = [np.array(r.read_mlx(t)) for t in entries[2:]]
        assert not r._pending and not r._staged
    np.testing.assert_array_equal(first, arrays["t0"][1])
    np.testing.assert_array_equal(np.frombuffer(second, np.float32).reshape(32, 64), arrays["t1"][1])
    for i, got in enumerate(rest, 2):
        np.testing.assert_array_equal(got, arrays[f"t{i}"][1])
