"""Reading tensor data: prefetching threads, fp8 and mxfp4 decoding against independent computations."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from tqbench.quant.mxfp4 import pack_mxfp4, unpack_mxfp4
from tqbench.source.reader import ShardReader, decode_fp8, decode_mxfp4
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

    specs = [TensorSpec("a.weight", "BF16", (64, 32)), TensorSpec('odd "name" \u00e9', "U8", (3,)),
             TensorSpec("scalar", "F32", ())]
    meta = {"format": "mlx", "k": "v"}
    header, offset = {"__metadata__": meta}, 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    assert header_bytes(specs, meta) == struct.pack("<Q", len(raw)) + raw
    assert header_length(iter(specs), meta) == 8 + len(raw)
